"""The token ids that reach the engine are the chat template's, on every shipped task.

formatted_prompts tokenizes each prompt once (the template's fixed ids spliced around each
message's own, where a sample proves it exact: pipeline/prompt_tokens.py) with the `tokenizers`
library directly (engines/tokenizers.py); inference sends those ids. Here every task of
batch_assets/tasks and examples/tasks formats its bundled sample plus rows that stress the
message's edges, and the ids its encoder hands the engine are compared with transformers'
`apply_chat_template(tokenize=True)` (or, for embeddings, the tokenizer's own call).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from transformers import AutoTokenizer

from batch_assets.engines.embedded_model import embedded_model_dir, ensure_embedded_model, resolve_model
from batch_assets.engines.tokenizers import FastTokenizer, load_tokenizer
from batch_assets.pipeline.chat_records import ChatRecords
from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts, messages_for, special_tokens
from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
from batch_assets.pipeline.openai_batch.formats import OpenAIBatchLines
from batch_assets.pipeline.openai_batch.lines import read_batch_requests
from batch_assets.pipeline.prompt_tokens import EDGE_CHARACTERS, PROMPT_TOKEN_IDS, SENTINELS, plan_tokens, sample_of
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpec, load_task_spec

REPO = Path(__file__).resolve().parent.parent
# An image task needs a vision-language model's tokenizer: its ids are checked against vLLM's own
# (`LLM.chat`) in test_image_tasks.py.
TASK_FILES = sorted(
    [*(REPO / "batch_assets" / "tasks").glob("*.yaml"), *(REPO / "examples" / "tasks").glob("*.yaml")],
)
TASK_FILES = [path for path in TASK_FILES if path.stem != "images"]
# Texts a row may hold that stress the message's edges (the sentinels, and more).
TRICKY = [*SENTINELS, "   ", "a  ", "\r\nwindows\r\n", "user\n", ":", "<|im_end|>", "x" * 400, "Ċ\u200b zero width"]


@pytest.fixture(scope="module")
def reference_tokenizers() -> dict[str, object]:
    ensure_embedded_model()
    return {}


def reference(folder: str, cache: dict[str, object]):
    if folder not in cache:
        cache[folder] = AutoTokenizer.from_pretrained(folder)
    return cache[folder]


def sample_rows(task: TaskSpec) -> pl.DataFrame:
    """The task's bundled sample (the plain task's, for an example variant), plus tricky rows."""
    folder = REPO / "batch_assets" / "samples" / task.name
    if not folder.is_dir():
        folder = REPO / "batch_assets" / "samples" / task.name.removesuffix("_fewshot")
    [sample] = sorted(folder.iterdir())
    data = sample.read_bytes()
    fields = tuple(task.input.text_fields)
    if task.input.format == "openai_batch":
        embeds = task.output.kind == "embedding"
        url = "/v1/embeddings" if embeds else "/v1/chat/completions"
        data += b"".join(
            json.dumps(
                {
                    "custom_id": f"tricky-{index}",
                    "method": "POST",
                    "url": url,
                    "body": {"input": text} if embeds else {"messages": [{"role": "user", "content": text}]},
                }
            ).encode()
            + b"\n"
            for index, text in enumerate(TRICKY)
        )
    elif sample.suffix == ".txt":
        data += "".join(text.replace("\n", " ") + "\n" for text in TRICKY if text.strip()).encode()
    elif sample.suffix == ".jsonl":
        data += b"".join(json.dumps(dict.fromkeys(fields, text)).encode() + b"\n" for text in TRICKY)
    if task.input.format == "openai_batch":
        return read_batch_requests(data, sample.name)
    options = ParseOptions(text_fields=fields, txt_field=task.input.txt_field, format=task.input.format)
    frame = read_prompts(data, sample.name, options)
    if sample.suffix == ".csv":
        tricky = pl.DataFrame(dict.fromkeys(fields, TRICKY)).with_columns(
            row_id=pl.int_range(frame.height, frame.height + len(TRICKY), dtype=pl.Int64),
            source_line=pl.int_range(frame.height + 2, frame.height + 2 + len(TRICKY), dtype=pl.Int64),
            error=pl.lit(None, dtype=pl.String),
        )
        frame = pl.concat([frame, tricky], how="diagonal_relaxed")
    return frame


def expected_ids(task: TaskSpec, row: dict, tokenizer) -> list[int] | None:
    """transformers' ids for a row; None where it has no answer to compare with (special-token text
    in a records row, which the pipeline keeps plain text on purpose: checked apart)."""
    fmt = task_format(task)
    if isinstance(fmt, ChatRecords):
        user = task.prompt.template.format(**{field: row[field] or "" for field in task.input.text_fields})
        if any(token in user for token in special_tokens(tokenizer)):
            return None
        messages = messages_for(fmt.prompt_format.system, user, fmt.prompt_format.examples)
        return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    if isinstance(fmt, OpenAIBatchLines):
        if row["messages"] is None:
            return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        messages = json.loads(row["messages"])
        return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    # An embedding's text with the model's special tokens, cut to the context where the task says so.
    cut = {"truncation": True, "max_length": task.engine.max_model_len} if task.input.truncate else {}
    return tokenizer(row["prompt"], add_special_tokens=True, **cut)["input_ids"]


@pytest.mark.parametrize("path", TASK_FILES, ids=lambda path: path.stem)
def test_the_ids_reaching_the_engine_are_the_chat_templates(path: Path, reference_tokenizers) -> None:
    task = load_task_spec(path)
    fmt = task_format(task)
    folder = resolve_model(task.engine.model or f"embedded:{embedded_model_dir().name}")
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, FastTokenizer), "a model folder with tokenizer.json loads without transformers"
    hf = reference(folder, reference_tokenizers)
    settings = SimpleNamespace(max_model_len=task.engine.max_model_len or 256, resolved=None, model=folder)
    engine = SimpleNamespace(sends_chat_messages=False)
    formatted = fmt.format(sample_rows(task), engine, tokenizer, settings, source_file="sample")
    valid = formatted.filter(pl.col("error").is_null())
    assert valid.height >= 10
    encode = fmt.encoders(engine, tokenizer, settings.max_model_len)(formatted)
    prompts = valid["prompt"].to_list()
    sent = encode(prompts, valid["request_params"].to_list()) if "request_params" in valid.columns else encode(prompts)
    compared = 0
    for row, prompt in zip(valid.iter_rows(named=True), sent, strict=True):
        assert row["num_prompt_tokens"] == len(prompt.token_ids)
        expected = expected_ids(task, row, hf)
        if expected is None:
            # Special-token text stays text: the same text, and no more turn markers than a plain row's.
            plain = expected_ids(task, dict.fromkeys(task.input.text_fields, "x"), hf)
            assert plain is not None and hf.decode(prompt.token_ids) == row["prompt"]
            for marker in (hf.bos_token_id, hf.eos_token_id):
                assert list(prompt.token_ids).count(marker) == plain.count(marker)
            continue
        assert list(prompt.token_ids) == expected, (row.get("prompt"), prompt.token_ids, expected)
        compared += 1
    assert compared >= 10


def test_whitespace_edged_rows_and_raw_templates_fall_back_to_whole_prompts() -> None:
    """A raw template whose text around the message merges with it is tokenized whole; rows that
    start with two spaces (which byte-level BPE merges with the newline before them) are tokenized
    whole while the rest are spliced; both give transformers' ids, and the path is logged."""
    tokenizer = load_tokenizer(str(ensure_embedded_model()))
    hf = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    texts = ["plain text", "  two leading spaces", "x", "\n\nnewlines"]
    raw = pl.DataFrame(
        {"row_id": range(4), "source_line": range(1, 5), "text": texts, "error": [None] * 4},
        schema={"row_id": pl.Int64, "source_line": pl.Int64, "text": pl.String, "error": pl.String},
    )
    chat = PromptFormat("Be brief.", "{text}", None, ("text",))
    raw_template = PromptFormat("Be brief.", "{text}", "System: {system}\nUser:{user}Assistant:", ("text",))
    for fmt, expected_note in ((chat, "whitespace at an edge tokenized whole"), (raw_template, "whole prompts")):
        notes: list[str] = []
        out = format_prompts(
            raw, fmt, tokenizer, max_model_len=512, max_tokens=8, source_file="a.jsonl", log=notes.append
        )
        assert len(notes) == 1 and expected_note in notes[0], notes
        for prompt, ids in zip(out["prompt"], out[PROMPT_TOKEN_IDS], strict=True):
            assert ids.to_list() == hf(prompt, add_special_tokens=False)["input_ids"]


def test_a_row_whose_first_character_no_proven_text_has_is_proven_too() -> None:
    """The raw template puts `Q` before the message, which merges with a message starting with `u`
    (` Qu` is one token before `h`) but with none of the sentinels nor the rows starting with `r`. The only such
    row is past the first 256 rows the sample takes from a 300-row partition: each distinct first
    (and last) character is proven too, so the partition is tokenized whole and every row gets
    transformers' ids."""
    tokenizer = load_tokenizer(str(ensure_embedded_model()))
    hf = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    texts = [f"row {i}" for i in range(300)]
    texts[280] = "uh row"
    raw = pl.DataFrame(
        {"row_id": range(300), "source_line": range(1, 301), "text": texts, "error": [None] * 300},
        schema={"row_id": pl.Int64, "source_line": pl.Int64, "text": pl.String, "error": pl.String},
    )
    fmt = PromptFormat("Be brief.", "{text}", "System: {system}\nUser: Q{user}\nAssistant:", ("text",))
    notes: list[str] = []
    out = format_prompts(raw, fmt, tokenizer, max_model_len=512, max_tokens=8, source_file="a.jsonl", log=notes.append)
    for prompt, ids in zip(out["prompt"], out[PROMPT_TOKEN_IDS], strict=True):
        assert ids.to_list() == hf(prompt, add_special_tokens=False)["input_ids"], prompt
    assert len(notes) == 1 and "whole prompts tokenized" in notes[0] and "'uh row'" in notes[0], notes


def test_too_many_distinct_first_characters_tokenize_the_partition_whole() -> None:
    many = pl.Series([chr(0x4E00 + i) + " row" for i in range(EDGE_CHARACTERS + 1)])
    assert sample_of(many) is None
    plan = plan_tokens(load_tokenizer(str(ensure_embedded_model())), ("a\n", "\nb"), lambda texts: [], sample_of(many))
    assert plan.prefix is None and f"more than {EDGE_CHARACTERS} distinct first or last characters" in plan.note
    # Within the bound: the sample plus one row per first and per last character not already in it.
    rows = pl.Series(["a1", "a2", None, "b1", "a3!"])
    assert sample_of(rows, size=1) == ["a1", "b1", "a2", "a3!"]  # first a, b; last 1, 2, !


def test_a_chat_template_with_generation_blocks_renders_as_transformers_renders_it() -> None:
    """Training-ready chat templates mark the assistant's turns with `{% generation %}` blocks
    (transformers' assistant masks); rendering without transformers must accept them and render
    their body, as transformers does."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from batch_assets.engines.tokenizers import compiled_chat_template

    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}\n"
        "{% endgeneration %}{% else %}U: {{ m.content }}\n{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = _compile_jinja_template(template).render(messages=messages)
    assert compiled_chat_template(template).render(messages=messages) == expected == "U: hi\nA: yo\n"
