"""The result cache: reuse across partitions and re-runs, its keys, and concurrent writers."""

from __future__ import annotations

import threading
from pathlib import Path

import polars as pl
import pytest
from upath import UPath

from batch_assets.storage import result_cache
from batch_assets.storage.checkpoints import CheckpointStore
from batch_assets.storage.result_cache import ResultCache
from batch_assets.pipeline.run_inference import request_keys
from batch_assets_tests.test_inference_checkpoints import Engine, Session, formatted_frame
from batch_assets_tests.test_inference_checkpoints import infer as infer_partition


@pytest.fixture
def task_dir(tmp_path: Path) -> UPath:
    return UPath(tmp_path / "storage" / "industry")


def infer(frame: pl.DataFrame, engine: Engine, cache: ResultCache | None, *, deterministic: bool = True, partition: str = "a.csv", root: UPath | None = None):
    store = CheckpointStore((root or UPath("/nonexistent")) / "_checkpoints" / partition, "fp") if root else None
    return infer_partition(frame, engine, store, deduplicate=deterministic, cache=cache)


def test_a_second_partition_reuses_the_first_ones_results(task_dir: UPath) -> None:
    first, second = Engine(), Engine()
    _, stats = infer(formatted_frame(["Acme", "Globex", "Initech"]), first, ResultCache(task_dir, "fp"), root=task_dir)
    assert (stats.rows_inferred, stats.rows_from_cache, stats.rows_cached) == (3, 0, 3)

    out, stats = infer(formatted_frame(["Globex", "Umbrella", "Acme", None]), second, ResultCache(task_dir, "fp"), partition="b.csv", root=task_dir)
    # Only the new company reaches the engine; every row still gets its result, in input order.
    assert [bytes(c for c in ids if c).decode() for ids in second.seen] == ["Umbrella"]
    assert (stats.rows_inferred, stats.rows_from_cache, stats.rows_cached) == (1, 2, 1)
    assert out["generated_text"].to_list() == ["xebolG", "allerbmU", "emcA", None]
    assert out["error"][3].startswith("null_text")


def test_a_rerun_is_served_from_the_cache_without_starting_the_engine(task_dir: UPath) -> None:
    frame = formatted_frame(["a", "b", "a"])
    infer(frame, Engine(), ResultCache(task_dir, "fp"))
    session = Session(Engine(fail_after=0), batch_size=4)
    out, stats = infer_partition(frame, Engine(fail_after=0), None, cache=ResultCache(task_dir, "fp"), session=session)
    assert session.starts == 0 and stats.rows_inferred == 0 and stats.rows_from_cache == 2
    assert out["generated_text"].to_list() == ["a", "b", "a"]


def test_other_settings_and_random_sampling_never_share_results(task_dir: UPath) -> None:
    infer(formatted_frame(["a", "b"]), Engine(), ResultCache(task_dir, "fp-model-1"))
    engine = Engine()
    _, stats = infer(formatted_frame(["a", "b"]), engine, ResultCache(task_dir, "fp-model-2"))
    assert stats.rows_from_cache == 0 and len(engine.seen) == 2
    # Random sampling: every row is its own request; nothing is read from or written to the cache.
    engine = Engine()
    _, stats = infer(formatted_frame(["a", "b"]), engine, ResultCache(task_dir, "fp-model-1"), deterministic=False)
    assert (stats.rows_from_cache, stats.rows_cached, len(engine.seen)) == (0, 0, 2)


def test_failed_and_too_long_requests_are_not_cached(task_dir: UPath) -> None:
    cache = ResultCache(task_dir, "fp")
    frame = formatted_frame(["short", "x" * 80])
    out, stats = infer(frame, Engine(), cache)
    assert out["error"][1].startswith("prompt_too_long")
    assert stats.rows_cached == 1 and cache.lookup()["request_key"].to_list() == request_keys(frame["prompt"][:1].to_list(), [0], True)


def test_compaction_keeps_every_result_while_other_runs_read_and_write(task_dir: UPath, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(result_cache, "COMPACT_AFTER_FILES", 4)
    writers, per_writer = 4, 12
    failures: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            for i in range(per_writer):
                frame = formatted_frame([f"w{worker}-{i}"])
                infer(frame, Engine(), ResultCache(task_dir, "fp"))
                # A reader in the middle of other writers' compactions sees its own result.
                assert ResultCache(task_dir, "fp").lookup(pl.Series(request_keys(frame["prompt"].to_list(), [0], True))).height == 1
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    cache = ResultCache(task_dir, "fp")
    assert cache.lookup().height == writers * per_writer
    cache.compact()
    assert len(list(cache.folder.iterdir())) == 1 and cache.lookup().height == writers * per_writer
