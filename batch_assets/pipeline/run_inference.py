"""Send a partition's valid prompts to the engine as one stream; checkpoint; cache; join results back.

Engine-agnostic: takes a `tokenize` and a `generate` function, so the pure logic (deduplication,
checkpoint reuse, batching, joining, errors for prompts that do not fit) is tested without Dagster.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import polars as pl

from batch_assets.storage.checkpoints import CHECKPOINT_SCHEMA, CheckpointStore
from batch_assets.storage.result_cache import ResultCache
from batch_assets.engines.vllm_engine import Generation

# Prompts in (pulled lazily), (position, result) out in the order results finish.
GenerateStream = Callable[[Iterator[list[int]]], Iterator[tuple[int, Generation]]]
MIN_PROGRESS_BATCH = 64
_KEY, _ENGINE_ERROR, _ENGINE_PROMPT_TOKENS = "\x00request_key", "\x00engine_error", "\x00engine_prompt_tokens"


class InferenceError(RuntimeError):
    """The engine failed mid-partition: the message has the engine's own error and what was kept."""


@dataclass
class InferenceStats:
    rows: int = 0
    rows_inferred: int = 0
    rows_from_checkpoint: int = 0
    rows_from_cache: int = 0
    rows_cached: int = 0
    rows_deduplicated: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # From the first request to the last result: tokenization, the engine and checkpoint writes
    # (not engine start-up).
    engine_seconds: float = 0.0
    engine_start_seconds: float = 0.0

    @property
    def inference_seconds(self) -> float:
        """`engine_seconds` under the name the metadata and benchmarks have used since before the stream."""
        return self.engine_seconds

    @property
    def generated_tokens_per_second(self) -> float:
        return self.generated_tokens / self.engine_seconds if self.engine_seconds else 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows_inferred / self.engine_seconds if self.engine_seconds else 0.0


def request_keys(
    prompts: Sequence[str], row_ids: Sequence[int], deduplicate: bool, params: Sequence[str | None] | None = None
) -> list[str]:
    """Identical prompts share a key when decoding is deterministic, so they are inferred once.

    `params`: per-request sampling and output constraint (canonical JSON, e.g. each line of an
    OpenAI batch file), part of the key so requests that differ in them never share a result.
    """
    if params is not None:
        prompts = [p if q is None else f"{q}\x00{p}" for p, q in zip(prompts, params, strict=True)]
    if deduplicate:
        return [hashlib.sha1(p.encode("utf-8")).hexdigest() for p in prompts]
    return [hashlib.sha1(f"{r}\x00{p}".encode("utf-8")).hexdigest() for p, r in zip(prompts, row_ids, strict=True)]


def batched_stream(generate: Callable[[list[list[int]]], list[Generation]], batch_size: int) -> GenerateStream:
    """A stream over a batch `generate` function: `batch_size` prompts per call, results in order."""

    def stream(prompts: Iterator[list[int]]) -> Iterator[tuple[int, Generation]]:
        position = 0
        while batch := list(itertools.islice(prompts, batch_size)):
            generated = generate(batch)
            if len(generated) != len(batch):
                raise RuntimeError(f"the engine returned {len(generated)} outputs for {len(batch)} prompts")
            for generation in generated:
                yield position, generation
                position += 1

    return stream


def run_inference(
    formatted: pl.DataFrame,
    *,
    tokenize: Callable[[list[str]], list[list[int]]],
    generate: Callable[[list[list[int]]], list[Generation]] | None = None,
    generate_stream: GenerateStream | None = None,
    max_model_len: int,
    max_tokens: int,
    batch_size: int,
    deduplicate: bool,
    checkpoints: CheckpointStore | None,
    cache: ResultCache | None = None,
    log: Callable[[str], None] = lambda message: None,
    start_engine: Callable[[], object] | None = None,
) -> tuple[pl.DataFrame, InferenceStats]:
    """formatted_prompts → inference_outputs, reusing cached and checkpointed results.

    Requests already in the result `cache` (deterministic decoding only) or in this partition's
    `checkpoints` are not inferred again. The rest go to the engine as one stream
    (`generate_stream`: prompts are pulled lazily and results come back as they finish, so the
    engine never idles between chunks), or in calls of up to `batch_size` to `generate`. Every
    ~10 % of the work the finished results are checkpointed and progress is logged; at the end the
    new results are added to the cache.

    `start_engine`, when given, is called once before the first request (and not at all when
    every result is reused), so engine start-up is timed apart from inference.
    """
    if (generate is None) == (generate_stream is None):
        raise ValueError("pass exactly one of `generate` and `generate_stream`")
    stats = InferenceStats(rows=formatted.height)
    # `request_params`: per-request sampling and output (OpenAI batch lines); absent for task-wide sampling.
    per_request = "request_params" in formatted.columns
    valid = formatted.filter(pl.col("error").is_null()).select("row_id", "prompt", *(["request_params"] if per_request else []))
    params = valid["request_params"].to_list() if per_request else None
    keyed = valid.with_columns(
        request_key=pl.Series(request_keys(valid["prompt"].to_list(), valid["row_id"].to_list(), deduplicate, params), dtype=pl.String)
    )
    unique_requests = keyed.unique("request_key", keep="first", maintain_order=True)
    stats.rows_deduplicated = keyed.height - unique_requests.height

    cached = cache.lookup(unique_requests["request_key"]) if cache is not None and deduplicate else pl.DataFrame(schema=CHECKPOINT_SCHEMA)
    stats.rows_from_cache = cached.height
    remaining = unique_requests.join(cached.select("request_key"), on="request_key", how="anti", maintain_order="left")
    done = checkpoints.load() if checkpoints is not None else pl.DataFrame(schema=CHECKPOINT_SCHEMA)
    done = done.join(remaining.select("request_key"), on="request_key", how="semi")
    pending = remaining.join(done.select("request_key"), on="request_key", how="anti", maintain_order="left")
    stats.rows_from_checkpoint = done.height
    if cached.height or done.height:
        log(f"reusing {cached.height} results from the result cache and {done.height} from checkpoints; {pending.height} requests left to infer")

    results = [cached, done]
    new_results: list[pl.DataFrame] = [done]  # what this partition adds to the cache
    total = pending.height
    # A checkpoint and a progress line every ~10 % of the work, at least every 64 requests
    # (so tiny partitions do not write a file per row), never more than `batch_size`.
    step = min(batch_size, max(MIN_PROGRESS_BATCH, -(-total // 10)))
    if total:
        log(f"{total} requests to infer ({stats.rows_deduplicated} duplicate prompts share a request); checkpoint every {step}")
    if total and start_engine is not None:
        started = time.monotonic()
        start_engine()
        stats.engine_start_seconds = time.monotonic() - started

    sent_keys: list[str] = []  # request key of each prompt handed to the engine, by position
    too_long: list[dict] = []  # rows for prompts that do not fit, until the next flush
    skipped = 0

    def prompts_to_send() -> Iterator[list[int]]:
        # Tokenized `step` at a time, as the engine asks for more; too-long prompts never reach it.
        nonlocal skipped
        for offset in range(0, total, step):
            batch = pending.slice(offset, step)
            texts = batch["prompt"].to_list()
            if per_request:
                request_params = batch["request_params"].to_list()
                encoded = tokenize(texts, request_params)
                limits = [json.loads(p)["sampling"]["max_tokens"] for p in request_params]
            else:
                encoded, limits = tokenize(texts), itertools.repeat(max_tokens)
            for key, ids, limit in zip(batch["request_key"], encoded, limits):
                if len(ids) <= max_model_len - limit:
                    sent_keys.append(key)
                    yield ids
                else:
                    skipped += 1
                    too_long.append(_too_long_row(key, len(ids), limit, max_model_len))

    stream = generate_stream if generate_stream is not None else batched_stream(generate, step)
    buffer: list[tuple[str, Generation]] = []
    saved = 0
    started = time.monotonic()
    last_log, last_logged = started, 0

    def flush() -> None:
        nonlocal buffer, saved
        chunk = _results_frame(buffer, too_long)
        buffer, too_long[:] = [], []
        if checkpoints is not None:
            # Only finished requests: a re-run asks again for those the engine gave up on (and
            # re-counts too-long prompts, which costs no engine time).
            finished_requests = chunk.filter(pl.col("error").is_null())
            checkpoints.save(finished_requests)
            saved += finished_requests.height
        results.append(chunk)
        new_results.append(chunk)

    results_stream = stream(prompts_to_send())
    try:
        while True:
            try:
                item = next(results_stream, None)
            except Exception as exc:
                kept = (
                    f"the {done.height + saved} requests finished before are checkpointed; a re-run of the partition reuses them"
                    if checkpoints is not None
                    else "nothing is checkpointed"
                )
                raise InferenceError(
                    f"the engine failed after {stats.rows_inferred} of the {total} requests left to infer "
                    f"({kept}): {type(exc).__name__}: {exc}"
                ) from exc
            if item is None:
                break
            position, generation = item
            buffer.append((sent_keys[position], generation))
            stats.rows_inferred += 1
            stats.prompt_tokens += generation.num_prompt_tokens
            stats.generated_tokens += generation.num_generated_tokens
            if len(buffer) >= step:
                flush()
            finished = stats.rows_inferred + skipped
            now = time.monotonic()
            # Progress in the run's logs at least every 10 % or 30 s (100 % is logged below).
            if finished < total and (now - last_log >= 30 or (finished - last_logged) * 10 >= total):
                rate = stats.rows_inferred / (now - started) if now > started else 0.0
                log(f"inferred {finished}/{total} requests ({100 * finished // max(total, 1)}%), {rate:.1f} rows/s in the engine")
                last_log, last_logged = now, finished
    finally:
        # Stops an engine stream that did not run to its end (it withdraws its unfinished requests).
        results_stream.close()
    if len(sent_keys) != stats.rows_inferred:
        raise InferenceError(f"the engine returned {stats.rows_inferred} outputs for {len(sent_keys)} prompts")
    if buffer or too_long:
        flush()
    stats.engine_seconds = time.monotonic() - started
    if total:
        log(f"inferred {total}/{total} requests (100%), {stats.rows_per_second:.1f} rows/s in the engine")
    if cache is not None and deduplicate:
        stats.rows_cached = cache.add(pl.concat(new_results))

    # Internal column names that no input column can have.
    by_key = pl.concat(results).rename({"request_key": _KEY, "error": _ENGINE_ERROR, "num_prompt_tokens": _ENGINE_PROMPT_TOKENS})
    joined = formatted.join(
        keyed.select("row_id", pl.col("request_key").alias(_KEY)), on="row_id", how="left", maintain_order="left"
    ).join(by_key, on=_KEY, how="left", maintain_order="left")
    joined = joined.with_columns(
        error=pl.coalesce("error", _ENGINE_ERROR),
        num_prompt_tokens=pl.coalesce(_ENGINE_PROMPT_TOKENS, "num_prompt_tokens"),
    ).drop(_ENGINE_ERROR, _ENGINE_PROMPT_TOKENS, _KEY)
    stats.error_rows = joined["error"].is_not_null().sum()
    return joined, stats


def _too_long_row(key: str, prompt_tokens: int, max_tokens: int, max_model_len: int) -> dict:
    return {
        "request_key": key,
        "generated_text": None,
        "finish_reason": None,
        "num_prompt_tokens": prompt_tokens,
        "num_generated_tokens": None,
        "error": f"prompt_too_long: {prompt_tokens} prompt tokens + {max_tokens} max_tokens exceed max_model_len {max_model_len}",
    }


def _results_frame(generated: list[tuple[str, Generation]], too_long: list[dict]) -> pl.DataFrame:
    rows = [
        {
            "request_key": key,
            "generated_text": g.text,
            "finish_reason": g.finish_reason,
            "num_prompt_tokens": g.num_prompt_tokens,
            "num_generated_tokens": g.num_generated_tokens,
            "error": g.error,
        }
        for key, g in generated
    ]
    return pl.DataFrame(rows + too_long, schema=CHECKPOINT_SCHEMA)
