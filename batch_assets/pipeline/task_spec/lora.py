"""`engine.lora`: a LoRA adapter a task runs on top of its base model, read without loading it.

An adapter is a folder in PEFT's format (`adapter_config.json` beside `adapter_model.safetensors`
or `.bin`) or a Hugging Face id. A local folder is checked when the task loads: it exists, its
config names a base model that matches the task's model, and its rank is one vLLM can serve. Its
identity is a hash of its weights and of its config (less the base model's path), not of where it
lies: the code versions and the result cache's fingerprint read it, so changed weights make the
partitions stale and never reuse the old answers, while the same adapter copied to another folder
keeps them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from .base import SettingError, _Strict

ADAPTER_CONFIG = "adapter_config.json"
# The most of adapter_config.json read: PEFT's configs are a few KB (a `rank_pattern` over every
# module of a large model, some hundred KB).
MAX_ADAPTER_CONFIG_BYTES = 16 << 20
# The files that hold an adapter's weights in PEFT's format (the first found is the one vLLM loads).
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
# The ranks vLLM's engine takes for `max_lora_rank` (vllm/config/lora.py `MaxLoRARanks`); an adapter
# of a rank between two is served by the next one up (its weights are padded).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's own default `max_lora_rank`: adapters of this rank or less share one engine whatever their
# own rank (8 and 16 are the common ones), so two tasks' adapters rarely need two engine starts.
DEFAULT_MAX_LORA_RANK = 16
HF_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A name the adapter is served under: what an endpoint's `model` field carries.
ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][\w.:/-]{0,127}$")


class LoraSpec(_Strict):
    """`engine.lora`: the adapter's folder (or Hugging Face id) and the name it is served under.

    For `kind: vllm` the folder is loaded by the in-process engine. For an endpoint (`kind: openai`,
    `batch_api`) the server holds the adapter (`vllm serve --lora-modules NAME=FOLDER`) and `name`
    is the model name requests carry; `path`, when given, is a local copy of the same adapter that
    identifies it (without one the name alone does)."""

    path: str | None = Field(default=None, min_length=1)
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _name_is_servable(cls, name: str | None) -> str | None:
        if name is not None and not ADAPTER_NAME_PATTERN.match(name):
            raise ValueError(f"must match {ADAPTER_NAME_PATTERN.pattern} (the model name requests carry)")
        return name

    @field_validator("path")
    @classmethod
    def _folder_is_an_adapter(cls, path: str | None) -> str | None:
        if path is not None:
            folder = local_adapter_folder(path)
            if folder is not None:
                adapter_rank(read_adapter_config(folder))  # raises with the cause
        return path

    def served_name(self) -> str:
        """The name the adapter is served under: `name`, else the folder's (or id's) last part."""
        if self.name:
            return self.name
        assert self.path is not None  # the engine section refuses an adapter with neither
        return Path(self.path.rstrip("/")).name


def local_adapter_folder(path: str) -> Path | None:
    """The adapter's local folder; None for a Hugging Face id that is not a folder here. A path that
    looks like a folder (absolute, `~`, `./`) but is none is refused: a typo, not an id."""
    folder = Path(os.path.expanduser(path))
    if folder.is_dir():
        return folder
    if HF_ID_PATTERN.match(path) and not path.startswith((".", "~")):
        return _cached_hub_adapter(path)
    raise SettingError(
        f"{path}: no such folder (a LoRA adapter is a folder with {ADAPTER_CONFIG}, or a Hugging Face id)"
    )


def _cached_hub_adapter(repo_id: str) -> Path | None:
    """The hub adapter's snapshot in the local Hugging Face cache, if downloaded (never downloads:
    the task loads offline; vLLM downloads it when the engine first loads it)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, ADAPTER_CONFIG)
    return Path(found).parent if isinstance(found, str) else None


def read_adapter_config(folder: Path) -> dict[str, Any]:
    config_path = folder / ADAPTER_CONFIG
    try:
        config = json.loads(_read_regular_file(config_path, MAX_ADAPTER_CONFIG_BYTES))
    except FileNotFoundError:
        raise SettingError(f"{folder}: no {ADAPTER_CONFIG}: not a LoRA adapter in PEFT's format") from None
    except RecursionError:
        raise SettingError(
            f"{config_path}: nested more deeply than Python's JSON reader goes "
            f"({sys.getrecursionlimit()} levels); PEFT writes a flat object"
        ) from None
    except SettingError:
        raise
    except (OSError, ValueError) as exc:
        raise SettingError(f"{config_path}: cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SettingError(f"{config_path}: not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise SettingError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA")
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHT_FILES):
        raise SettingError(f"{folder}: no adapter weights ({' or '.join(ADAPTER_WEIGHT_FILES[:2])})")
    return config


def _read_regular_file(path: Path, limit: int) -> bytes:
    """The file's bytes, read only when it is a regular file: a FIFO is opened without waiting for a
    writer (a plain open would wait for good) and refused, as a device or a socket is."""
    handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(handle, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "no file"
            raise SettingError(f"{path}: {kind}, not a regular file; nothing is read from it")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise SettingError(f"{path}: larger than {limit // (1 << 20)} MiB; an adapter's config is a few settings")
    return data


def adapter_rank(config: dict[str, Any]) -> int:
    """The adapter's largest rank (`r`, or a larger one of `rank_pattern`), refused above vLLM's largest."""
    pattern = config.get("rank_pattern")
    pattern = {} if pattern is None else pattern
    if not isinstance(pattern, dict):
        raise SettingError(
            f"{ADAPTER_CONFIG}: `rank_pattern` must be a JSON object of module names and ranks, "
            f"not {_json_kind(pattern)}"
        )
    ranks = [config.get("r"), *pattern.values()]
    if not all(isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 for rank in ranks):
        raise SettingError(f"{ADAPTER_CONFIG}: `r` (the adapter's rank) must be a positive integer")
    rank = max(ranks)
    if rank > VLLM_LORA_RANKS[-1]:
        raise SettingError(f"{ADAPTER_CONFIG}: rank {rank} is above the {VLLM_LORA_RANKS[-1]} vLLM serves")
    return rank


def _json_kind(value: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def engine_lora_rank(rank: int) -> int:
    """The `max_lora_rank` an engine serving an adapter of `rank` starts with (see DEFAULT_MAX_LORA_RANK)."""
    return next(size for size in VLLM_LORA_RANKS if size >= max(rank, DEFAULT_MAX_LORA_RANK))


def base_model_problem(config: dict[str, Any], model: str) -> str | None:
    """Why an adapter trained on the config's base model cannot run on `model`, or None. They match
    when the names are equal, name the same folder, or end in the same name (a hub id and its local
    download, `embedded:SmolLM2-135M-Instruct` and `HuggingFaceTB/SmolLM2-135M-Instruct`). A config
    that names no base model is taken as it is (vLLM checks the weights' shapes at load)."""
    base = config.get("base_model_name_or_path")
    if not base:
        return None
    if _same_model(str(base), model):
        return None
    return f"the adapter was trained on {base!r}, not on the task's model {model!r}"


def _same_model(one: str, other: str) -> bool:
    if one == other:
        return True
    first, second = Path(os.path.expanduser(one)), Path(os.path.expanduser(other))
    if first.is_dir() and second.is_dir() and first.resolve() == second.resolve():
        return True

    def last_part(name: str) -> str:
        return re.split(r"[/:]", name.rstrip("/"))[-1].lower()

    return last_part(one) == last_part(other)


@dataclass(frozen=True)
class ResolvedLora:
    """The adapter a task runs, as the engines and the fingerprints need it."""

    name: str  # served under (an endpoint's `model`; vLLM's `lora_name`)
    path: str | None  # the local folder, or a hub id vLLM downloads; None: the server holds it
    identity: str  # `adapter_identity`
    rank: int | None  # None where the adapter is not here to read (a hub id not yet downloaded)

    @property
    def int_id(self) -> int:
        """vLLM's `lora_int_id`, from the identity: vLLM keeps loaded adapters by this number, so an
        adapter whose weights changed must get another one (a new load), the same adapter the same."""
        return int(hashlib.sha256(self.identity.encode()).hexdigest()[:7], 16) + 1


def resolve_lora(spec: LoraSpec) -> ResolvedLora:
    """The adapter's served name, location, identity and rank, read from its files."""
    folder = local_adapter_folder(spec.path) if spec.path is not None else None
    if folder is None:
        # A hub id not downloaded (or an endpoint's adapter known by its name alone): named, not hashed.
        identity = f"hub:{spec.path}" if spec.path else f"served:{spec.served_name()}"
        return ResolvedLora(spec.served_name(), spec.path, identity, None)
    config = read_adapter_config(folder)
    return ResolvedLora(spec.served_name(), str(folder.resolve()), adapter_identity(folder), adapter_rank(config))


def adapter_identity(folder: Path) -> str:
    """`sha256:<hex>` of the adapter's weight files and its config without the base model's path (a
    copy whose config names the base model's folder elsewhere is the same adapter). Hashed once per
    process per file state (size and modification time): an adapter is tens to hundreds of MB."""
    files = [folder / ADAPTER_CONFIG, *(folder / name for name in ADAPTER_WEIGHT_FILES if (folder / name).is_file())]
    states = tuple((str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files)
    return _hash_files(states)


@functools.lru_cache(maxsize=64)
def _hash_files(states: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path_text, _, _ in states:
        path = Path(path_text)
        digest.update(path.name.encode() + b"\0")
        if path.name == ADAPTER_CONFIG:
            config = json.loads(path.read_text(encoding="utf-8"))
            config.pop("base_model_name_or_path", None)
            digest.update(json.dumps(config, sort_keys=True).encode())
            continue
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
