"""A stream's results kept as they finish: each partition checkpoints its finished results every
`batch_size` results or `CHECKPOINT_SECONDS`, whichever comes first, on a writer thread that also
adds them to the result cache in batches; a timer thread writes a chunk that is due while the engine
has no result to hand over.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import polars as pl

from batch_assets.pipeline.engine_contract import Generation
from batch_assets.pipeline.inference_requests import RequestPlan
from batch_assets.pipeline.result_stores import RESULT_SCHEMA, ResultLookup, encode_vector

# A partition's finished results are checkpointed at least this often (and every `batch_size` results):
# a kill loses at most this much engine work, and a 50 M-row job writes thousands of chunks, not 49,000.
CHECKPOINT_SECONDS = 30.0
# Chunks waiting for the writer thread at most; beyond that the feeding thread waits (bounded memory).
_MAX_QUEUED_CHUNKS = 8


class ChunkWriter:
    """Builds and writes the partitions' result chunks on a thread of its own, so checkpoint writes
    (an S3 PUT each) and result cache inserts never stall the thread that feeds the engine. `drain()`
    waits for every chunk handed over and raises the first checkpoint write error; a failed write
    also surfaces at the next `put`."""

    def __init__(self) -> None:
        self._chunks: queue.Queue[tuple[PartitionSink, Chunk] | None] = queue.Queue(_MAX_QUEUED_CHUNKS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def put(self, sink: PartitionSink, chunk: Chunk) -> None:
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
class TooLong:
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
class Chunk:
    """Results handed from the feeding thread to the writer: the request index of each (its key is
    looked up there, as a column) and what the engine returned. No row is built on the feeding thread."""

    indices: list[int] = field(default_factory=list)
    results: list[Generation | TooLong] = field(default_factory=list)

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
class PartitionSink:
    """A partition's new results, checkpointed every `checkpoint_rows` results, when a chunk's first
    result is `checkpoint_seconds` old (`flush_if_due`, called by the checkpoint timer: in
    shared-prefix order a partition may get no result for a long while, and a long request may hold
    up the whole stream), and at its last result. The feeding thread adds and the timer flushes:
    the buffer changes hands under `lock`. The writer thread builds each chunk's frame, saves it to
    the checkpoints, and adds the finished results to the result cache in batches: after the
    checkpoints, so a kill loses nothing checkpointed, and a cache that fails is reported at the end,
    once every chunk is checkpointed (`cache_error`)."""

    plan: RequestPlan
    writer: ChunkWriter
    keys: pl.Series  # of the stream's requests, by request index
    cache: ResultLookup | None = None
    checkpoint_seconds: float = CHECKPOINT_SECONDS
    lock: threading.Lock = field(default_factory=threading.Lock)
    buffer: Chunk = field(default_factory=Chunk)
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

    def add(self, index: int, result: Generation | TooLong) -> None:
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
            chunk, self.buffer = self.buffer, Chunk()
            self.writer.put(self, chunk)

    def write(self, chunk: Chunk) -> None:
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
        self.unsent += [index for index, result in refused if isinstance(result, TooLong)]
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
def checkpoint_timer(sinks: list[PartitionSink], seconds: float) -> Iterator[None]:
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
