"""Engine settings declared once: first-class `engine:` fields, everything else in `engine.vllm_args`,
checked against vLLM's own engine arguments (`AsyncEngineArgs`, asked once per installed vLLM in a
child process) when the definitions load; data parallelism; no engine started."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from batch_assets.engines.engine_figures import EngineFigures
from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.engines.vllm_lifecycle import engine_process_environment
from batch_assets.engines.vllm_settings import VLLMSettings, resolve_data_parallel_size
from batch_assets.pipeline.engine_contract import EngineStartError, Generation, Prompt
from batch_assets.pipeline.task_spec import TaskSpecError, load_task_spec, load_task_specs
from batch_assets_tests.support import REPO_ROOT

GOOD = """
input: {text_fields: [text]}
prompt: {system: "Classify.", template: "Text: {text}"}
output: {kind: choices, choices: [yes, no]}
"""


def task_file(folder: Path, engine: str, name: str = "tickets") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(GOOD + "engine:\n" + engine)
    return path


def test_an_unknown_vllm_arg_is_refused_when_settings_resolve_naming_the_task_the_key_and_the_closest_names(
    tmp_path: Path,
) -> None:
    # It loads (the pure checks need no vLLM); a model id, so nothing is converted or read.
    typo = load_task_spec(task_file(tmp_path, "  model: org/model-a\n  vllm_args:\n    max_num_seq: 64\n"))
    engine = VLLMEngine()
    with pytest.raises(TaskSpecError) as refused:
        engine.resolve(typo)  # what building the definitions and `batch-assets run` call first
    message = str(refused.value)
    assert "engine.vllm_args.max_num_seq in the task file of 'tickets' is not an argument of vLLM's engine" in message
    assert "did you mean max_num_seqs" in message
    # A field of vLLM's AsyncEngineArgs passes; a name set on the resource is named as the resource's.
    good = load_task_spec(task_file(tmp_path / "good", "  vllm_args:\n    max_num_seqs: 64\n"))
    assert engine.engine_argument_problem(good) is None
    resource = VLLMEngine(vllm_args={"enable_prefix_cache": True}).engine_argument_problem(good) or ""
    assert resource.startswith("`vllm_args.enable_prefix_cache` of the vLLM engine resource is not an argument")
    assert "did you mean enable_prefix_caching" in resource


def test_vllms_argument_names_are_asked_once_per_installed_vllm_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batch_assets.engines import vllm_args

    monkeypatch.setenv("BATCH_ASSETS_CACHE", str(tmp_path / "cache"))
    vllm_args.engine_argument_names.cache_clear()
    names = vllm_args.engine_argument_names()
    assert {"max_num_seqs", "enable_prefix_caching", "dtype", "seed"} <= names and "max_num_seq" not in names
    (kept,) = (tmp_path / "cache").glob("vllm-engine-args-*.json")
    # The next process reads the kept list: what is in the file is what it believes.
    kept.write_text('["max_num_seqs", "only_in_this_file"]', encoding="utf-8")
    vllm_args.engine_argument_names.cache_clear()
    assert vllm_args.engine_argument_names() == {"max_num_seqs", "only_in_this_file"}
    vllm_args.engine_argument_names.cache_clear()


def test_batch_assets_tasks_exits_non_zero_on_an_unknown_vllm_arg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from batch_assets import cli

    task_file(tmp_path / "tasks", "  vllm_args:\n    enable_prefix_cache: true\n")
    task_file(tmp_path / "tasks", "  vllm_args:\n    enable_prefix_caching: true\n", name="good")
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path / "tasks"))
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(tmp_path / "data"))
    assert cli.main(["tasks"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("good\tchoices") and "tickets" not in out
    assert "ERROR: task 'tickets' not loaded: engine.vllm_args.enable_prefix_cache in the task file of" in err
    assert "did you mean enable_prefix_caching" in err


def test_vllm_args_reach_the_engine_over_the_pipeline_defaults(tmp_path: Path) -> None:
    task = load_task_spec(
        task_file(tmp_path, "  max_model_len: 512\n  vllm_args:\n    max_num_seqs: 8\n    block_size: 32\n")
    )
    args = VLLMEngine().settings(task).engine_args()
    assert (args["max_num_seqs"], args["block_size"], args["max_model_len"]) == (8, 32, 512)
    assert args["enforce_eager"] is True and args["enable_prefix_caching"] is True  # the pipeline's defaults
    # The resource's vllm_args win over the task's, for every task.
    assert VLLMEngine(vllm_args={"max_num_seqs": 4}).settings(task).engine_args()["max_num_seqs"] == 4


def test_on_a_cpu_the_engine_gets_a_fixed_kv_cache_and_no_chunked_prefill(tmp_path: Path) -> None:
    task = load_task_spec(task_file(tmp_path, "  max_model_len: 512\n"))
    args = VLLMEngine().settings(task).engine_args()
    assert args["kv_cache_memory_bytes"] == 2 << 30
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 8192


def test_on_a_cpu_in_eager_mode_only_a_large_stream_compiles_the_samplers_rank_counter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    spawn = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}  # on every device: see the reaper
    settings = VLLMEngine().settings(load_task_spec(task_file(tmp_path, "  max_model_len: 512\n")))
    assert not settings.on_gpu and engine_process_environment(settings) == {**spawn, "TORCHDYNAMO_DISABLE": "1"}
    assert engine_process_environment(settings, requests=9_999) == {**spawn, "TORCHDYNAMO_DISABLE": "1"}
    # A stream this large repays the ~4-20 s compile: ~0.16 ms a generated token eagerly.
    assert engine_process_environment(settings, requests=10_000) == spawn
    # A GPU, or a model vLLM compiles on purpose, keeps torch.compile.
    assert engine_process_environment(dataclasses.replace(settings, on_gpu=True)) == spawn
    compiled = load_task_spec(task_file(tmp_path / "c", "  vllm_args: {enforce_eager: false}\n"))
    assert engine_process_environment(VLLMEngine().settings(compiled)) == spawn
    # The user's own choices win.
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert engine_process_environment(settings) == {}
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert engine_process_environment(settings, requests=50_000) == {}


def test_task_files_with_engine_arguments_at_the_top_level_keep_working(tmp_path: Path) -> None:
    task = load_task_spec(task_file(tmp_path, "  max_num_seqs: 16\n  dtype: float32\n  enforce_eager: false\n"))
    assert task.engine.vllm_args == {"dtype": "float32", "enforce_eager": False, "max_num_seqs": 16}
    with pytest.raises(TaskSpecError, match="engine.max_num_seqs and engine.vllm_args.max_num_seqs are both set"):
        load_task_spec(task_file(tmp_path, "  max_num_seqs: 16\n  vllm_args: {max_num_seqs: 8}\n", name="both"))


def test_first_class_settings_are_refused_inside_vllm_args(tmp_path: Path) -> None:
    with pytest.raises(TaskSpecError, match="engine.vllm_args.max_model_len: set it as `engine.max_model_len`"):
        load_task_spec(task_file(tmp_path, "  vllm_args: {max_model_len: 512}\n"))
    with pytest.raises(TaskSpecError, match="set it as `engine.kv_cache_memory_gib`"):
        load_task_spec(task_file(tmp_path, "  vllm_args: {kv_cache_memory_bytes: 1000}\n", name="kv"))
    # The labels' confidence relies on vLLM's default log-probabilities.
    with pytest.raises(TaskSpecError, match="engine.vllm_args.logprobs_mode cannot be changed: the labels' `confid"):
        load_task_spec(task_file(tmp_path, "  vllm_args: {logprobs_mode: processed_logits}\n", name="lp"))


def test_building_definitions_refuses_a_task_with_an_unknown_vllm_arg_without_importing_vllm(tmp_path: Path) -> None:
    # The names come from a child process (or the kept list): the code location never imports vLLM.
    task_file(tmp_path, "  vllm_args: {max_num_seqs: 8, max_num_seq: 8}\n")
    task_file(tmp_path, "  vllm_args: {max_num_seqs: 8}\n", name="good")
    code = (
        "import sys; from pathlib import Path; from batch_assets.pipeline.task_spec import load_task_specs; "
        "from batch_assets.lib.task_definitions import build_definitions; "
        f"defs = build_definitions(tasks=load_task_specs(Path({str(tmp_path)!r}))); "
        "build_definitions(tasks=load_task_specs()); "
        "keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}; "
        "print(sorted({key.split('/')[0] for key in keys}), 'vllm' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.stdout.strip().splitlines()[-1] == "['good'] False", done.stderr


def test_the_checkpoint_identity_ignores_throughput_knobs_but_not_output_relevant_args(tmp_path: Path) -> None:
    base = VLLMEngine().settings(load_task_spec(task_file(tmp_path, "  max_model_len: 512\n")))
    assert base.identity() == {
        "model": base.model,
        "dtype": "auto",
        "seed": 0,
    }  # as before vllm_args: old checkpoints stay valid
    tuned = VLLMEngine(vllm_args={"max_num_seqs": 4, "enforce_eager": False}).settings(
        load_task_spec(task_file(tmp_path, "  max_model_len: 512\n"))
    )
    assert tuned.identity() == base.identity()
    quantized = VLLMEngine(vllm_args={"quantization": "fp8"}).settings(
        load_task_spec(task_file(tmp_path, "  max_model_len: 512\n"))
    )
    assert quantized.identity()["vllm_args"] == {"quantization": "fp8"}


def test_data_parallel_size_is_checked_against_the_visible_gpus() -> None:
    assert resolve_data_parallel_size("auto", tensor_parallel_size=2, gpus=8) == 4
    assert resolve_data_parallel_size("auto", tensor_parallel_size=1, gpus=0) == 1  # a CPU: one replica
    assert resolve_data_parallel_size(2, tensor_parallel_size=2, gpus=4) == 2
    with pytest.raises(EngineStartError, match=r"needs 8 GPUs but 4 are visible .* lower `data_parallel_size`"):
        resolve_data_parallel_size(4, tensor_parallel_size=2, gpus=4)


def test_data_parallel_size_must_be_positive_or_auto(tmp_path: Path) -> None:
    assert load_task_spec(task_file(tmp_path, "  data_parallel_size: auto\n")).engine.data_parallel_size == "auto"
    with pytest.raises(TaskSpecError, match="data_parallel_size"):
        load_task_spec(task_file(tmp_path, "  data_parallel_size: 0\n", name="zero"))
    with pytest.raises(TaskSpecError, match="data_parallel_size"):
        load_task_spec(task_file(tmp_path, "  data_parallel_size: all\n", name="words"))


def test_shipped_tasks_load_with_their_engine_settings() -> None:
    for task in load_task_specs():
        settings = VLLMEngine().settings(task)
        assert settings.max_model_len == task.engine.max_model_len and settings.data_parallel_size == 1


# On a GPU: CUDA graphs, vLLM's offline budgets for the device (none set here), the KV cache by
# gpu_memory_utilization.
GPU_DEFAULTS = {
    "enforce_eager": False,
    "max_num_seqs": None,
    "max_num_batched_tokens": None,
    "enable_chunked_prefill": None,
    "kv_cache_memory_bytes": None,
}


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        # A CPU: today's values. Eager mode, 256 sequences, a fixed KV cache, no chunked prefill.
        (
            0,
            {
                "enforce_eager": True,
                "max_num_seqs": 256,
                "max_num_batched_tokens": 8192,
                "enable_chunked_prefill": False,
                "kv_cache_memory_bytes": 2 << 30,
                "data_parallel_size": None,
            },
        ),
        # One GPU: one replica. Eight: one replica per GPU (`data_parallel_size: auto` is the default).
        (1, {**GPU_DEFAULTS, "data_parallel_size": None}),
        (8, {**GPU_DEFAULTS, "data_parallel_size": 8}),
    ],
)
def test_engine_defaults_follow_the_device(tmp_path: Path, gpus: int, expected: dict) -> None:
    task = load_task_spec(task_file(tmp_path, "  max_model_len: 1024\n"))
    assert task.engine.data_parallel_size == "auto"
    settings = VLLMEngine().settings(task, gpus=gpus)
    args = settings.engine_args()
    assert {name: args.get(name) for name in expected} == expected
    assert args["enable_prefix_caching"] is True and args["gpu_memory_utilization"] == 0.9
    assert settings.on_gpu is bool(gpus)
    # Requests in flight: two engine batches per replica (vLLM picks up to 1024 sequences on a GPU).
    assert settings.max_num_seqs == (256 if gpus == 0 else 1024)


def test_a_task_can_still_set_every_device_default(tmp_path: Path) -> None:
    task = load_task_spec(
        task_file(
            tmp_path,
            "  tensor_parallel_size: 2\n  data_parallel_size: 1\n"
            "  vllm_args:\n    enforce_eager: true\n    max_num_seqs: 512\n    max_num_batched_tokens: 32768\n",
        )
    )
    args = VLLMEngine().settings(task, gpus=8).engine_args()
    assert (args["enforce_eager"], args["max_num_seqs"], args["max_num_batched_tokens"]) == (True, 512, 32768)
    assert "data_parallel_size" not in args and args["tensor_parallel_size"] == 2
    # `auto` with two GPUs per replica: four replicas on eight GPUs.
    auto = load_task_spec(task_file(tmp_path, "  tensor_parallel_size: 2\n", name="auto"))
    assert VLLMEngine().settings(auto, gpus=8).data_parallel_size == 4


def test_the_fingerprint_of_a_cpu_task_does_not_change_with_device_defaults(tmp_path: Path) -> None:
    """Checkpoints and caches made before the device defaults stay valid on a CPU: the identity holds
    only what decides outputs."""
    task = load_task_spec(task_file(tmp_path, "  max_model_len: 1024\n"))
    assert VLLMEngine().settings(task, gpus=0).identity() == VLLMEngine().settings(task, gpus=1).identity()


class _WarmEngine:
    """Stands for a started engine in the process's slot: only whether it was shut down matters here."""

    dead = False

    def __init__(self) -> None:
        self.shut_down = False
        self.figures = EngineFigures()  # what a session reads of its engine's own figures

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_gpu_holds_one_warm_engine_a_cpu_one_of_each_runner(tmp_path: Path, gpus: int) -> None:
    """Chat and embedding engines each take `gpu_memory_utilization` of a GPU: starting one shuts
    the other down there; on a CPU both stay warm."""
    from batch_assets.engines.vllm_lifecycle import POOLING_ENGINE, PROCESS_ENGINE, process_engine_for

    settings = VLLMEngine().settings(load_task_spec(task_file(tmp_path, "  max_model_len: 1024\n")), gpus=gpus)
    assert settings.runner == "generate"
    warm = _WarmEngine()
    POOLING_ENGINE._engine = warm  # type: ignore[assignment]
    try:
        assert process_engine_for(settings) is PROCESS_ENGINE
        assert warm.shut_down is bool(gpus)
        assert POOLING_ENGINE.running is not bool(gpus)
    finally:
        POOLING_ENGINE._engine = None


class _StreamingEngine:
    """Stands for a started engine: answers every prompt, and records the thread that shut it down."""

    dead = False

    def __init__(self, settings: object, shutdown_seconds: float = 0.0) -> None:
        self.settings = settings
        self.shut_down_on: str | None = None
        self.shutdown_seconds = shutdown_seconds
        self.stopped = False
        self.figures = EngineFigures()  # what a session reads of its engine's own figures

    def stream(
        self, prompts: Iterable[Prompt], params_for: object, lora_request: object = None
    ) -> Iterator[tuple[int, Generation]]:
        for position, prompt in enumerate(prompts):
            yield position, Generation("yes", "stop", len(prompt), 1)

    def shutdown(self) -> None:
        self.shut_down_on = threading.current_thread().name
        time.sleep(self.shutdown_seconds)  # vLLM waits for its processes to exit
        self.stopped = True


@pytest.mark.parametrize("wanted_later", [False, True])
def test_the_engine_of_a_blocks_last_stream_shuts_down_in_the_background_as_the_stream_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wanted_later: bool
) -> None:
    """`batch-assets run`'s last range of files: its engine starts shutting down on a thread of its own
    the moment its stream has ended (the run stores, validates and checks meanwhile) and the block's
    end waits for it; a stream closed early, or a block that wants the engine later, keeps it warm."""
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE, keep_engine_warm

    task = load_task_spec(task_file(tmp_path, "  max_model_len: 1024\n"))
    engine = VLLMEngine()
    settings = engine.settings(task)
    warm = _StreamingEngine(settings)
    # As at the top level of a process (the test session keeps a block of its own around every test).
    monkeypatch.setattr(PROCESS_ENGINE, "wanted_later", lambda: False)
    monkeypatch.setattr(PROCESS_ENGINE, "_engine", warm)
    try:
        with (
            keep_engine_warm(wanted_later=lambda: wanted_later),
            engine.session(task, engine.settings(task)) as session,
        ):
            early = session.stream([Prompt((1, 2)), Prompt((3,))])
            next(early)
            early.close()
            assert PROCESS_ENGINE.running
            assert [position for position, _ in session.stream([Prompt((1, 2)), Prompt((3,))])] == [0, 1]
            assert PROCESS_ENGINE.running is wanted_later
        PROCESS_ENGINE.shutdown()  # what the outermost block's end does: waits for a shutdown under way
        assert warm.shut_down_on == ("MainThread" if wanted_later else "vllm-engine-shutdown")
    finally:
        PROCESS_ENGINE._engine = None


def test_on_a_gpu_the_step_frees_the_pool_slot_only_once_its_background_shutdown_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stopping engine still holds the device: a run that gets the slot next must find it free."""
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE, keep_engine_warm

    task = load_task_spec(task_file(tmp_path, "  max_model_len: 1024\n"))
    engine = VLLMEngine()
    on_gpu = dataclasses.replace(engine.settings(task), on_gpu=True)
    warm = _StreamingEngine(on_gpu, shutdown_seconds=0.5)
    monkeypatch.setattr(PROCESS_ENGINE, "wanted_later", lambda: False)
    monkeypatch.setattr(PROCESS_ENGINE, "_engine", warm)
    try:
        with keep_engine_warm(wanted_later=lambda: False):
            with engine.session(task, on_gpu) as session:
                assert len(list(session.stream([Prompt((1, 2))]))) == 1
            # The step's session has ended (its pool slot is freed next): the engine is gone.
            assert warm.stopped and warm.shut_down_on == "vllm-engine-shutdown"
    finally:
        PROCESS_ENGINE._engine = None


def test_an_embedding_task_on_an_endpoint_takes_the_embedding_models_limit_and_tokenizer(tmp_path: Path) -> None:
    from batch_assets.engines.embedded_model import embedding_model_dir
    from batch_assets.engines.openai_engine import OpenAIEngine

    path = tmp_path / "vectors.yaml"
    path.write_text(
        "input: {text_fields: [text]}\nprompt: {template: '{text}'}\noutput: {kind: embedding}\n"
        "engine: {kind: openai, base_url: 'http://127.0.0.1:9/v1', model: minilm}\n"
    )
    settings = OpenAIEngine().settings(load_task_spec(path))
    # No tokenizer named and the served model is no local folder: the embedded embedding model's, and
    # its limit (256 tokens), not the chat default of 2048.
    assert settings.tokenizer == str(embedding_model_dir())
    assert (settings.model, settings.max_model_len) == ("minilm", 256)
    path.write_text(path.read_text().replace("model: minilm}", "model: minilm, max_model_len: 128}"))
    assert OpenAIEngine().settings(load_task_spec(path)).max_model_len == 128


def test_embedding_texts_are_grouped_into_requests_that_fill_the_concurrency() -> None:
    from batch_assets.engines.endpoint_requests import EmbeddingRequest, embedding_requests

    # 10 texts, 4 requests in flight: 3 texts a request; the two cut to the 256-token limit go apart,
    # with the length the server is to cut them to.
    lengths = [5, 6, 256, 7, 8, 9, 256, 10, 11, 12]
    assert embedding_requests(lengths, concurrency=4, max_model_len=256) == [
        EmbeddingRequest((0, 1, 3)),
        EmbeddingRequest((4, 5, 7)),
        EmbeddingRequest((8, 9)),
        EmbeddingRequest((2, 6), 256),
    ]
    assert embedding_requests([5] * 1000, concurrency=2, max_model_len=256, most=64)[0].positions == tuple(range(64))
    assert embedding_requests([], concurrency=2, max_model_len=256) == []


def test_an_embeddings_response_is_read_in_input_order_and_a_short_one_is_refused() -> None:
    from types import SimpleNamespace

    from batch_assets.engines.endpoint_requests import response_vectors

    def response(*entries: tuple[int, object]) -> SimpleNamespace:
        return SimpleNamespace(data=[SimpleNamespace(index=i, embedding=v) for i, v in entries])

    assert response_vectors(response((1, [0.0, 1.0]), (0, [1.0, 0.0])), 2) == [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(ValueError, match="not 0..2"):
        response_vectors(response((0, [1.0]), (1, [1.0])), 3)
    with pytest.raises(ValueError, match="not a list of numbers"):
        response_vectors(response((0, "AAAAAA==")), 1)


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_warm_engine_serves_tasks_of_its_model_with_a_shorter_context_only(tmp_path: Path, gpus: int) -> None:
    def settings(engine: str, name: str):
        return VLLMEngine().settings(load_task_spec(task_file(tmp_path, engine, name)), gpus=gpus)

    long, short = settings("  max_model_len: 2048\n", "long"), settings("  max_model_len: 1024\n", "short")
    assert long.serves(short) and long.serves(long) and not short.serves(long)
    other_dtype = settings("  max_model_len: 1024\n  vllm_args: {dtype: float32}\n", "dtype")
    other_model = settings("  max_model_len: 1024\n  model: /models/other\n", "model")
    assert not long.serves(other_dtype) and not long.serves(other_model)


def test_the_demo_starts_one_engine_per_model_of_the_shipped_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the demo's order, the first task of each model has the longest context, so its engine
    serves the rest (the shipped chat tasks ask for 1024 and 2048 tokens)."""
    from batch_assets.app.runner import _engine_order
    from batch_assets.engines import vllm_lifecycle
    from batch_assets.lib.task_definitions import build_definitions

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    started: list[tuple[str, int]] = []

    def start(settings: VLLMSettings, requests: int = 0) -> _WarmEngine:
        started.append((settings.runner, settings.max_model_len))
        engine = _WarmEngine()
        engine.settings, engine.dead = settings, False  # type: ignore[attr-defined]
        return engine

    monkeypatch.setattr(vllm_lifecycle, "start_engine", start)
    tasks, definitions = load_task_specs(), build_definitions()
    assert {task.engine.max_model_len for task in tasks if not task.output.pooling} == {1024, 2048}
    try:
        for task in sorted(tasks, key=lambda task: _engine_order(task, definitions)):
            settings = VLLMEngine().settings(task, gpus=0)
            vllm_lifecycle.process_engine_for(settings).get(settings)
    finally:
        for engine in vllm_lifecycle.PROCESS_ENGINES.values():
            engine._engine = None
    assert started == [("generate", 2048), ("pooling", 256)]


def test_a_session_starts_its_engine_for_the_streams_size_and_a_warm_one_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request count run_inference hands `start` reaches the engine's start (where it decides
    whether the sampler compiles); a warm engine serves the next, larger stream as it is."""
    from batch_assets.engines import vllm_lifecycle

    started: list[int] = []

    def start(settings: VLLMSettings, requests: int = 0) -> _WarmEngine:
        started.append(requests)
        engine = _WarmEngine()
        engine.settings, engine.dead = settings, False  # type: ignore[attr-defined]
        return engine

    monkeypatch.setattr(vllm_lifecycle, "start_engine", start)
    task = load_task_spec(task_file(tmp_path, "  max_model_len: 512\n"))
    settings = VLLMEngine().settings(task, gpus=0)
    with vllm_lifecycle.keep_engine_warm():  # as one `batch-assets run`
        with VLLMEngine().session(task, settings) as first:
            first.start(12_000)
            first.start(5)  # idempotent
        with VLLMEngine().session(task, settings) as second:
            second.start(50_000)
    assert started == [12_000] and first.started_here and not second.started_here


def test_the_demo_note_passes_over_a_task_its_engine_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task whose context the model does not take is refused when it runs (the demo runs the
    others, `_engine_order`); the note after the demo must not fail on it."""
    from batch_assets.app.runner import demo_note

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    task = next(task for task in load_task_specs() if not task.output.pooling)
    engine = task.engine.model_copy(update={"max_model_len": 10**7})
    engine.model_fields_set.add("max_model_len")
    refused = task.model_copy(update={"engine": engine})
    assert demo_note([refused]) is None and demo_note([refused, task]) is not None


def test_a_small_dev_shm_is_named_as_the_cause_with_the_flag_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`docker run` gives a container 64 MiB of /dev/shm; vLLM needs 160 MiB there. The real case runs
    in the image (test_image_run.py); here the message and the threshold, on this machine's sizes."""
    from batch_assets.engines import vllm_lifecycle

    assert vllm_lifecycle.shared_memory_shortage(str(tmp_path / "absent")) is None
    monkeypatch.setattr(vllm_lifecycle.shutil, "disk_usage", lambda _path: _Usage(64))
    shortage = vllm_lifecycle.shared_memory_shortage()
    assert shortage is not None
    assert shortage.startswith("/dev/shm has 64 MiB free and vLLM's engine needs 160 MiB there")
    assert "`docker run --shm-size=1g`" in shortage and "`medium: Memory`" in shortage
    monkeypatch.setattr(vllm_lifecycle.shutil, "disk_usage", lambda _path: _Usage(160))
    assert vllm_lifecycle.shared_memory_shortage() is None
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "32")
    assert "needs 320 MiB" in (vllm_lifecycle.shared_memory_shortage() or "")


@dataclasses.dataclass
class _Usage:
    free_mib: int

    @property
    def free(self) -> int:
        return self.free_mib << 20
