"""Send the valid prompts of one or more partitions to an engine as ONE stream; checkpoint; cache; join.

Engine-agnostic: the engine is an `EngineSession` (see engine_contract.py: `start()` and
`stream(prompts)`), so the logic here (deduplication, checkpoint and cache reuse, errors for prompts
that do not fit, joining results back to rows) is shared by every engine and tested without one.

The work reads in four parts:

- planning (inference_requests.py): per partition, which requests are already answered (result
  cache, checkpoints) and which are left; across partitions, one list of requests to send;
- the stream (`run_inference`, here): prompts encoded lazily as the engine asks for more, results
  handed to their partitions as they finish;
- chunk writing (checkpoint_writer.py): each partition checkpoints its finished results every
  `batch_size` results or 30 s, whichever comes first, on a writer thread;
- joining (`_join`, here): every row of each partition gets its result, in input order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import polars as pl

from batch_assets.pipeline.checkpoint_writer import (
    CHECKPOINT_SECONDS,
    ChunkWriter,
    PartitionSink,
    TooLong,
    checkpoint_timer,
)
from batch_assets.pipeline.engine_contract import EngineSession, Prompt
from batch_assets.pipeline.inference_requests import (
    InferenceStats,
    PartitionInput,
    RequestPlan,
    StreamRequests,
    plan_partition,
    stream_requests,
)
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.pipeline.result_stores import ResultLookup

_KEY, _ENGINE_ERROR, _ENGINE_PROMPT_TOKENS = "\x00request_key", "\x00engine_error", "\x00engine_prompt_tokens"
_SENT = "\x00sent"


class InferenceError(RuntimeError):
    """The engine failed mid-stream: the message has the engine's own error and what was kept."""


def _too_long(prompt_tokens: int, max_tokens: int, max_model_len: int) -> TooLong:
    error = f"prompt_too_long: {prompt_tokens} prompt tokens + {max_tokens} max_tokens exceed max_model_len "
    return TooLong(prompt_tokens, f"{error}{max_model_len}")


# --- progress -----------------------------------------------------------------------------------


class _Progress:
    """A line at least every 10 % of the stream or 30 s (and at 100 %)."""

    def __init__(self, total: int, log: Callable[[str], None]) -> None:
        self.total, self.log = total, log
        self.started = self.last_time = time.monotonic()
        self.last_count = 0

    def update(self, finished: int, inferred: int) -> None:
        now = time.monotonic()
        if finished < self.total and (now - self.last_time >= 30 or (finished - self.last_count) * 10 >= self.total):
            rate = self.rate(inferred, now)
            # The time left too: the run's log is what the Dagster UI shows of a long partition.
            left = f", about {round((self.total - finished) / rate)} s left" if rate > 0 else ""
            self.log(
                f"inferred {finished}/{self.total} requests ({100 * finished // max(self.total, 1)}%), "
                f"{rate:.1f} rows/s in the engine{left}"
            )
            self.last_time, self.last_count = now, finished

    def rate(self, inferred: int, now: float | None = None) -> float:
        elapsed = (now or time.monotonic()) - self.started
        return inferred / elapsed if elapsed > 0 else 0.0


# --- the stream ---------------------------------------------------------------------------------


def run_inference(
    partitions: Sequence[PartitionInput],
    *,
    session: EngineSession,
    max_model_len: int,
    max_tokens: int,
    batch_size: int,
    deduplicate: bool,
    cache: ResultLookup | None = None,
    log: Callable[[str], None] = lambda message: None,
    checkpoint_seconds: float | None = None,
) -> list[tuple[pl.DataFrame, InferenceStats]]:
    """formatted_prompts → inference_outputs for each partition, reusing cached and checkpointed results.

    Requests already in the result `cache` (deterministic decoding only) or in a partition's
    checkpoints are not inferred again. The rest of every partition go to the engine as one stream
    (prompts encoded lazily, results back as they finish, so the engine never idles between chunks
    or partitions). Each partition checkpoints its results every `batch_size` results or
    `checkpoint_seconds` (default `CHECKPOINT_SECONDS`), off the feeding thread, on time also while
    the engine has no result to give; progress is logged; at the end new results are added to the
    cache. The engine is started (`session.start`) only when a request needs it, and timed apart from
    inference. Returns `(frame, stats)` per partition, in the order given.
    """
    plans = [plan_partition(part, deduplicate=deduplicate, cache=cache, batch_size=batch_size) for part in partitions]
    checkpoint_seconds = CHECKPOINT_SECONDS if checkpoint_seconds is None else checkpoint_seconds
    many = len(plans) > 1
    for plan in plans:
        reused = plan.stats.rows_from_cache + plan.stats.rows_from_checkpoint
        if reused:
            log(
                f"{_prefix(plan, many)}reusing {plan.stats.rows_from_cache} results from the result cache and "
                f"{plan.stats.rows_from_checkpoint} from checkpoints; {plan.pending.height} requests left to infer"
            )
        if plan.pending.height:
            log(
                f"{_prefix(plan, many)}{plan.pending.height} requests to infer "
                f"({plan.stats.rows_deduplicated} duplicate prompts share a request); checkpoint every "
                f"{plan.checkpoint_rows} results or {checkpoint_seconds:g} s"
            )
    requests = stream_requests(plans, deduplicate)
    writer = ChunkWriter()
    caching = cache if deduplicate else None
    sinks = [PartitionSink(plan, writer, requests.keys, caching, checkpoint_seconds) for plan in plans]
    engine_seconds, start_seconds = 0.0, 0.0
    try:
        if requests.frame.height:
            started = time.monotonic()
            session.start(requests.frame.height)
            start_seconds = time.monotonic() - started
            with checkpoint_timer(sinks, checkpoint_seconds):
                engine_seconds = _stream(requests, plans, sinks, session, max_model_len, max_tokens, log)
        for sink in sinks:
            sink.flush()
        writer.drain()
    except BaseException:
        # A stop (Ctrl-C, SIGTERM, the UI's Terminate: Dagster's DagsterExecutionInterruptedError) is
        # no Exception, and the stream may end in one anywhere: what finished is kept all the same.
        _keep_finished(sinks, writer)
        raise
    finally:
        writer.close()
    results = []
    for plan, sink in zip(plans, sinks, strict=True):
        plan.stats.engine_seconds, plan.stats.engine_start_seconds = engine_seconds, start_seconds
        plan.stats.engine_started = bool(requests.frame.height) and bool(getattr(session, "started_here", True))
        # What is left to cache, and the results a re-run found in the checkpoints (an earlier
        # attempt's, never cached: that attempt failed before its end).
        sink.add_to_cache(plan.reused[1])
        if sink.cache_error is not None:
            raise sink.cache_error
        plan.stats.rows_cached = sink.cached
        results.append(_join(plan, sink))
    return results


def _keep_finished(sinks: list[PartitionSink], writer: ChunkWriter) -> None:
    """Every finished result into the checkpoints, then the result cache, before the stream's error
    or stop goes on: a re-run reuses them. A store that fails here must not hide why the stream ended
    (a failed checkpoint write is the writer's sticky error, raised already or by the re-run)."""
    with contextlib.suppress(Exception):
        for sink in sinks:
            sink.flush()
        writer.drain()
    for sink in sinks:
        with contextlib.suppress(Exception):
            sink.add_to_cache(sink.plan.reused[1])


def _prefix(plan: RequestPlan, many: bool) -> str:
    return f"{plan.part.label}: " if many and plan.part.label else ""


def _stream(
    requests: StreamRequests,
    plans: list[RequestPlan],
    sinks: list[PartitionSink],
    session: EngineSession,
    max_model_len: int,
    max_tokens: int,
    log: Callable[[str], None],
) -> float:
    """Run `requests` through the engine; returns the seconds from first request to last result."""
    total = requests.frame.height
    sent: list[int] = []  # the request index of each prompt handed to the engine, by position
    skipped = 0
    chunk = min(plan.step for plan in plans if plan.pending.height)

    def prompts() -> Iterator[Prompt]:
        # Encoded `chunk` at a time, as the engine asks for more; too-long prompts never reach it.
        nonlocal skipped
        for offset in range(0, total, chunk):
            for index, prompt in enumerate(_encode(requests.frame.slice(offset, chunk), plans), start=offset):
                limit = prompt.sampling.max_tokens if prompt.sampling is not None else max_tokens
                if len(prompt.token_ids) <= max_model_len - limit:
                    sent.append(index)
                    yield prompt
                else:
                    skipped += 1
                    too_long = _too_long(len(prompt.token_ids), limit, max_model_len)
                    for owner in requests.owners(index):
                        sinks[owner].add(index, too_long)

    progress = _Progress(total, log)
    inferred = 0
    owner, shared = requests.owner, requests.shared
    results = session.stream(prompts())
    try:
        while True:
            try:
                item = next(results, None)
            except Exception as exc:
                raise InferenceError(_failure_message(exc, inferred, total, sinks)) from exc
            if item is None:
                break
            position, generation = item
            index = sent[position]
            sinks[owner[index]].add(index, generation)
            if shared:
                for other in shared.get(index, ()):
                    sinks[other].add(index, generation)
            inferred += 1
            progress.update(inferred + skipped, inferred)
    finally:
        # Stops an engine stream that did not run to its end (it withdraws its unfinished requests).
        close = getattr(results, "close", None)
        if close is not None:
            close()
    if len(sent) != inferred:
        raise InferenceError(f"the engine returned {inferred} outputs for {len(sent)} prompts")
    log(f"inferred {total}/{total} requests (100%), {progress.rate(inferred):.1f} rows/s in the engine")
    return time.monotonic() - progress.started


def _encode(batch: pl.DataFrame, plans: list[RequestPlan]) -> list[Prompt]:
    """Each request of `batch` (a slice of the requests) encoded by the first partition that needs
    it (its rows know the chat messages), carrying its request key."""
    owners = batch["owner"]
    groups = (
        [(owners[0], None)]
        if owners.n_unique() == 1
        else [(owner, (owners == owner).arg_true()) for owner in owners.unique(maintain_order=True).to_list()]
    )
    prompts: list[Prompt | None] = [None] * batch.height
    for owner, rows in groups:
        part = batch if rows is None else batch[rows]
        texts, keys = part["prompt"].to_list(), part["request_key"].to_list()
        # An image task's encoder is also told each request's images, by their digest.
        images = (
            {"image_digests": part[DIGEST_COLUMN].to_list()} if DIGEST_COLUMN in plans[owner].pending.columns else {}
        )
        if "request_params" in plans[owner].pending.columns:
            encoded = plans[owner].part.encode(texts, part["request_params"].to_list(), keys=keys, **images)
        else:
            encoded = plans[owner].part.encode(texts, keys=keys, **images)
        if len(encoded) != len(texts):
            raise RuntimeError(f"encoding {len(texts)} prompts gave {len(encoded)}")
        if rows is None:
            return encoded
        for i, prompt in zip(rows.to_list(), encoded, strict=True):
            prompts[i] = prompt
    return prompts  # type: ignore[return-value]


def _failure_message(exc: Exception, inferred: int, total: int, sinks: list[PartitionSink]) -> str:
    # What was finished before the failure is checkpointed first, so the count below is what a re-run
    # reuses; a failing store is reported by the count it leaves, not in place of the engine's error.
    with contextlib.suppress(Exception):
        for sink in sinks:
            sink.flush()
        sinks[0].writer.drain()
    if any(sink.plan.part.checkpoints is not None for sink in sinks):
        kept_count = sum(sink.kept for sink in sinks)
        kept = f"the {kept_count} requests finished before are checkpointed; a re-run of the partition reuses them"
    else:
        kept = "nothing is checkpointed"
    return (
        f"the engine failed after {inferred} of the {total} requests left to infer ({kept}): "
        f"{type(exc).__name__}: {exc}"
    )


# --- joining ------------------------------------------------------------------------------------


def _join(plan: RequestPlan, sink: PartitionSink) -> tuple[pl.DataFrame, InferenceStats]:
    formatted = plan.part.formatted
    # Internal column names that no input column can have.
    by_key = (
        pl.concat([*plan.reused, *sink.new])
        .unique("request_key", keep="first", maintain_order=True)
        .rename({"request_key": _KEY, "error": _ENGINE_ERROR, "num_prompt_tokens": _ENGINE_PROMPT_TOKENS})
    )
    joined = formatted.join(
        plan.keyed.rename({"request_key": _KEY}), on="row_id", how="left", maintain_order="left"
    ).join(by_key, on=_KEY, how="left", maintain_order="left")
    # Sent: no error before the engine (the formatted row's), and not refused as too long by the stream.
    unsent = sink.keys.gather(sink.unsent).to_list() if sink.unsent else []
    sent = pl.col("error").is_null() & ~pl.col(_KEY).is_in(unsent)
    joined = joined.with_columns(
        error=pl.coalesce("error", _ENGINE_ERROR),
        num_prompt_tokens=pl.coalesce(_ENGINE_PROMPT_TOKENS, "num_prompt_tokens"),
        **{_SENT: sent},
    )
    plan.stats.sent_prompt_tokens = int(joined.filter(pl.col(_SENT))["num_prompt_tokens"].sum() or 0)
    joined = joined.drop(_ENGINE_ERROR, _ENGINE_PROMPT_TOKENS, _KEY, _SENT)
    plan.stats.error_rows = int(joined["error"].is_not_null().sum())
    return joined, plan.stats
