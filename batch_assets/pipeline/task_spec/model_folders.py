"""What a model's own files say, read without loading it: whether a local folder holds a chat or an
embedding model, and the most tokens vLLM runs it with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from .engine import EMBEDDED_EMBEDDING_MODEL, EMBEDDED_MODEL

# The embedded models' own limits (tokens), so a task's max_model_len is checked before a run without
# converting or opening them: SmolLM2's GGUF `llama.context_length`, all-MiniLM-L6-v2's
# sentence-transformers `max_seq_length` (what vLLM's pooling runner takes; tests read both files).
EMBEDDED_MODEL_LIMITS = {EMBEDDED_MODEL: 8192, EMBEDDED_EMBEDDING_MODEL: 256}
# vLLM's own switch to run a model past its trained length; with it the check at load is off too.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


# config.json keys that hold a model's trained length; vLLM takes the smallest it finds, this check the
# largest (and RoPE scaling's factor on top), so it never refuses what vLLM would start.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "model_max_length",
    "n_ctx",
)


def model_context_limit(model: str) -> int | None:
    """The most tokens vLLM runs `model` with: the embedded models' known limits, a local folder's
    sentence-transformers `max_seq_length`, else its config.json's trained length (RoPE scaling
    included); None for a model id or a folder that says none of these."""
    if model in EMBEDDED_MODEL_LIMITS:
        return EMBEDDED_MODEL_LIMITS[model]
    folder = Path(os.path.expanduser(model))
    if not folder.is_dir():
        return None
    sentence_length = _json_file(folder / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(sentence_length, int) and sentence_length > 0:
        return sentence_length
    config = _json_file(folder / "config.json")
    sections = [config, *[config[key] for key in ("text_config", "llm_config") if isinstance(config.get(key), dict)]]
    lengths = [
        value
        for section in sections
        for key in _CONTEXT_KEYS
        if isinstance(value := section.get(key), int) and not isinstance(value, bool) and value > 0
    ]
    if not lengths:
        return None
    factors = [
        factor
        for section in sections
        for key in ("rope_scaling", "rope_parameters")
        if isinstance(scaling := section.get(key), dict)
        and isinstance(factor := scaling.get("factor"), int | float)
        and factor > 1
    ]
    return int(max(lengths) * max(factors, default=1))


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when it is missing or not a JSON object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def model_folder_kind(model: str) -> Literal["chat", "embedding"] | None:
    """What a local model folder holds, from its files: `embedding` (a sentence-transformers folder:
    modules.json or sentence_bert_config.json), `chat` (a causal language model with a chat template),
    None when neither is clear (a model id, another layout): vLLM then decides."""
    import json

    folder = Path(os.path.expanduser(model))
    if not folder.is_dir():
        return None
    if (folder / "modules.json").is_file() or (folder / "sentence_bert_config.json").is_file():
        return "embedding"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        tokenizer_config = folder / "tokenizer_config.json"
        template = (folder / "chat_template.jinja").is_file() or (
            tokenizer_config.is_file() and "chat_template" in json.loads(tokenizer_config.read_text(encoding="utf-8"))
        )
    except (OSError, ValueError):
        return None
    architectures = (config.get("architectures") or []) if isinstance(config, dict) else []
    causal = any(str(name).endswith(("ForCausalLM", "ForConditionalGeneration")) for name in architectures)
    return "chat" if causal and template else None
