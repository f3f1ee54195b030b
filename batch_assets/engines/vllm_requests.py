"""One request to the in-process engine and its answer: vLLM's sampling or pooling parameters for
a prompt, the `Generation` made of what vLLM returns, and vLLM's reason when it refused a request.

A chat model generates (`sampling_params_for`, answered by `chat_generation`); an embedding model
on vLLM's pooling runner encodes (`pooling_params`, what `LLM.embed` asks; answered by
`embedding_generation`, whose vector pipeline/result_stores.py encodes).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec


def chat_generation(output, prompt: Prompt) -> Generation:
    """A chat completion (vLLM's `RequestOutput`) as a `Generation`, with the token log-probabilities
    an OpenAI batch line asked for."""
    completion = output.outputs[0]
    top = getattr(prompt.sampling, "logprobs", None)  # an OpenAI batch line's `top_logprobs`, when it asked
    generation = Generation(
        text=completion.text,
        finish_reason=completion.finish_reason,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_generated_tokens=len(completion.token_ids),
        cumulative_logprob=completion.cumulative_logprob,  # None unless the request asked for logprobs
    )
    if top is None or completion.logprobs is None:
        return generation
    steps, tokens = len(completion.logprobs), len(completion.token_ids)
    if steps != tokens:
        # An error row, not logprobs cut to the shorter: the line asked for one entry per generated
        # token, and a list that silently stops short (or pairs a step with the wrong token) is wrong
        # data its user cannot see. The row is not cached, so a re-run asks again; the text stays.
        return replace(
            generation,
            error=f"logprobs_mismatch: the engine returned {steps} log-probability steps for {tokens} generated "
            "tokens; re-run the file, or drop `logprobs` from the line",
        )
    content = chat_logprobs(completion.token_ids, completion.logprobs, top)
    return replace(generation, token_logprobs=json.dumps(content, ensure_ascii=False))


def chat_logprobs(token_ids, logprobs, top: int) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` of one completion, written as vLLM's OpenAI server writes it
    (`OpenAIServingChat._create_chat_logprobs`, a method of a running server, so not called here):
    each sampled token's text, log-probability (at least -9999.0) and UTF-8 bytes, and the first `top`
    entries of vLLM's logprobs of that step as its `top_logprobs` (vLLM's order: the sampled token,
    then the most likely ones). A token vLLM left undecoded is named `token_id:N`, vLLM's form."""
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        sampled = step.get(token_id) if step else None
        if sampled is None:  # vLLM computed no log-probability for the token: its text alone
            token = f"token_id:{token_id}"
            content.append({"token": token, "logprob": -9999.0, "bytes": list(token.encode()), "top_logprobs": []})
            continue
        alternatives = []
        for other_id, other in list(step.items())[:top]:
            text = other.decoded_token if other.decoded_token is not None else f"token_id:{other_id}"
            alternatives.append(
                {"token": text, "logprob": max(other.logprob, -9999.0), "bytes": list(text.encode("utf-8", "replace"))}
            )
        decoded = sampled.decoded_token
        content.append(
            {
                "token": decoded if decoded is not None else f"token_id:{token_id}",
                "logprob": max(sampled.logprob, -9999.0),
                "bytes": None if decoded is None else list(decoded.encode("utf-8", "replace")),
                "top_logprobs": alternatives,
            }
        )
    return content


def embedding_generation(output, prompt: Prompt | None = None) -> Generation:
    """A pooling result as a `Generation` carrying its vector."""
    return Generation(
        text=None,
        vector=tuple(output.outputs.data.float().cpu().tolist()),
        finish_reason=None,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_generated_tokens=0,
    )


def pooling_params():
    """An embedding request: vLLM's `LLM.embed` task with the model's own pooling and normalization."""
    from vllm import PoolingParams

    return PoolingParams(task="embed")


def structured_outputs_for(output: OutputSpec):
    from vllm.sampling_params import StructuredOutputsParams

    if output.kind == "choices":
        return StructuredOutputsParams(choice=list(output.choices or []))
    if output.kind == "json_schema":
        return StructuredOutputsParams(json=output.json_schema)
    if output.kind == "regex":
        return StructuredOutputsParams(regex=output.regex)
    return None


def sampling_params_for(sampling: SamplingSpec, output: OutputSpec | None, *, logprobs: bool = False):
    """vLLM's sampling parameters for one request; `output` None: unconstrained.

    `logprobs`: return the sampled tokens' log-probabilities (the `confidence` of a label). vLLM
    computes them from the logits after the structured-output mask (the grammar bitmask is applied
    before the sampler), so they are renormalized over the outputs the constraint allows.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # An OpenAI batch line's own `logprobs` request: its `top_logprobs` alternatives per token.
    top_logprobs = getattr(sampling, "logprobs", None)
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        # Stop strings come with a request's own sampling (an OpenAI batch line's `stop`).
        stop=list(getattr(sampling, "stop", None) or []) or None,
        structured_outputs=structured_outputs_for(output) if output is not None else None,
        # 0: the sampled token's only, no alternatives
        logprobs=top_logprobs if top_logprobs is not None else (0 if logprobs else None),
        output_kind=RequestOutputKind.FINAL_ONLY,  # only finished results: nothing to stream token by token
    )


def refused_request(exc: BaseException) -> str | None:
    """vLLM's reason when it refused one request (its client errors, and a `ValueError` from checking
    the request that `AsyncLLM.generate` wraps in `EngineGenerateError`), else None: an engine
    failure, which fails the stream."""
    from batch_assets.runtime.vllm_private import EngineGenerateError, VLLMClientError

    if isinstance(exc, VLLMClientError):
        return f"the engine refused the request: {exc}"
    if isinstance(exc, EngineGenerateError) and isinstance(exc.__cause__, ValueError):
        return f"the engine refused the request: {exc.__cause__}"
    return None
