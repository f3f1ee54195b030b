"""The in-process engine's settings: what a warm engine is keyed by, and what it serves.

`VLLMSettings` is one task's engine on this machine, every default applied (vllm_engine.py's
`VLLMEngine.settings` makes it). An engine started with one `VLLMSettings` serves another when only
the context differs and it is at least as long, or when it has room for another task's LoRA adapter
(`VLLMSettings.serves`): tasks of one model then share a warm engine. `memory_hint` names the
settings to change when the engine does not fit, in the task YAML's words.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from batch_assets.pipeline.engine_contract import EngineStartError, ResolvedSettings
from batch_assets.pipeline.task_spec import ResolvedLora

# The KV cache on a CPU when neither the task nor the resource sizes it (`kv_cache_memory_gib`).
CPU_DEFAULT_KV_CACHE_GIB = 2.0
# Requests kept in flight per replica on a GPU are 2 × this when `max_num_seqs` is vLLM's choice: the
# largest value vLLM picks (more just wait in vLLM's queue, which costs nothing).
GPU_MAX_NUM_SEQS_BOUND = 1024


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
