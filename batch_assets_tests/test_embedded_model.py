"""The embedded SmolLM2 model: converted once from the wheel's GGUF, and run for real."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.engines import embedded_model
from batch_assets.engines.embedded_model import (
    EMBEDDED_PREFIX,
    embedded_model_dir,
    ensure_embedded_model,
    resolve_model,
)
from batch_assets_tests.support import SAMPLES, drop, failure_messages, read_output, run_partition

# The slow tier (`make test-fast` leaves it out): the embedded SmolLM2 model: its conversion and the engine.
pytestmark = pytest.mark.slow


def test_conversion_is_a_complete_safetensors_checkpoint_made_once() -> None:
    path = ensure_embedded_model()
    assert path == embedded_model_dir()
    assert (path / "model.safetensors").stat().st_size > 100_000_000
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (path / "tokenizer.json").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again


def test_conversion_writes_architectures_and_keeps_the_bos_behaviour() -> None:
    from transformers import AutoTokenizer

    path = ensure_embedded_model()
    # vLLM picks the model class from `architectures`; transformers leaves it empty for GGUF models.
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The GGUF file says no BOS token is added; the converted tokenizer must not add one either.
    assert embedded_model.gguf_adds_bos(embedded_model.gguf_path()) is False
    assert tokenizer("Post: hi")["input_ids"][0] != tokenizer.bos_token_id
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_a_folder_converted_before_architectures_is_upgraded_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(embedded_model.CACHE_ENV, str(tmp_path))
    folder = embedded_model_dir()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": None, "hidden_size": 8}))
    (folder / "batch_assets_model.json").write_text(json.dumps({"source": "old.gguf"}))
    assert ensure_embedded_model() == folder  # no conversion: the folder is complete
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["hidden_size"] == 8
    marker = json.loads((folder / "batch_assets_model.json").read_text())
    assert marker["conversion"] == embedded_model.CONVERSION_VERSION


def test_a_tokenizer_that_cannot_keep_the_bos_behaviour_is_refused() -> None:
    class AlwaysAddsBos:
        bos_token_id = 1

        def __call__(self, text):
            return {"input_ids": [1, 42]}

    tokenizer = AlwaysAddsBos()
    embedded_model._keep_bos_behaviour(tokenizer, True, Path("m.gguf"))  # already right: nothing to do
    with pytest.raises(RuntimeError, match="add_bos_token=False"):
        embedded_model._keep_bos_behaviour(tokenizer, False, Path("m.gguf"))


def test_model_names_resolve(tmp_path: Path) -> None:
    assert resolve_model(EMBEDDED_PREFIX + "SmolLM2-135M-Instruct") == str(embedded_model_dir())
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("org/some-model") == "org/some-model"
    with pytest.raises(ValueError, match="unknown embedded model"):
        resolve_model(EMBEDDED_PREFIX + "Other")


@pytest.mark.embedded_model
def test_sentiment_sample_on_the_embedded_model(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    sample = SAMPLES / "sentiment" / "posts-sample.jsonl"
    drop(data_dir, "sentiment", sample.name, sample.read_bytes())
    with dg.instance_for_test() as instance:
        key, result = run_partition("sentiment", sample.name, instance)
        assert result.success, failure_messages(result)
    formatted = read_output(data_dir, "sentiment", "formatted_prompts", key)
    labels = read_output(data_dir, "sentiment", "validated_labels", key)
    assert labels.height == formatted.height == 36
    assert labels["error"].null_count() == 36
    assert set(labels["label"].to_list()) <= {"positive", "negative", "neutral"}
    # The prompt the engine saw is exactly the one formatted_prompts counted: same template, same tokens.
    assert labels["num_prompt_tokens"].to_list() == formatted["num_prompt_tokens"].to_list()
    assert formatted["prompt"][0].startswith("<|im_start|>system\n")
    # Deterministic decoding: the one-word answer is a real word, finished by the model, not cut.
    assert (labels["finish_reason"] == "stop").all()
    assert labels.filter(pl.col("label") == "negative").height >= 1
