"""Checkpoint logic of `run_inference`, without an engine: reuse, fingerprints, failures, cleanup.

The engines here are plain deterministic functions standing in for an engine's contract (one
Generation per prompt, in order), behind the session interface every engine offers; the real
engine is exercised in test_resume_kill.py and test_inference_engine.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest
from upath import UPath

from batch_assets.pipeline import checkpoint_writer
from batch_assets.pipeline import run_inference as run_inference_module
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.inference_requests import PartitionInput, request_keys
from batch_assets.pipeline.run_inference import InferenceError, run_inference
from batch_assets.storage.checkpoints import CheckpointStore, clear_checkpoints, model_identity, run_fingerprint
from batch_assets.storage.errors import StorageError
from batch_assets.storage.result_cache import ResultCache
from batch_assets_tests.support.scripted_engine import Engine, Session, encode, formatted_frame, infer, tokenize


@pytest.fixture
def partition_dir(tmp_path: Path) -> UPath:
    return UPath(tmp_path / "_checkpoints" / "posts.jsonl")


def test_a_failed_run_keeps_finished_chunks_and_the_rerun_infers_only_the_rest(partition_dir: UPath) -> None:
    texts = [f"post {i}" for i in range(10)]
    frame = formatted_frame(texts)
    store = CheckpointStore(partition_dir, "fp")
    with pytest.raises(InferenceError) as failure:
        infer(frame, Engine(fail_after=8), store)
    # The engine's own message, and what is kept.
    assert "EngineCore died: Killed (exit code -9)" in str(failure.value)
    assert "the 8 requests finished before are checkpointed" in str(failure.value)
    assert len(store.chunk_paths()) == 2

    engine = Engine()
    out, stats = infer(frame, engine, CheckpointStore(partition_dir, "fp"))
    assert (stats.rows_from_checkpoint, stats.rows_inferred) == (8, 2)
    assert len(engine.seen) == 2
    assert out["row_id"].to_list() == list(range(10))
    assert out["generated_text"].to_list() == [t[::-1] for t in texts]
    assert out["error"].null_count() == 10


def test_log_probabilities_survive_checkpoints_and_older_chunks_without_them_still_count(
    partition_dir: UPath,
) -> None:
    frame = formatted_frame(["ab", "abcd", "abcdef"])
    store = CheckpointStore(partition_dir, "fp")
    with pytest.raises(InferenceError):
        infer(frame, Engine(fail_after=2), store, batch_size=2)
    # A chunk written before the column existed (an upgrade mid-partition) is still reused.
    pl.DataFrame(
        {
            "request_key": [request_keys(["<prompt>abcdef</prompt>"], [2], True)[0]],
            "generated_text": ["fedcba"],
            "finish_reason": ["stop"],
            "num_prompt_tokens": [8],
            "num_generated_tokens": [3],
            "error": [None],
        },
        schema_overrides={"error": pl.String},
    ).write_parquet(store.folder / "chunk-00000000000000000001-old.parquet")
    out, stats = infer(frame, Engine(fail_after=0), CheckpointStore(partition_dir, "fp"), batch_size=2)
    assert (stats.rows_from_checkpoint, stats.rows_inferred) == (3, 0)
    # 4 and 6 token ids (text + two zeros) from the fake engine's -len/100; the old chunk has none.
    assert out["cumulative_logprob"].to_list() == [-0.04, -0.06, None]
    assert out["generated_text"].to_list() == ["ba", "dcba", "fedcba"]


def test_rerun_after_success_reuses_everything_and_starts_no_engine(partition_dir: UPath) -> None:
    frame = formatted_frame(["a", "b", "c"])
    infer(frame, Engine(), CheckpointStore(partition_dir, "fp"))
    session = Session(Engine(fail_after=0), batch_size=2)
    out, stats = infer(frame, Engine(fail_after=0), CheckpointStore(partition_dir, "fp"), batch_size=2, session=session)
    assert stats.rows_from_checkpoint == 3 and stats.rows_inferred == 0 and session.starts == 0
    assert not stats.engine_started and stats.engine_start_seconds == 0.0
    assert out["generated_text"].to_list() == ["a", "b", "c"]


def test_checkpoints_of_other_settings_are_never_reused_and_get_removed(partition_dir: UPath) -> None:
    frame = formatted_frame(["a", "b"])
    infer(frame, Engine(), CheckpointStore(partition_dir, run_fingerprint({"model": "m1", "temperature": 0})))
    other = CheckpointStore(partition_dir, run_fingerprint({"model": "m2", "temperature": 0}))
    assert (
        other.fingerprint
        != CheckpointStore(partition_dir, run_fingerprint({"temperature": 0, "model": "m1"})).fingerprint
    )
    assert other.discard_other_fingerprints()
    assert [p.name for p in partition_dir.iterdir()] == []
    _, stats = infer(frame, Engine(), other)
    assert stats.rows_from_checkpoint == 0 and stats.rows_inferred == 2


def test_a_changed_prompt_is_inferred_again_under_the_same_settings(partition_dir: UPath) -> None:
    infer(formatted_frame(["a", "b"]), Engine(), CheckpointStore(partition_dir, "fp"))
    out, stats = infer(formatted_frame(["a", "b2"]), Engine(), CheckpointStore(partition_dir, "fp"))
    assert (stats.rows_from_checkpoint, stats.rows_inferred) == (1, 1)
    assert out["generated_text"].to_list() == ["a", "2b"]


def test_duplicates_are_inferred_once_and_every_row_gets_the_result(partition_dir: UPath) -> None:
    frame = formatted_frame(["same", None, "same", "other", "same"])
    engine = Engine()
    out, stats = infer(frame, engine, CheckpointStore(partition_dir, "fp"))
    assert len(engine.seen) == 2 and stats.rows_deduplicated == 2
    assert out["generated_text"].to_list() == ["emas", None, "emas", "rehto", "emas"]
    assert out["error"][1].startswith("null_text")
    # Without deduplication (sampling without a seed) every row is its own request.
    engine = Engine()
    _, stats = infer(frame, engine, CheckpointStore(partition_dir, "fp2"), deduplicate=False)
    assert len(engine.seen) == 4 and stats.rows_deduplicated == 0


def test_chunks_are_never_counted_twice(partition_dir: UPath) -> None:
    """A chunk saved twice (e.g. two attempts that overlapped) still gives one row per record."""
    frame = formatted_frame(["a", "b", "c"])
    store = CheckpointStore(partition_dir, "fp")
    infer(frame, Engine(), store)
    for chunk in store.chunk_paths():
        (chunk.parent / chunk.name.replace("chunk-", "chunk-9")).write_bytes(chunk.read_bytes())
    out, stats = infer(frame, Engine(fail_after=0), store)
    assert out.height == 3 and stats.rows_from_checkpoint == 3


def test_prompts_too_long_for_the_context_are_error_rows_not_engine_failures(partition_dir: UPath) -> None:
    frame = formatted_frame(["short", "x" * 100])
    out, stats = infer(frame, Engine(), CheckpointStore(partition_dir, "fp"), max_model_len=20)
    assert out["error"][0] is None and out["error"][1].startswith("prompt_too_long")
    assert stats.rows_inferred == 1
    # Never sent, so not billed (issue 56, item 6): only the short prompt's tokens count.
    assert stats.sent_prompt_tokens == out["num_prompt_tokens"][0] < out["num_prompt_tokens"][1]


def test_input_columns_named_like_internal_ones_survive() -> None:
    frame = formatted_frame(["a"], extra={"inference_error": ["theirs"], "engine_prompt_tokens": ["7"]})
    out, _ = infer(frame, Engine(), None)
    assert out["inference_error"].to_list() == ["theirs"] and out["engine_prompt_tokens"].to_list() == ["7"]


def test_clear_removes_every_fingerprint_of_the_partition(partition_dir: UPath) -> None:
    infer(formatted_frame(["a"]), Engine(), CheckpointStore(partition_dir, "one"))
    infer(formatted_frame(["a"]), Engine(), CheckpointStore(partition_dir, "two"))
    clear_checkpoints(partition_dir)
    assert not partition_dir.exists()


def test_an_empty_partition_needs_no_engine(partition_dir: UPath) -> None:
    out, stats = infer(formatted_frame([]), Engine(fail_after=0), CheckpointStore(partition_dir, "fp"))
    assert out.height == 0 and stats.rows_inferred == 0 and "generated_text" in out.columns


def test_model_identity_changes_when_weights_are_replaced_in_place(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"v1")
    before = model_identity(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"v2-bigger")
    assert model_identity(str(tmp_path)) != before
    assert model_identity("org/some-model") == "org/some-model"


def test_progress_is_logged_at_least_every_tenth_of_the_partition(partition_dir: UPath) -> None:
    frame = formatted_frame([f"post {i}" for i in range(1000)])
    lines: list[str] = []
    infer(frame, Engine(), CheckpointStore(partition_dir, "fp"), batch_size=1024, log=lines.append)
    assert lines[0].startswith("1000 requests to infer") and "checkpoint every 1024 results or 30 s" in lines[0]
    progress = [line for line in lines if line.startswith("inferred ")]
    assert len(progress) == 10 and progress[-1].startswith("inferred 1000/1000 requests (100%)")
    # Small partitions are not cut into tiny engine calls.
    lines.clear()
    engine = Engine()
    infer(formatted_frame([f"p {i}" for i in range(30)]), engine, None, batch_size=1024, log=lines.append)
    assert engine.calls == 1 and "checkpoint every 1024 results or 30 s" in lines[0]


class RecordingStore(CheckpointStore):
    """A real checkpoint store that also notes the size and thread of every chunk it writes, and
    fails the write of chunk `fail_at` (a full disk, an S3 outage)."""

    def __init__(self, partition_dir: UPath, fail_at: int | None = None) -> None:
        super().__init__(partition_dir, "fp")
        self.writes: list[tuple[int, str]] = []
        self.fail_at = fail_at

    def save(self, chunk: pl.DataFrame) -> None:
        if len(self.writes) == self.fail_at:
            raise OSError(28, "No space left on device")
        self.writes.append((chunk.height, threading.current_thread().name))
        super().save(chunk)


def test_a_chunk_is_written_every_batch_size_results_off_the_feeding_thread(partition_dir: UPath) -> None:
    store = RecordingStore(partition_dir)
    frame = formatted_frame([f"post {i}" for i in range(250)])
    infer(frame, Engine(), store, batch_size=100)
    assert [rows for rows, _ in store.writes] == [100, 100, 50]
    assert {thread for _, thread in store.writes} == {"checkpoint-writer"}
    assert CheckpointStore(partition_dir, "fp").load().height == 250


def test_a_chunk_is_written_after_checkpoint_seconds_even_when_short_of_batch_size(
    partition_dir: UPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big partition on a slow engine: time, not rows, decides; here every result is 'late'."""
    monkeypatch.setattr(run_inference_module, "CHECKPOINT_SECONDS", 0.0)
    store = RecordingStore(partition_dir)
    infer(formatted_frame([f"post {i}" for i in range(5)]), Engine(), store, batch_size=1024)
    assert [rows for rows, _ in store.writes] == [1, 1, 1, 1, 1]


def test_a_due_chunk_is_written_while_the_engine_stalls_before_its_next_result(partition_dir: UPath) -> None:
    """One result, then the engine works on for a long while (a long request): the chunk is written on
    time by the checkpoint timer, not when the next result comes (a kill in the stall lost it)."""
    release = threading.Event()

    class StallingSession(Session):
        def stream(self, prompts):
            sent = list(prompts)
            yield 0, Generation("first", "stop", 3, 1)
            release.wait(30)
            for position in range(1, len(sent)):
                yield position, Generation("later", "stop", 3, 1)

    store = RecordingStore(partition_dir)
    frame = formatted_frame([f"post {i}" for i in range(5)])
    done: list[pl.DataFrame] = []

    def run() -> None:
        [(out, _)] = run_inference(
            [PartitionInput(frame, encode, store, "posts.jsonl")],
            session=StallingSession(Engine(), 1024),
            max_model_len=64,
            max_tokens=8,
            batch_size=1024,
            deduplicate=True,
            checkpoint_seconds=0.2,
        )
        done.append(out)

    feeder = threading.Thread(target=run)
    started = time.monotonic()
    feeder.start()
    try:
        on_disk = CheckpointStore(partition_dir, "fp")
        # The stall lasts 30 s: a chunk within 10 s is the timer's (0.2 s, a tick and a write, with
        # room for a machine busy with another test's engine).
        while on_disk.load().is_empty() and time.monotonic() - started < 10:
            time.sleep(0.01)
        waited = time.monotonic() - started
        assert on_disk.load()["generated_text"].to_list() == ["first"], f"no chunk after {waited:.1f} s of stall"
        assert store.writes == [(1, "checkpoint-writer")]
        assert not done  # the stream is still stalled
    finally:
        release.set()
        feeder.join(10)
    assert done[0]["generated_text"].to_list()[0] == "first"
    assert [rows for rows, _ in store.writes] == [1, 4]


class SkippingClock:
    """The `time` module as run_inference sees it, with `skipped` seconds added to its clock: a long
    engine start without the wait (with real seconds, a loaded machine's slow rows cut chunks too)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_a_slow_engine_start_does_not_count_as_work_time(partition_dir: UPath, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 30 s run from a chunk's first result: an engine start longer than that (minutes for a large
    model) must not cut the first chunk after one row."""
    clock = SkippingClock()
    monkeypatch.setattr(run_inference_module, "time", clock)
    monkeypatch.setattr(checkpoint_writer, "time", clock)

    class SlowStart(Session):
        def start(self, requests: int = 0) -> None:
            clock.skipped += 120  # two minutes pass for run_inference, at once
            super().start()

    store = RecordingStore(partition_dir)
    engine = Engine()
    infer(
        formatted_frame([f"post {i}" for i in range(250)]),
        engine,
        store,
        batch_size=100,
        session=SlowStart(engine, 100),
    )
    assert [rows for rows, _ in store.writes] == [100, 100, 50]


def test_a_partition_whose_requests_are_done_is_checkpointed_while_the_stream_goes_on(tmp_path: Path) -> None:
    """In shared-prefix order partition a's requests ("A…") all come before b's ("Z…"): a's last chunk
    is written when its last result comes, not when the whole stream ends (a kill -9 during b
    would otherwise lose a's rows)."""
    stores = {name: RecordingStore(UPath(tmp_path / "_checkpoints" / name)) for name in ("a", "b")}
    a_written_before_b: list[bool] = []

    class WatchingEngine(Engine):
        def __call__(self, prompts: list[Prompt]) -> list[Generation]:
            if chr(prompts[0].token_ids[0]) == "Z" and not a_written_before_b:
                deadline = time.monotonic() + 30  # the writer thread, on a loaded machine
                while not stores["a"].writes and time.monotonic() < deadline:
                    time.sleep(0.01)
                a_written_before_b.append(bool(stores["a"].writes))
            return super().__call__(prompts)

    engine = WatchingEngine()
    run_inference(
        [
            PartitionInput(formatted_frame([f"Z{i}" for i in range(10)]), encode, stores["b"], "b"),
            PartitionInput(formatted_frame([f"A{i}" for i in range(10)]), encode, stores["a"], "a"),
        ],
        session=Session(engine, batch_size=5),
        max_model_len=64,
        max_tokens=8,
        batch_size=1024,
        deduplicate=True,
    )
    assert a_written_before_b == [True]
    assert [rows for rows, _ in stores["a"].writes] == [10] and [rows for rows, _ in stores["b"].writes] == [10]


def test_a_failed_checkpoint_write_fails_the_run_and_keeps_what_was_written(partition_dir: UPath) -> None:
    store = RecordingStore(partition_dir, fail_at=1)
    frame = formatted_frame([f"post {i}" for i in range(300)])
    with pytest.raises(OSError, match="No space left on device"):
        infer(frame, Engine(), store, batch_size=100)
    # The first chunk stays; a re-run reuses it and infers the rest.
    engine = Engine()
    out, stats = infer(frame, engine, CheckpointStore(partition_dir, "fp"), batch_size=100)
    assert (stats.rows_from_checkpoint, stats.rows_inferred) == (100, 200)
    assert out["generated_text"].to_list()[299] == "992 tsop"


def test_several_partitions_share_one_stream_and_keep_their_own_checkpoints_and_rows(tmp_path: Path) -> None:
    a = formatted_frame(["same", "only a", None, "same"])
    b = formatted_frame(["only b", "same"])
    stores = [CheckpointStore(UPath(tmp_path / "_checkpoints" / name), "fp") for name in ("a.jsonl", "b.jsonl")]
    engine = Engine()
    session = Session(engine, batch_size=100)
    results = run_inference(
        [PartitionInput(a, encode, stores[0], "a.jsonl"), PartitionInput(b, encode, stores[1], "b.jsonl")],
        session=session,
        max_model_len=64,
        max_tokens=8,
        batch_size=100,
        deduplicate=True,
    )
    # One engine start and one call for both; "same" (in both partitions) is inferred once, so the
    # engine starts for a stream of 3 requests (vLLM chooses how to start by it).
    assert session.starts == 1 and engine.calls == 1 and session.started_for == 3
    assert sorted(bytes(c for c in ids if c).decode() for ids in engine.seen) == ["only a", "only b", "same"]
    (out_a, stats_a), (out_b, stats_b) = results
    assert out_a["generated_text"].to_list() == ["emas", "a ylno", None, "emas"] and out_a["error"][2].startswith(
        "null_text"
    )
    assert out_b["generated_text"].to_list() == ["b ylno", "emas"]
    assert (stats_a.rows_inferred, stats_b.rows_inferred) == (2, 2)
    # Each partition's checkpoints hold what it needs: a re-run of b alone starts no engine.
    assert sorted(stores[1].load()["generated_text"].to_list()) == ["b ylno", "emas"]
    rerun = Session(Engine(fail_after=0), batch_size=100)
    out, stats = infer(b, Engine(fail_after=0), stores[1], session=rerun)
    assert (
        rerun.starts == 0 and stats.rows_from_checkpoint == 2 and out["generated_text"].to_list() == ["b ylno", "emas"]
    )


def test_without_deduplication_partitions_never_share_a_result(tmp_path: Path) -> None:
    engine = Engine()
    results = run_inference(
        [
            PartitionInput(formatted_frame(["x"]), encode, None, "a"),
            PartitionInput(formatted_frame(["x"]), encode, None, "b"),
        ],
        session=Session(engine, batch_size=10),
        max_model_len=64,
        max_tokens=8,
        batch_size=10,
        deduplicate=False,
    )
    assert len(engine.seen) == 2 and [out["generated_text"].to_list() for out, _ in results] == [["x"], ["x"]]


def test_a_per_request_max_tokens_decides_whether_a_prompt_fits() -> None:
    """`Prompt.sampling` overrides the task's sampling for one request, also in the too-long check."""
    from batch_assets.pipeline.task_spec import SamplingSpec

    def encode_long_answers(prompts: list[str], keys: list[str] | None = None) -> list[Prompt]:
        return [Prompt(tuple(ids), sampling=SamplingSpec(max_tokens=60)) for ids in tokenize(prompts)]

    engine = Engine()
    [(out, stats)] = run_inference(
        [PartitionInput(formatted_frame(["short"]), encode_long_answers, None)],
        session=Session(engine, batch_size=4),
        max_model_len=64,
        max_tokens=8,
        batch_size=4,
        deduplicate=True,
    )
    assert engine.seen == [] and out["error"][0].startswith("prompt_too_long: 7 prompt tokens + 60 max_tokens")


def test_prompts_sharing_a_prefix_are_sent_together_and_rows_keep_input_order() -> None:
    questions = ["q1", "q2", "q3"]
    texts = [f"{doc} {q}" for q in questions for doc in ("doc B", "doc A", "doc C")]
    engine = Engine()
    out, _ = infer(formatted_frame(texts), engine, None, batch_size=64)
    sent = [bytes(c for c in ids if c).decode() for ids in engine.seen]
    # Each document's questions one after another: its prefix is computed once while still cached.
    assert sent == [f"{doc} {q}" for doc in ("doc A", "doc B", "doc C") for q in questions]
    assert out["generated_text"].to_list() == [text[::-1] for text in texts]


def test_random_sampling_keeps_input_order() -> None:
    """Without deterministic decoding, each row is its own request, sent in the order of the file."""
    texts = ["doc B q1", "doc A q1", "doc B q2"]
    engine = Engine()
    infer(formatted_frame(texts), engine, None, deduplicate=False)
    assert [bytes(c for c in ids if c).decode() for ids in engine.seen] == texts


class CacheThatFillsUp(ResultCache):
    """A real SQLite result cache whose store fails when results are added (the fault a full disk
    or a Postgres that went away between lookup and add gives)."""

    def add(self, results: pl.DataFrame) -> int:
        raise StorageError(f"writing result cache {self.url}: No space left on device")


def test_a_cache_store_that_fails_at_the_end_loses_no_inferred_row(tmp_path: Path, partition_dir: UPath) -> None:
    """Issue 26: the step fails with the store's error, and every inferred row is in the
    checkpoints, so the re-run starts no engine work."""
    frame = formatted_frame([f"post {i}" for i in range(10)])
    with pytest.raises(StorageError, match="No space left on device"):
        infer(frame, Engine(), CheckpointStore(partition_dir, "fp"), cache=CacheThatFillsUp(UPath(tmp_path), "fp"))
    engine = Engine()
    out, stats = infer(frame, engine, CheckpointStore(partition_dir, "fp"), cache=ResultCache(UPath(tmp_path), "fp"))
    assert (stats.rows_from_checkpoint, stats.rows_inferred, len(engine.seen)) == (10, 0, 0)
    assert out["generated_text"].to_list() == [f"post {i}"[::-1] for i in range(10)]


class VectorEngine(Engine):
    """An embedding engine: a typed vector per prompt (its token ids as float32 values), no text."""

    def __call__(self, prompts: list[Prompt]) -> list[Generation]:
        self.seen += [list(p.token_ids) for p in prompts]
        return [Generation(None, None, len(p), 0, vector=tuple(c / 7 for c in p.token_ids)) for p in prompts]


def test_an_engines_vector_reaches_the_stores_as_before_and_comes_back_exactly(
    partition_dir: UPath, tmp_path: Path
) -> None:
    from batch_assets.pipeline.result_stores import decode_vector, encode_vector, vectors_column

    frame = formatted_frame(["ab", "yz"])
    expected = [np.asarray([c / 7 for c in ids], dtype=np.float32) for ids in tokenize(frame["prompt"].to_list())]
    cache = ResultCache(UPath(tmp_path / "cache"), "fp")
    out, _ = infer(frame, VectorEngine(), CheckpointStore(partition_dir, "fp"), cache=cache)
    # The stores' format is unchanged (base64 float32 text): entries written before read as they are.
    assert out["generated_text"].to_list() == [encode_vector(v) for v in expected]
    assert all(np.array_equal(decode_vector(t), v) for t, v in zip(out["generated_text"], expected, strict=True))
    assert vectors_column(out["generated_text"]).dtype == pl.Array(pl.Float32, 4)
    # From the cache, with no engine: the same vectors.
    engine = VectorEngine()
    again, stats = infer(frame, engine, CheckpointStore(partition_dir / "other", "fp"), cache=cache)
    assert (stats.rows_inferred, engine.seen) == (0, [])
    assert again["generated_text"].to_list() == out["generated_text"].to_list()


def test_results_reach_the_cache_in_batches_while_the_stream_goes_on_each_after_its_checkpoint(
    tmp_path: Path, partition_dir: UPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread adds finished results to the result cache every `CACHE_ROWS_PER_ADD`
    results, not all at the stream's end (no pile of rows to insert after the last result), and
    only what is already checkpointed: a kill -9 at any moment repeats nothing."""
    monkeypatch.setattr(checkpoint_writer, "CACHE_ROWS_PER_ADD", 4)
    cache, store = ResultCache(UPath(tmp_path), "fp"), CheckpointStore(partition_dir, "fp")
    seen_mid_stream: list[tuple[int, bool]] = []

    class WatchingEngine(Engine):
        def __call__(self, prompts: list[Prompt]) -> list[Generation]:
            if len(self.seen) == 12:  # 12 of 20 answered: 3 chunks of 4 handed to the writer
                deadline = time.monotonic() + 30  # the writer thread, on a loaded machine
                while cache.lookup().height < 12 and time.monotonic() < deadline:
                    time.sleep(0.01)
                cached = set(cache.lookup()["request_key"])
                seen_mid_stream.append((len(cached), cached <= set(store.load()["request_key"])))
            return super().__call__(prompts)

    texts = [f"post {i}" for i in range(20)]
    out, stats = infer(formatted_frame(texts), WatchingEngine(), store, cache=cache, batch_size=4)
    assert seen_mid_stream == [(12, True)]
    assert stats.rows_cached == 20 and cache.lookup().height == 20
    assert out["generated_text"].to_list() == [text[::-1] for text in texts]


def test_each_prompt_reaches_the_engine_with_its_request_key(partition_dir: UPath) -> None:
    """A request's stable name across runs (the batch API's `custom_id` is built from it): without
    deduplication identical prompts of different rows get different keys."""
    seen: list[Prompt] = []

    class Recording(Session):
        def stream(self, prompts):
            prompts = list(prompts)
            seen.extend(prompts)
            return super().stream(prompts)

    frame = formatted_frame(["same", "same", "other"])
    infer(frame, Engine(), None, deduplicate=False, session=Recording(Engine(), 4))
    expected = request_keys(frame["prompt"].to_list(), [0, 1, 2], deduplicate=False)
    assert [p.key for p in seen] == expected and len(set(expected)) == 3


def test_requests_of_several_partitions_reach_the_engine_named_by_their_request_keys() -> None:
    """With deduplication, partitions that share a request (encoded by its first partition, the rest
    by theirs, in one chunk) still send each prompt named by its `request_key`."""
    keys: list[str | None] = []

    def engine(prompts: list[Prompt]) -> list[Generation]:
        keys.extend(p.key for p in prompts)
        return Engine()(prompts)

    run_inference(
        [
            PartitionInput(formatted_frame(["x", "y"]), encode, None, "a"),
            PartitionInput(formatted_frame(["y", "z"]), encode, None, "b"),
        ],
        session=Session(engine, batch_size=10),  # type: ignore[arg-type]
        max_model_len=64,
        max_tokens=8,
        batch_size=10,
        deduplicate=True,
    )
    prompts = [f"<prompt>{text}</prompt>" for text in ("x", "y", "z")]
    assert sorted(k for k in keys if k is not None) == sorted(request_keys(prompts, [0, 1, 2], True)) and len(keys) == 3


class StoppedSession(Session):
    """Answers `answered` prompts (the label is the text reversed), then the stop arrives while it waits
    for the next result: Ctrl-C (KeyboardInterrupt) or, inside a Dagster step, Dagster's own error."""

    def __init__(self, answered: int, stop: BaseException) -> None:
        super().__init__(Engine(), 1024)
        self.answered, self.stop = answered, stop

    def stream(self, prompts):
        for position, prompt in enumerate(list(prompts)[: self.answered]):
            yield position, Engine()([prompt])[0]
        raise self.stop


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), dg.DagsterExecutionInterruptedError()], ids=type)
def test_a_stop_keeps_every_finished_result_in_the_checkpoints_and_the_cache(
    stop: BaseException, tmp_path: Path, partition_dir: UPath
) -> None:
    """Issue 47: a stop is a BaseException, and only an engine Exception flushed the sinks: the 6
    results finished before the stop (short of `batch_size` and of `checkpoint_seconds`) were lost."""
    texts = [f"post {i}" for i in range(10)]
    frame = formatted_frame(texts)
    cache, store = ResultCache(UPath(tmp_path / "cache"), "fp"), CheckpointStore(partition_dir, "fp")
    with pytest.raises(type(stop)):
        infer(frame, Engine(), store, cache=cache, batch_size=1024, session=StoppedSession(6, stop))
    keys = request_keys(frame["prompt"], range(10), True)
    finished = {key: text[::-1] for key, text in zip(keys[:6], texts[:6], strict=True)}
    kept = store.load()
    assert dict(zip(kept["request_key"], kept["generated_text"], strict=True)) == finished
    cached = cache.lookup()
    assert dict(zip(cached["request_key"], cached["generated_text"], strict=True)) == finished
    # The re-run sends only the 4 others, and says where the 6 came from: the stopped attempt.
    engine = Engine()
    out, stats = infer(frame, engine, CheckpointStore(partition_dir, "fp"), cache=cache, batch_size=1024)
    assert (stats.rows_from_checkpoint, stats.rows_from_cache, stats.rows_inferred) == (6, 0, 4)
    assert [bytes(ids[:-2]).decode() for ids in engine.seen] == texts[6:]
    assert out["generated_text"].to_list() == [text[::-1] for text in texts]
