"""What the engine is sent of OpenAI batch lines: each request as an engine `Prompt` with its own
sampling and output constraint, and the line's messages or pictures where the engine takes them."""

from __future__ import annotations

import json

import polars as pl

from batch_assets.pipeline.engine_contract import Prompt, keys_of
from batch_assets.pipeline.format_prompts import Tokenizer
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.pipeline.openai_batch.image_parts import line_images
from batch_assets.pipeline.openai_batch.sampling import RequestSpec


def batch_prompt_encoder(engine, task, tokenizer: Tokenizer, formatted: pl.DataFrame):
    """`encode(texts, request_params)` for `run_inference`: each request as an engine `Prompt` with
    its own sampling (stop strings included) and output constraint, and, for an engine that sends
    chat messages, the line's messages (its `image_url` parts as written); for the in-process
    engine, a line's pictures (`Prompt.images`, decoded from its data: URLs)."""
    valid = formatted.filter(pl.col("error").is_null())
    digests = valid[DIGEST_COLUMN].to_list() if DIGEST_COLUMN in valid.columns else [None] * valid.height
    # Identical prompt texts come from identical messages, so the prompt is a safe key for them; a
    # rendered prompt holds no picture, so an image line's is found with its pictures' digest. The
    # in-process engine needs only image lines' messages (for their pictures).
    messages_of = {
        (prompt, digest): messages
        for prompt, digest, messages in zip(
            valid["prompt"].to_list(), digests, valid["messages"].to_list(), strict=True
        )
        if engine.sends_chat_messages or digest is not None
    }

    def encode(
        prompts: list[str],
        params: list[str],
        keys: list[str] | None = None,
        image_digests: list[str | None] | None = None,
    ) -> list[Prompt]:
        token_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        out = []
        digests_of = image_digests if image_digests is not None else [None] * len(prompts)
        for prompt, ids, param, key, digest in zip(
            prompts, token_ids, params, keys_of(prompts, keys), digests_of, strict=True
        ):
            spec = RequestSpec.from_params_json(param)
            text = messages_of.get((prompt, digest))
            messages = json.loads(text) if text else None
            if engine.sends_chat_messages:
                out.append(
                    Prompt(tuple(ids), tuple(messages) if messages else None, spec.sampling, spec.output, key=key)
                )
            else:
                images = tuple(line_images(messages)) if messages else ()
                out.append(Prompt(tuple(ids), None, spec.sampling, spec.output, key=key, images=images))
        return out

    return encode
