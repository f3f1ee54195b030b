"""Send a partition's valid prompts to the engine in large batches; checkpoint; join results back.

Engine-agnostic: takes a `tokenize` and a `generate` function, so the pure logic (deduplication,
checkpoint reuse, batching, joining, errors for prompts that do not fit) is tested without Dagster.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import polars as pl

from batch_assets.inference.checkpoints import CHECKPOINT_SCHEMA, CheckpointStore
from batch_assets.resources.vllm_engine import Generation

GENERATION_COLUMNS = ("generated_text", "finish_reason", "num_generated_tokens")
MIN_PROGRESS_BATCH = 64
_KEY, _ENGINE_ERROR, _ENGINE_PROMPT_TOKENS = "\x00request_key", "\x00engine_error", "\x00engine_prompt_tokens"


class InferenceError(RuntimeError):
    """The engine failed mid-partition: the message has the engine's own error and what was kept."""


@dataclass
class InferenceStats:
    rows: int = 0
    rows_inferred: int = 0
    rows_from_checkpoint: int = 0
    rows_deduplicated: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    engine_seconds: float = 0.0
    engine_start_seconds: float = 0.0
    # Whole inference loop: tokenization, engine calls and checkpoint writes (not engine start-up).
    inference_seconds: float = 0.0

    @property
    def generated_tokens_per_second(self) -> float:
        return self.generated_tokens / self.engine_seconds if self.engine_seconds else 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows_inferred / self.engine_seconds if self.engine_seconds else 0.0


def request_keys(prompts: Sequence[str], row_ids: Sequence[int], deduplicate: bool) -> list[str]:
    """Identical prompts share a key when decoding is deterministic, so they are inferred once."""
    if deduplicate:
        return [hashlib.sha1(p.encode("utf-8")).hexdigest() for p in prompts]
    return [hashlib.sha1(f"{r}\x00{p}".encode("utf-8")).hexdigest() for p, r in zip(prompts, row_ids, strict=True)]


def run_inference(
    formatted: pl.DataFrame,
    *,
    tokenize: Callable[[list[str]], list[list[int]]],
    generate: Callable[[list[list[int]]], list[Generation]],
    max_model_len: int,
    max_tokens: int,
    batch_size: int,
    deduplicate: bool,
    checkpoints: CheckpointStore | None,
    log: Callable[[str], None] = lambda message: None,
    start_engine: Callable[[], object] | None = None,
) -> tuple[pl.DataFrame, InferenceStats]:
    """formatted_prompts → inference_outputs, resuming from `checkpoints` and saving one chunk per batch.

    `start_engine`, when given, is called once before the first batch (and not at all when the
    checkpoints hold every result), so engine start-up is timed apart from inference.
    """
    stats = InferenceStats(rows=formatted.height)
    valid = formatted.filter(pl.col("error").is_null()).select("row_id", "prompt")
    keyed = valid.with_columns(
        request_key=pl.Series(request_keys(valid["prompt"].to_list(), valid["row_id"].to_list(), deduplicate), dtype=pl.String)
    )
    unique_requests = keyed.unique("request_key", keep="first", maintain_order=True)
    stats.rows_deduplicated = keyed.height - unique_requests.height

    done = checkpoints.load() if checkpoints is not None else pl.DataFrame(schema=CHECKPOINT_SCHEMA)
    done = done.join(unique_requests.select("request_key"), on="request_key", how="semi")
    pending = unique_requests.join(done.select("request_key"), on="request_key", how="anti", maintain_order="left")
    stats.rows_from_checkpoint = done.height
    if done.height:
        log(f"reusing {done.height} results from checkpoints; {pending.height} requests left to infer")

    results = [done]
    total = pending.height
    # At least ~10 engine calls when there is enough work, so the run log shows progress every
    # ~10 % (each call is also a checkpoint); never above the task's `batch_size`.
    step = min(batch_size, max(MIN_PROGRESS_BATCH, -(-total // 10)))
    if total:
        log(
            f"{total} requests to infer ({stats.rows_deduplicated} duplicate prompts share a request, "
            f"{done.height} reused from checkpoints) in {-(-total // step)} engine call(s) of up to {step}"
        )
    if total and start_engine is not None:
        started = time.monotonic()
        start_engine()
        stats.engine_start_seconds = time.monotonic() - started
    started = time.monotonic()
    last_log, last_logged = started, 0
    saved = 0
    for offset in range(0, total, step):
        batch = pending.slice(offset, step)
        try:
            chunk = _infer_batch(batch, tokenize, generate, max_model_len, max_tokens, stats)
        except Exception as exc:
            kept = (
                f"the {done.height + saved} requests finished before are checkpointed; a re-run of the partition reuses them"
                if checkpoints is not None
                else "nothing is checkpointed"
            )
            raise InferenceError(
                f"the engine failed on requests {offset + 1}-{offset + batch.height} of the {total} left to infer "
                f"({kept}): {type(exc).__name__}: {exc}"
            ) from exc
        if checkpoints is not None:
            # Only finished requests: a re-run asks again for those the engine gave up on (and
            # re-counts too-long prompts, which costs no engine time).
            finished_requests = chunk.filter(pl.col("error").is_null())
            checkpoints.save(finished_requests)
            saved += finished_requests.height
        results.append(chunk)
        finished = min(offset + step, total)
        now = time.monotonic()
        # Progress in the run's logs at least every 10 % or 30 s.
        if finished == total or now - last_log >= 30 or (finished - last_logged) * 10 >= total:
            rate = stats.rows_inferred / stats.engine_seconds if stats.engine_seconds else 0.0
            log(f"inferred {finished}/{total} requests ({100 * finished // max(total, 1)}%), {rate:.1f} rows/s in the engine")
            last_log, last_logged = now, finished

    stats.inference_seconds = time.monotonic() - started
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


def _infer_batch(
    batch: pl.DataFrame,
    tokenize: Callable[[list[str]], list[list[int]]],
    generate: Callable[[list[list[int]]], list[Generation]],
    max_model_len: int,
    max_tokens: int,
    stats: InferenceStats,
) -> pl.DataFrame:
    token_ids = tokenize(batch["prompt"].to_list())
    budget = max_model_len - max_tokens
    fits = [len(ids) <= budget for ids in token_ids]
    to_send = [ids for ids, ok in zip(token_ids, fits, strict=True) if ok]
    started = time.monotonic()
    generated = generate(to_send) if to_send else []
    stats.engine_seconds += time.monotonic() - started
    if len(generated) != len(to_send):
        raise RuntimeError(f"the engine returned {len(generated)} outputs for {len(to_send)} prompts")
    generations = iter(generated)
    rows = {name: [] for name in CHECKPOINT_SCHEMA}
    for key, ids, ok in zip(batch["request_key"], token_ids, fits, strict=True):
        rows["request_key"].append(key)
        if ok:
            generation = next(generations)
            rows["generated_text"].append(generation.text)
            rows["finish_reason"].append(generation.finish_reason)
            rows["num_prompt_tokens"].append(generation.num_prompt_tokens)
            rows["num_generated_tokens"].append(generation.num_generated_tokens)
            rows["error"].append(generation.error)
            stats.rows_inferred += 1
            stats.prompt_tokens += generation.num_prompt_tokens
            stats.generated_tokens += generation.num_generated_tokens
        else:
            rows["generated_text"].append(None)
            rows["finish_reason"].append(None)
            rows["num_prompt_tokens"].append(len(ids))
            rows["num_generated_tokens"].append(None)
            rows["error"].append(
                f"prompt_too_long: {len(ids)} prompt tokens + {max_tokens} max_tokens exceed max_model_len {max_model_len}"
            )
    return pl.DataFrame(rows, schema=CHECKPOINT_SCHEMA)
