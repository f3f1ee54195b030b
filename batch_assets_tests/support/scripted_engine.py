"""`run_inference` without an engine: plain deterministic functions standing in for an engine's contract
(one Generation per prompt, in order), behind the session interface every engine offers, and the
formatted frames they read (test_inference_checkpoints, test_result_cache)."""

from __future__ import annotations

import polars as pl

from batch_assets.pipeline.engine_contract import Generation, Prompt, batched_stream, keys_of
from batch_assets.pipeline.inference_requests import PartitionInput
from batch_assets.pipeline.run_inference import run_inference
from batch_assets.storage.checkpoints import CheckpointStore


def formatted_frame(texts: list[str | None], extra: dict | None = None) -> pl.DataFrame:
    n = len(texts)
    return pl.DataFrame(
        {
            "row_id": list(range(n)),
            "source_line": list(range(1, n + 1)),
            "text": texts,
            **(extra or {}),
            "error": [None if t is not None else f"null_text: f.jsonl line {i + 1}: null" for i, t in enumerate(texts)],
            "prompt": [None if t is None else f"<prompt>{t}</prompt>" for t in texts],
            "num_prompt_tokens": [None if t is None else len(t) + 2 for t in texts],
        },
        schema_overrides={"error": pl.String, "prompt": pl.String, "num_prompt_tokens": pl.Int64},
    )


def tokenize(prompts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in prompt[8:-9]] + [0, 0] for prompt in prompts]


def encode(prompts: list[str], keys: list[str] | None = None) -> list[Prompt]:
    return [Prompt(tuple(ids), key=key) for ids, key in zip(tokenize(prompts), keys_of(prompts, keys), strict=True)]


class Engine:
    """Deterministic outputs (the label is the text reversed); fails after `fail_after` prompts."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.seen: list[list[int]] = []
        self.fail_after = fail_after
        self.calls = 0

    def __call__(self, prompts: list[Prompt]) -> list[Generation]:
        token_ids = [list(p.token_ids) for p in prompts]
        if self.fail_after is not None and len(self.seen) + len(token_ids) > self.fail_after:
            raise RuntimeError("EngineCore died: Killed (exit code -9)")
        self.calls += 1
        self.seen += token_ids
        return [
            Generation("".join(chr(c) for c in ids if c)[::-1], "stop", len(ids), 3, cumulative_logprob=-len(ids) / 100)
            for ids in token_ids
        ]


class Session:
    """The session interface over a batch engine: calls of up to `batch_size` prompts; counts starts."""

    started_here = True
    start_seconds = 0.0

    def __init__(self, engine: Engine, batch_size: int) -> None:
        self.starts = 0
        self.started_for = 0  # the requests the first start was told the stream holds
        self._stream = batched_stream(engine, batch_size)

    def start(self, requests: int = 0) -> None:  # idempotent, as the engines' sessions are
        if not self.starts:
            self.started_for = requests
        self.starts = 1

    def stream(self, prompts):
        self.start()
        return self._stream(prompts)


def infer(
    frame: pl.DataFrame,
    engine: Engine,
    store: CheckpointStore | None,
    *,
    batch_size: int = 4,
    deduplicate: bool = True,
    max_model_len: int = 64,
    cache=None,
    log=lambda message: None,
    session: Session | None = None,
):
    [(out, stats)] = run_inference(
        [PartitionInput(frame, encode, store, "posts.jsonl")],
        session=session or Session(engine, batch_size),
        max_model_len=max_model_len,
        max_tokens=8,
        batch_size=batch_size,
        deduplicate=deduplicate,
        cache=cache,
        log=log,
    )
    return out, stats
