"""What an endpoint is sent and what its answers hold: a chat task's request fields (sampling, the
structured-output constraint the way vLLM's server takes it, log-probabilities), an embedding
task's texts grouped into `/v1/embeddings` requests, and the vectors and token log-probabilities
read back from the responses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec, TaskSpec

# Texts per `/v1/embeddings` request at most (OpenAI takes 2048); fewer when a batch is small, so
# that it still fills `concurrency` requests.
MAX_TEXTS_PER_EMBEDDING_REQUEST = 64


@dataclass(frozen=True)
class EmbeddingRequest:
    """One `/v1/embeddings` request: the positions of its texts in the batch, and the token count
    the server is to cut them to (vLLM's `truncate_prompt_tokens`), for texts cut locally."""

    positions: tuple[int, ...]
    truncate_to: int | None = None


def embedding_requests(
    lengths: Sequence[int], concurrency: int, max_model_len: int, most: int = MAX_TEXTS_PER_EMBEDDING_REQUEST
) -> list[EmbeddingRequest]:
    """A batch of texts (their local token counts) grouped into `/v1/embeddings` requests: as many
    texts per request as keep `concurrency` requests busy, at most `most`. Texts of `max_model_len`
    tokens (cut to it by `input.truncate`, or exactly that long) go in requests of their own that ask
    the server to cut them the same way; the others are sent as they are, which any server takes."""
    whole = [i for i, n in enumerate(lengths) if n < max_model_len]
    cut = [i for i, n in enumerate(lengths) if n >= max_model_len]
    size = max(1, min(most, math.ceil(len(lengths) / concurrency)))
    return [
        EmbeddingRequest(tuple(positions[start : start + size]), truncate_to)
        for positions, truncate_to in ((whole, None), (cut, max_model_len))
        for start in range(0, len(positions), size)
    ]


def response_vectors(response, count: int) -> list[list[float]]:
    """The vectors of an embeddings response in input order (by each entry's `index`); a response
    that does not hold exactly one vector of numbers per text raises ValueError."""
    data = sorted(response.data, key=lambda entry: entry.index)
    if [entry.index for entry in data] != list(range(count)):
        raise ValueError(f"the response has embeddings for indices {[e.index for e in data][:10]}, not 0..{count - 1}")
    vectors = [entry.embedding for entry in data]
    for vector in vectors:
        if not isinstance(vector, list) or not vector or not all(isinstance(v, int | float) for v in vector):
            raise ValueError("an embedding in the response is not a list of numbers")
    return vectors


def chat_request_params(
    task: TaskSpec,
    model: str,
    structured_outputs: bool = True,
    sampling: SamplingSpec | None = None,
    output: OutputSpec | None = None,
    logprobs: bool = True,
) -> dict:
    """The chat-completions request fields (besides `messages`) for a task, or for one request
    that overrides the task's `sampling` / `output`."""
    sampling = sampling or task.sampling
    # `max_tokens` rather than `max_completion_tokens`: vLLM takes both, but many other
    # OpenAI-compatible servers (TGI, llama.cpp, managed endpoints) only know `max_tokens`.
    params: dict = {
        "model": model,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
    }
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    stop = getattr(sampling, "stop", None)  # a request's own stop strings (an OpenAI batch line's `stop`)
    if stop:
        params["stop"] = list(stop)
    top_logprobs = getattr(sampling, "logprobs", None)  # an OpenAI batch line's own `logprobs` request
    if top_logprobs is not None:
        params["logprobs"], params["top_logprobs"] = True, top_logprobs
    output = output or task.output
    if not structured_outputs or output.kind == "text":
        return params
    if logprobs and output.has_confidence:
        params["logprobs"] = True  # the sampled tokens' log-probabilities: the label's confidence
    if output.kind == "json_schema":
        # The standard OpenAI field; vLLM's server turns it into its JSON structured output.
        params["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": task.name, "schema": output.json_schema},
        }
    elif output.kind == "choices":
        # vLLM's own request field (`guided_choice` in vLLM < 0.11): no OpenAI equivalent exists.
        params["extra_body"] = {"structured_outputs": {"choice": list(output.choices or [])}}
    elif output.kind == "regex":
        params["extra_body"] = {"structured_outputs": {"regex": output.regex}}
    return params


def cumulative_logprob(choice) -> float | None:
    """The sum of the sampled tokens' log-probabilities, when the server returned them (a server
    may ignore `logprobs`, or return none for some tokens: then None, never a partial sum)."""
    tokens = getattr(choice.logprobs, "content", None) if choice.logprobs is not None else None
    if not tokens or any(token.logprob is None for token in tokens):
        return None
    return float(sum(token.logprob for token in tokens))


def token_logprobs_text(content: Sequence[dict] | None) -> str | None:
    """OpenAI's chat `logprobs.content` (its entries as dicts) as the JSON text of
    `Generation.token_logprobs`, each entry's fields in the order vLLM writes them; None for none."""
    if not content:
        return None

    def entry(token: dict) -> dict:
        return {"token": token["token"], "logprob": token["logprob"], "bytes": token.get("bytes")}

    entries = [{**entry(t), "top_logprobs": [entry(a) for a in t.get("top_logprobs") or []]} for t in content]
    return json.dumps(entries, ensure_ascii=False)
