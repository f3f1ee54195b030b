"""Checkpoint logic of `run_inference`, without an engine: reuse, fingerprints, failures, cleanup.

The `generate` functions here are plain deterministic functions standing in for an engine's
contract (one Generation per prompt, in order); the real engine is exercised in test_resume_kill.py.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from upath import UPath

from batch_assets.storage.checkpoints import CheckpointStore, clear_checkpoints, model_identity, run_fingerprint
from batch_assets.pipeline.run_inference import InferenceError, run_inference
from batch_assets.engines.vllm_engine import Generation


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


class Engine:
    """Deterministic outputs (the label is the text reversed); fails after `fail_after` prompts."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.seen: list[list[int]] = []
        self.fail_after = fail_after
        self.calls = 0

    def __call__(self, token_ids: list[list[int]]) -> list[Generation]:
        if self.fail_after is not None and len(self.seen) + len(token_ids) > self.fail_after:
            raise RuntimeError("EngineCore died: Killed (exit code -9)")
        self.calls += 1
        self.seen += token_ids
        return [Generation("".join(chr(c) for c in ids if c)[::-1], "stop", len(ids), 3) for ids in token_ids]


def infer(frame: pl.DataFrame, engine: Engine, store: CheckpointStore | None, *, batch_size: int = 4, deduplicate: bool = True, max_model_len: int = 64):
    return run_inference(
        frame,
        tokenize=tokenize,
        generate=engine,
        max_model_len=max_model_len,
        max_tokens=8,
        batch_size=batch_size,
        deduplicate=deduplicate,
        checkpoints=store,
    )


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


def test_rerun_after_success_reuses_everything_and_starts_no_engine(partition_dir: UPath) -> None:
    frame = formatted_frame(["a", "b", "c"])
    infer(frame, Engine(), CheckpointStore(partition_dir, "fp"))
    starts: list[int] = []
    out, stats = run_inference(
        frame, tokenize=tokenize, generate=Engine(fail_after=0), max_model_len=64, max_tokens=8, batch_size=2,
        deduplicate=True, checkpoints=CheckpointStore(partition_dir, "fp"), start_engine=lambda: starts.append(1),
    )
    assert stats.rows_from_checkpoint == 3 and stats.rows_inferred == 0 and starts == []
    assert out["generated_text"].to_list() == ["a", "b", "c"]


def test_checkpoints_of_other_settings_are_never_reused_and_get_removed(partition_dir: UPath) -> None:
    frame = formatted_frame(["a", "b"])
    infer(frame, Engine(), CheckpointStore(partition_dir, run_fingerprint({"model": "m1", "temperature": 0})))
    other = CheckpointStore(partition_dir, run_fingerprint({"model": "m2", "temperature": 0}))
    assert other.fingerprint != CheckpointStore(partition_dir, run_fingerprint({"temperature": 0, "model": "m1"})).fingerprint
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
    run_inference(
        frame, tokenize=tokenize, generate=Engine(), max_model_len=64, max_tokens=8,
        batch_size=1024, deduplicate=True, checkpoints=CheckpointStore(partition_dir, "fp"), log=lines.append,
    )
    assert lines[0].startswith("1000 requests to infer") and "checkpoint every 100" in lines[0]
    progress = [line for line in lines if line.startswith("inferred ")]
    assert len(progress) == 10 and progress[-1].startswith("inferred 1000/1000 requests (100%)")
    # Small partitions are not cut into tiny engine calls.
    lines.clear()
    engine = Engine()
    run_inference(
        formatted_frame([f"p {i}" for i in range(30)]), tokenize=tokenize, generate=engine, max_model_len=64,
        max_tokens=8, batch_size=1024, deduplicate=True, checkpoints=None, log=lines.append,
    )
    assert engine.calls == 1 and "checkpoint every 64" in lines[0]
