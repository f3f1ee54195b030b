"""Send the valid prompts of one or more partitions to an engine as ONE stream; checkpoint; cache; join.

Engine-agnostic: the engine is an `EngineSession` (see engine_contract.py: `start()` and
`stream(prompts)`), so the logic here (deduplication, checkpoint and cache reuse, errors for prompts
that do not fit, joining results back to rows) is shared by every engine and tested without one.

The work reads in four parts:

- planning (`_plan`): per partition, which requests are already answered (result cache,
  checkpoints) and which are left; across partitions, one list of requests to send;
- the stream (`run_inference`): prompts encoded lazily as the engine asks for more, results
  handed to their partitions as they finish;
- chunk writing (`_PartitionSink`, `_ChunkWriter`, `_checkpoint_timer`): each partition checkpoints
  its finished results every `batch_size` results or 30 s, whichever comes first, on a writer thread;
  a timer thread writes a chunk that is due while the engine has no result to hand over;
- joining (`_join`): every row of each partition gets its result, in input order.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from batch_assets.pipeline.embeddings import encode_vector
from batch_assets.pipeline.engine_contract import EngineSession, Generation, Prompt
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.pipeline.result_stores import RESULT_SCHEMA, Checkpoints, ResultLookup

MIN_PROGRESS_BATCH = 64
# A partition's finished results are checkpointed at least this often (and every `batch_size` results):
# a kill loses at most this much engine work, and a 50 M-row job writes thousands of chunks, not 49,000.
CHECKPOINT_SECONDS = 30.0
# Chunks waiting for the writer thread at most; beyond that the feeding thread waits (bounded memory).
_MAX_QUEUED_CHUNKS = 8
_KEY, _ENGINE_ERROR, _ENGINE_PROMPT_TOKENS = "\x00request_key", "\x00engine_error", "\x00engine_prompt_tokens"
_SENT = "\x00sent"


class InferenceError(RuntimeError):
    """The engine failed mid-stream: the message has the engine's own error and what was kept."""


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
    # The prompt tokens of the partition's rows that reached an engine, in this run or (results reused
    # from the cache or a checkpoint) the run that inferred them: what `prompt_tokens` and `cost_usd`
    # of inference_outputs count. A row with an error before the engine (a prompt too long, an empty
    # text) was never sent, so it costs nothing.
    sent_prompt_tokens: int = 0
    # From the first request to the last result of the stream this partition was part of:
    # tokenization, the engine and checkpoint writes (not engine start-up). Shared by the
    # partitions of one stream.
    engine_seconds: float = 0.0
    engine_start_seconds: float = 0.0
    engine_started: bool = False
    # What the task's kind measured of the partition besides inference (a cascade's student), for
    # inference_outputs' metadata.
    format_metadata: dict[str, Any] = field(default_factory=dict)

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


@dataclass
class PartitionInput:
    """One partition's share of a stream."""

    formatted: pl.DataFrame  # formatted_prompts: row_id, prompt, error, num_prompt_tokens, inputs
    # prompt texts → engine prompts (engine_contract.py), each built with its `key` (the request's
    # `request_key`, one per text); called as encode(texts, request_params, keys=keys) when
    # `formatted` has per-request params (OpenAI batch lines), else encode(texts, keys=keys)
    encode: Callable[..., list[Prompt]]
    checkpoints: Checkpoints | None = None
    label: str = ""  # names the partition in log lines when a stream has several


def request_keys(
    prompts: Sequence[str],
    row_ids: Sequence[int],
    deduplicate: bool,
    params: Sequence[str | None] | None = None,
    image_digests: Sequence[str | None] | None = None,
) -> list[str]:
    """Identical prompts share a key when decoding is deterministic, so they are inferred once.

    `params`: per-request sampling and output constraint (canonical JSON, e.g. each line of an
    OpenAI batch file), part of the key so requests that differ in them never share a result.
    `image_digests`: the content digest of each request's images (pipeline/inputs/images.py), so the same
    image under two names is one request and a replaced image under the same name a new one.
    """
    if params is not None:
        prompts = [p if q is None else f"{q}\x00{p}" for p, q in zip(prompts, params, strict=True)]
    if image_digests is not None:
        prompts = [p if d is None else f"image:{d}\x00{p}" for p, d in zip(prompts, image_digests, strict=True)]
    if deduplicate:
        return [hashlib.sha1(p.encode("utf-8")).hexdigest() for p in prompts]
    return [hashlib.sha1(f"{r}\x00{p}".encode()).hexdigest() for p, r in zip(prompts, row_ids, strict=True)]


# --- planning ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    part: PartitionInput
    stats: InferenceStats
    keyed: pl.DataFrame  # row_id, request_key of every valid row
    reused: list[pl.DataFrame]  # results from the cache and the checkpoints
    pending: pl.DataFrame  # request_key, prompt (, request_params): what this partition still needs
    step: int = MIN_PROGRESS_BATCH  # prompts encoded at a time, as the engine asks for more
    checkpoint_rows: int = 1024  # results per checkpoint chunk at most (`batch_size`)


def request_params_columns(formatted: pl.DataFrame) -> list[str]:
    """The columns besides the prompt that name a request: `request_params` (per-request sampling and
    output, OpenAI batch lines; absent for task-wide sampling) and an image task's images' digest."""
    params = ["request_params"] if "request_params" in formatted.columns else []
    return params + ([DIGEST_COLUMN] if DIGEST_COLUMN in formatted.columns else [])


def keyed_requests(formatted: pl.DataFrame, deduplicate: bool) -> pl.DataFrame:
    """The rows of `formatted` without an error (those an engine is sent), each with its
    `request_key`: what a run looks up in its checkpoints and the result cache (and `estimate` too)."""
    params = request_params_columns(formatted)
    valid = formatted.filter(pl.col("error").is_null()).select("row_id", "prompt", *params)
    return valid.with_columns(
        request_key=pl.Series(
            request_keys(
                valid["prompt"].to_list(),
                valid["row_id"].to_list(),
                deduplicate,
                valid["request_params"].to_list() if "request_params" in params else None,
                valid[DIGEST_COLUMN].to_list() if DIGEST_COLUMN in params else None,
            ),
            dtype=pl.String,
        )
    )


def _plan(part: PartitionInput, *, deduplicate: bool, cache: ResultLookup | None, batch_size: int) -> _Plan:
    stats = InferenceStats(rows=part.formatted.height)
    params = request_params_columns(part.formatted)
    keyed = keyed_requests(part.formatted, deduplicate)
    unique_requests = keyed.unique("request_key", keep="first", maintain_order=True)
    stats.rows_deduplicated = keyed.height - unique_requests.height
    # The partition's own checkpoints first: a stopped attempt keeps its results in both stores, and
    # they count as `rows_from_checkpoint` (reused from an interrupted attempt); the cache serves the rest.
    done = part.checkpoints.load() if part.checkpoints is not None else pl.DataFrame(schema=RESULT_SCHEMA)
    done = done.join(unique_requests.select("request_key"), on="request_key", how="semi")
    remaining = unique_requests.join(done.select("request_key"), on="request_key", how="anti", maintain_order="left")
    cached = (
        cache.lookup(remaining["request_key"])
        if cache is not None and deduplicate
        else pl.DataFrame(schema=RESULT_SCHEMA)
    )
    pending = remaining.join(cached.select("request_key"), on="request_key", how="anti", maintain_order="left")
    stats.rows_from_cache, stats.rows_from_checkpoint = cached.height, done.height
    # Prompts are encoded ~10 % of the work at a time, at least 64 (tiny partitions are not cut into
    # tiny engine calls), never more than `batch_size`.
    step = min(batch_size, max(MIN_PROGRESS_BATCH, -(-pending.height // 10)))
    return _Plan(
        part,
        stats,
        keyed.select("row_id", "request_key"),
        [cached, done],
        pending.select("request_key", "prompt", *params),
        step,
        batch_size,
    )


@dataclass
class _Requests:
    """The stream's requests as columns, in the order they are sent: one row per request, no object
    per request (a 100,000-row partition is 100,000 requests)."""

    frame: pl.DataFrame  # request_key, prompt, request_params (null for task-wide sampling), owner
    owner: list[int]  # per request: the first partition waiting for its result (it encodes the prompt)
    shared: dict[int, list[int]]  # request index → the other partitions waiting for its result

    @property
    def keys(self) -> pl.Series:
        return self.frame["request_key"]

    def owners(self, index: int) -> list[int]:
        return [self.owner[index], *self.shared.get(index, ())]


def _requests(plans: list[_Plan], deduplicate: bool) -> _Requests:
    """One request per pending key; with deterministic decoding a prompt pending in several
    partitions is sent once and its result goes to each of them."""
    pending = pl.concat(
        [
            plan.pending.select(
                "request_key",
                "prompt",
                pl.col("request_params")
                if "request_params" in plan.pending.columns
                else pl.lit(None, dtype=pl.String).alias("request_params"),
                pl.col(DIGEST_COLUMN)
                if DIGEST_COLUMN in plan.pending.columns
                else pl.lit(None, dtype=pl.String).alias(DIGEST_COLUMN),
                owner=pl.lit(index, dtype=pl.Int64),
            )
            for index, plan in enumerate(plans)
        ]
    )
    if not deduplicate:
        return _Requests(pending, pending["owner"].to_list(), {})
    grouped = pending.group_by("request_key", maintain_order=True).agg(
        pl.col("prompt").first(), pl.col("request_params").first(), pl.col(DIGEST_COLUMN).first(), pl.col("owner")
    )
    # Stable, as Python's sort: requests with the same prompt text keep their order.
    grouped = grouped.sort(shared_prefix_order(), maintain_order=True)
    owners = grouped["owner"]
    shared_rows = (owners.list.len() > 1).arg_true().to_list()
    shared = {index: owners[index].to_list()[1:] for index in shared_rows}
    frame = grouped.with_columns(owner=owners.list.first())
    return _Requests(frame, frame["owner"].to_list(), shared)


def shared_prefix_order() -> pl.Expr:
    """Requests in the order of their prompt texts, so prompts that share a prefix (one document with
    several questions, one long instruction per customer) reach the engine one after another.

    vLLM reuses a prefix's KV cache only while it is still cached; in input order a file whose shared
    prefixes outgrow the cache computes each of them again and again. Sorted, a prefix is computed
    once and reused by the requests right behind it (the idea of SGLang's longest-prefix-first and
    Daft's prefix bucketing; a lexicographic order is a depth-first walk of the prefix tree). Only
    with deterministic decoding, where each answer is the most likely one whatever the order (in low
    precision a near-tie can tip with batching, in any order); results still land in
    their rows in input order. (Polars orders strings by their UTF-8 bytes: the code point order.)"""
    return pl.col("prompt")


# --- chunk writing ------------------------------------------------------------------------------


class _ChunkWriter:
    """Builds and writes the partitions' result chunks on a thread of its own, so checkpoint writes
    (an S3 PUT each) and result cache inserts never stall the thread that feeds the engine. `drain()`
    waits for every chunk handed over and raises the first checkpoint write error; a failed write
    also surfaces at the next `put`."""

    def __init__(self) -> None:
        self._chunks: queue.Queue[tuple[_PartitionSink, _Chunk] | None] = queue.Queue(_MAX_QUEUED_CHUNKS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def put(self, sink: _PartitionSink, chunk: _Chunk) -> None:
        self._raise_error()
        self._chunks.put((sink, chunk))

    def drain(self) -> None:
        self._chunks.join()
        self._raise_error()

    def close(self) -> None:
        self._chunks.put(None)
        self._thread.join()

    def _raise_error(self) -> None:
        # Sticky: once a write failed, no later chunk is taken (a re-run infers them again).
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while (item := self._chunks.get()) is not None:
            try:
                if self._error is None:  # after a failure, later chunks are not written (a re-run infers them)
                    item[0].write(item[1])
            except BaseException as exc:  # handed to the feeding thread
                self._error = exc
            finally:
                self._chunks.task_done()
        self._chunks.task_done()


@dataclass(frozen=True)
class _TooLong:
    """A request that never reached the engine: its prompt and max_tokens exceed the context. Read
    like a `Generation` when its chunk is built."""

    num_prompt_tokens: int
    error: str
    text: None = None
    vector: None = None
    finish_reason: None = None
    num_generated_tokens: None = None
    cumulative_logprob: None = None
    token_logprobs: None = None


@dataclass
class _Chunk:
    """Results handed from the feeding thread to the writer: the request index of each (its key is
    looked up there, as a column) and what the engine returned. No row is built on the feeding thread."""

    indices: list[int] = field(default_factory=list)
    results: list[Generation | _TooLong] = field(default_factory=list)

    def frame(self, keys: pl.Series) -> pl.DataFrame:
        """The chunk in `RESULT_SCHEMA`, one column at a time."""
        results = self.results
        columns = {
            "request_key": keys.gather(self.indices),
            # The stores keep an embedding as text (checkpoints and cache entries written before
            # `Generation.vector` read as they are): encoded here, once for every engine.
            "generated_text": [r.text if r.vector is None else encode_vector(r.vector) for r in results],
            "finish_reason": [r.finish_reason for r in results],
            "num_prompt_tokens": [r.num_prompt_tokens for r in results],
            "num_generated_tokens": [r.num_generated_tokens for r in results],
            "error": [r.error for r in results],
            "cumulative_logprob": [r.cumulative_logprob for r in results],
            "token_logprobs": [r.token_logprobs for r in results],
        }
        return pl.DataFrame(columns, schema=RESULT_SCHEMA)


# Finished results collected for the result cache before one insert (a transaction each), on the writer thread.
CACHE_ROWS_PER_ADD = 8192


@dataclass
class _PartitionSink:
    """A partition's new results, checkpointed every `checkpoint_rows` results, when a chunk's first
    result is `checkpoint_seconds` old (`flush_if_due`, called by the checkpoint timer: in
    shared-prefix order a partition may get no result for a long while, and a long request may hold
    up the whole stream), and at its last result. The feeding thread adds and the timer flushes:
    the buffer changes hands under `lock`. The writer thread builds each chunk's frame, saves it to
    the checkpoints, and adds the finished results to the result cache in batches: after the
    checkpoints, so a kill loses nothing checkpointed, and a cache that fails is reported at the end,
    once every chunk is checkpointed (`cache_error`)."""

    plan: _Plan
    writer: _ChunkWriter
    keys: pl.Series  # of the stream's requests, by request index
    cache: ResultLookup | None = None
    checkpoint_seconds: float = CHECKPOINT_SECONDS
    lock: threading.Lock = field(default_factory=threading.Lock)
    buffer: _Chunk = field(default_factory=_Chunk)
    new: list[pl.DataFrame] = field(default_factory=list)  # this partition's new results
    saved: int = 0
    buffer_started: float = 0.0  # when the buffer's first result came
    remaining: int = 0  # results this partition still waits for
    uncached: list[pl.DataFrame] = field(default_factory=list)  # finished, not yet added to the cache
    cached: int = 0  # results offered to the cache
    cache_error: Exception | None = None
    unsent: list[int] = field(default_factory=list)  # request indices refused before the engine (too long)

    def __post_init__(self) -> None:
        self.remaining = self.plan.pending.height

    def add(self, index: int, result: Generation | _TooLong) -> None:
        with self.lock:
            buffer = self.buffer
            if not buffer.indices:
                self.buffer_started = time.monotonic()
            buffer.indices.append(index)
            buffer.results.append(result)
            self.remaining -= 1
            full = len(buffer.indices) >= self.plan.checkpoint_rows or self.remaining == 0
            if full or time.monotonic() - self.buffer_started >= self.checkpoint_seconds:
                self._flush()

    def flush_if_due(self, now: float) -> None:
        with self.lock:
            if self.buffer.indices and now - self.buffer_started >= self.checkpoint_seconds:
                self._flush()

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if self.buffer.indices:
            chunk, self.buffer = self.buffer, _Chunk()
            self.writer.put(self, chunk)

    def write(self, chunk: _Chunk) -> None:
        """On the writer thread: one chunk into the checkpoints, the partition's new results and its stats."""
        frame = chunk.frame(self.keys)
        finished = frame.filter(pl.col("error").is_null())
        if self.plan.part.checkpoints is not None:
            # Only finished requests: a re-run asks again for those the engine gave up on (and
            # re-counts too-long prompts, which costs no engine time).
            self.plan.part.checkpoints.save(finished)
            self.saved += finished.height
        self.new.append(frame)
        refused = zip(chunk.indices, chunk.results, strict=True)
        self.unsent += [index for index, result in refused if isinstance(result, _TooLong)]
        generations = [result for result in chunk.results if isinstance(result, Generation)]
        stats = self.plan.stats
        stats.rows_inferred += len(generations)
        stats.prompt_tokens += sum(g.num_prompt_tokens for g in generations)
        stats.generated_tokens += sum(g.num_generated_tokens for g in generations)
        if self.cache is not None:
            self.uncached.append(finished)
            if sum(f.height for f in self.uncached) >= CACHE_ROWS_PER_ADD:
                self.add_to_cache()

    def add_to_cache(self, *more: pl.DataFrame) -> None:
        """The finished results collected so far (and `more`) into the result cache, in one add.
        A failure is kept for the end: the checkpoints still take every later chunk."""
        frames, self.uncached = [*self.uncached, *more], []
        if self.cache is None or self.cache_error is not None or not frames:
            return
        try:
            self.cached += self.cache.add(pl.concat(frames))
        except Exception as exc:
            self.cache_error = exc

    @property
    def kept(self) -> int:
        return self.plan.stats.rows_from_checkpoint + self.saved


@contextlib.contextmanager
def _checkpoint_timer(sinks: list[_PartitionSink], seconds: float) -> Iterator[None]:
    """Writes each partition's chunk once it is due, on a thread of its own: the feeding thread
    waits inside the engine's stream for the next result, which a long request may hold up for
    minutes (a kill then would lose every result of the chunk)."""
    stop = threading.Event()

    def sweep() -> None:
        while not stop.wait(max(0.01, min(1.0, seconds / 4))):
            now = time.monotonic()
            for sink in sinks:
                # A failed write is the writer's sticky error: the feeding thread raises it.
                with contextlib.suppress(Exception):
                    sink.flush_if_due(now)

    thread = threading.Thread(target=sweep, name="checkpoint-timer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _too_long(prompt_tokens: int, max_tokens: int, max_model_len: int) -> _TooLong:
    error = f"prompt_too_long: {prompt_tokens} prompt tokens + {max_tokens} max_tokens exceed max_model_len "
    return _TooLong(prompt_tokens, f"{error}{max_model_len}")


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
    plans = [_plan(part, deduplicate=deduplicate, cache=cache, batch_size=batch_size) for part in partitions]
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
    requests = _requests(plans, deduplicate)
    writer = _ChunkWriter()
    caching = cache if deduplicate else None
    sinks = [_PartitionSink(plan, writer, requests.keys, caching, checkpoint_seconds) for plan in plans]
    engine_seconds, start_seconds = 0.0, 0.0
    try:
        if requests.frame.height:
            started = time.monotonic()
            session.start(requests.frame.height)
            start_seconds = time.monotonic() - started
            with _checkpoint_timer(sinks, checkpoint_seconds):
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


def _keep_finished(sinks: list[_PartitionSink], writer: _ChunkWriter) -> None:
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


def _prefix(plan: _Plan, many: bool) -> str:
    return f"{plan.part.label}: " if many and plan.part.label else ""


def _stream(
    requests: _Requests,
    plans: list[_Plan],
    sinks: list[_PartitionSink],
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


def _encode(batch: pl.DataFrame, plans: list[_Plan]) -> list[Prompt]:
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


def _failure_message(exc: Exception, inferred: int, total: int, sinks: list[_PartitionSink]) -> str:
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


def _join(plan: _Plan, sink: _PartitionSink) -> tuple[pl.DataFrame, InferenceStats]:
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
