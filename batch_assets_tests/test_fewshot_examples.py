"""Few-shot examples (`prompt.examples`): refused at load when they cannot be right, rendered as
earlier chat turns (or into a raw template's `{examples}`), counted once in token estimates, and
part of the code versions and of the inference fingerprint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from transformers import AutoTokenizer

from batch_assets.engines.embedded_model import ensure_embedded_model
from batch_assets.pipeline.budget import estimate_cost
from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts, messages_for, render_prompt
from batch_assets.pipeline.prompt_tokens import SENTINELS
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError, load_task_spec
from batch_assets_tests.support import POSTS_CHOICES_TASK, task_code_versions

BASE = {
    **POSTS_CHOICES_TASK,
    # A model id, not the embedded model's folder: the fingerprint then holds no file times.
    "engine": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
}
EXAMPLES = [
    {"input": {"text": "Best purchase this year"}, "answer": "positive"},
    {"input": {"text": "Broke after a day"}, "answer": "negative"},
]


def spec(examples: list | None = None, **prompt) -> TaskSpec:
    raw = json.loads(json.dumps(BASE))
    raw["prompt"].update(prompt)
    if examples is not None:
        raw["prompt"]["examples"] = examples
    return TaskSpec.model_validate(raw)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_embedded_model())


def rows(texts: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {"row_id": range(len(texts)), "source_line": range(1, len(texts) + 1), "text": texts, "error": None},
        schema={"row_id": pl.Int64, "source_line": pl.Int64, "text": pl.String, "error": pl.String},
    )


# --- parsing and validation at load ---------------------------------------------------------------

HEAD = 'input: {text_fields: [text]}\nprompt:\n  system: Classify.\n  template: "Post: {text}"\n  examples:\n'
CHOICES = "output:\n  kind: choices\n  choices: [positive, negative]\n"
JSON_OUTPUT = (
    "output:\n  kind: json_schema\n"
    "  json_schema: {type: object, properties: {label: {type: string}}, required: [label]}\n"
)


def test_examples_load_in_order_and_become_turns() -> None:
    task = spec(EXAMPLES)
    assert [example.input for example in task.prompt.examples] == [
        {"text": "Best purchase this year"},
        {"text": "Broke after a day"},
    ]
    assert PromptFormat.of(task).examples == (
        ("Post: Best purchase this year", "positive"),
        ("Post: Broke after a day", "negative"),
    )


def test_json_answers_are_written_as_one_line_of_json_given_as_text_or_mapping() -> None:
    raw = json.loads(json.dumps(BASE))
    raw["output"] = {
        "kind": "json_schema",
        "json_schema": {"type": "object", "properties": {"label": {"type": "string"}, "n": {"type": "integer"}}},
    }
    raw["prompt"]["examples"] = [
        {"input": {"text": "a"}, "answer": {"label": "über", "n": 2}},
        {"input": {"text": "b"}, "answer": '{ "n" : 1,\n  "label": "x" }'},
    ]
    assert PromptFormat.of(TaskSpec.model_validate(raw)).examples == (
        ("Post: a", '{"label": "über", "n": 2}'),
        ("Post: b", '{"n": 1, "label": "x"}'),
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            HEAD
            + "    - input: {text: fine}\n      answer: positive\n    - input: {txt: nope}\n      answer: negative\n"
            + CHOICES,
            "prompt.examples.1.input (line 8): has no field 'text'; prompt.template uses {text}, so every example",
        ),
        (
            HEAD + "    - input: {text: fine, txt: nope}\n      answer: positive\n" + CHOICES,
            "prompt.examples.0.input.txt (line 6): not a field prompt.template uses (text): remove it or fix its name",
        ),
        (
            HEAD + "    - input: {text: ' '}\n      answer: positive\n" + CHOICES,
            "prompt.examples.0.input.text (line 6): is empty; an example needs the text a row would have",
        ),
        (
            HEAD + "    - text: fine\n      answer: positive\n" + CHOICES,
            "prompt.examples.0.text (line 6): put the example's fields under `input:` and its expected answer under",
        ),
        (
            HEAD + "    - input: {text: fine}\n" + CHOICES,
            "prompt.examples.0.answer (line 6): Field required",
        ),
        (
            HEAD + "    - input: {text: fine}\n      answer: Positive\n" + CHOICES,
            "prompt.examples.0.answer (line 7): 'Positive' is not one of output.choices (line 10) ['positive', 'neg",
        ),
        (
            HEAD + "    - input: {text: fine}\n      answer: ab-1\noutput:\n  kind: regex\n  regex: '[A-Z]+-[0-9]+'\n",
            "prompt.examples.0.answer (line 7): 'ab-1' does not match output.regex (line 10) '[A-Z]+-[0-9]+'",
        ),
        (
            HEAD + "    - input: {text: fine}\n      answer: 12\noutput:\n  kind: regex\n  regex: '[0-9]+'\n",
            "prompt.examples.0.answer (line 7): must be text, not int (quote it in the YAML)",
        ),
        (
            HEAD + "    - input: {text: fine}\n      answer: '{\"label\": 3'\n" + JSON_OUTPUT,
            "prompt.examples.0.answer (line 7): not valid JSON (Expecting ',' delimiter at column 12)",
        ),
        (
            HEAD + "    - input: {text: fine}\n      answer: {label: 3}\n" + JSON_OUTPUT,
            "prompt.examples.0.answer (line 7): does not fit output.json_schema (line 10): at label: 3 is not of type",
        ),
        (
            HEAD + "    - input: {text: fine}\n      answer: ''\noutput: {kind: text}\n",
            "prompt.examples.0.answer (line 7): is empty; write the answer the model should give",
        ),
        (
            HEAD.replace("  examples:\n", "  raw_template: '{system} {user}'\n  examples:\n")
            + "    - input: {text: fine}\n      answer: ok\noutput: {kind: text}\n",
            "prompt.raw_template (line 5): add {examples} where prompt.examples go",
        ),
        (
            HEAD.replace("  examples:\n", "  raw_example_template: '{user} {answer}'\n") + "output: {kind: text}\n",
            "line 5: prompt.raw_example_template applies with prompt.raw_template only",
        ),
        (
            HEAD.replace("  examples:\n", "  raw_template: '{examples}{user}'\n  raw_example_template: '{user}'\n")
            + "output: {kind: text}\n",
            "prompt.raw_example_template (line 6): use {user} and {answer}, each at least once",
        ),
    ],
)
def test_bad_examples_are_refused_naming_file_key_and_line(tmp_path: Path, body: str, expected: str) -> None:
    path = tmp_path / "fewshot.yaml"
    path.write_text(body)
    with pytest.raises(TaskSpecError) as info:
        load_task_spec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)


# --- rendering ------------------------------------------------------------------------------------


def test_examples_are_earlier_turns_after_the_system_prompt_before_the_row() -> None:
    assert messages_for("Classify.", "Post: meh", [("Post: great", "positive"), ("Post: awful", "negative")]) == [
        {"role": "system", "content": "Classify."},
        {"role": "user", "content": "Post: great"},
        {"role": "assistant", "content": "positive"},
        {"role": "user", "content": "Post: awful"},
        {"role": "assistant", "content": "negative"},
        {"role": "user", "content": "Post: meh"},
    ]


def test_the_models_chat_template_renders_the_turns_in_order(tokenizer) -> None:
    fmt = PromptFormat.of(spec(EXAMPLES))
    out = format_prompts(rows(["meh"]), fmt, tokenizer, max_model_len=512, max_tokens=8, source_file="a.jsonl")
    assert out["prompt"][0] == (
        "<|im_start|>system\nClassify.<|im_end|>\n"
        "<|im_start|>user\nPost: Best purchase this year<|im_end|>\n"
        "<|im_start|>assistant\npositive<|im_end|>\n"
        "<|im_start|>user\nPost: Broke after a day<|im_end|>\n"
        "<|im_start|>assistant\nnegative<|im_end|>\n"
        "<|im_start|>user\nPost: meh<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_raw_template_gets_the_examples_through_its_placeholder(tokenizer) -> None:
    default = PromptFormat.of(spec(EXAMPLES, raw_template="{system}\n\n{examples}{user}\n"))
    assert render_prompt(default, tokenizer, "Post: meh") == (
        "Classify.\n\nPost: Best purchase this year\npositive\n\nPost: Broke after a day\nnegative\n\nPost: meh\n"
    )
    inst = PromptFormat.of(
        spec(
            EXAMPLES,
            raw_template="<s>[INST] {system}\n\n{examples}{user} [/INST]",
            raw_example_template="{user} [/INST] {answer} </s><s>[INST] ",
        )
    )
    assert render_prompt(inst, tokenizer, "Post: meh") == (
        "<s>[INST] Classify.\n\nPost: Best purchase this year [/INST] positive </s><s>[INST] "
        "Post: Broke after a day [/INST] negative </s><s>[INST] Post: meh [/INST]"
    )
    out = format_prompts(rows(["meh"]), inst, tokenizer, max_model_len=512, max_tokens=8, source_file="a.jsonl")
    assert out["prompt"][0] == render_prompt(inst, tokenizer, "Post: meh")


def test_endpoint_messages_carry_the_examples(tokenizer) -> None:
    from batch_assets.pipeline.format_prompts import PromptFormat, prompt_encoders

    task = spec(EXAMPLES)
    out = format_prompts(
        rows(["meh"]), PromptFormat.of(task), tokenizer, max_model_len=512, max_tokens=8, source_file="a"
    )
    [prompt] = prompt_encoders(SimpleNamespace(sends_chat_messages=True), PromptFormat.of(task), tokenizer)(out)(
        out["prompt"].to_list()
    )
    assert [message["role"] for message in prompt.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert prompt.messages[-1]["content"] == "Post: meh"
    assert len(prompt.token_ids) == out["num_prompt_tokens"][0]


def test_special_token_text_in_an_example_is_refused(tokenizer) -> None:
    fmt = PromptFormat.of(spec([{"input": {"text": "hi <|im_end|>"}, "answer": "positive"}]))
    with pytest.raises(ValueError, match=r"prompt.examples.0 contains the model's special token '<\|im_end\|>'"):
        format_prompts(rows(["meh"]), fmt, tokenizer, max_model_len=512, max_tokens=8, source_file="a")


# --- token counts and the budget ------------------------------------------------------------------


class CountingTokenizer:
    """The embedded tokenizer, recording every text it is asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.texts: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    @property
    def backend_tokenizer(self):  # none: every text goes through __call__, where it is recorded
        return None

    def __call__(self, texts, **kwargs):
        self.texts += [texts] if isinstance(texts, str) else list(texts)
        return self._tokenizer(texts, **kwargs)


def test_each_prompt_counts_the_examples_measured_once(tokenizer) -> None:
    texts = ["meh", "not bad at all", "meh"]
    plain = format_prompts(
        rows(texts), PromptFormat.of(spec()), tokenizer, max_model_len=512, max_tokens=8, source_file="a"
    )
    counting = CountingTokenizer(tokenizer)
    fewshot = format_prompts(
        rows(texts), PromptFormat.of(spec(EXAMPLES)), counting, max_model_len=512, max_tokens=8, source_file="a"
    )
    # The two example turns are 37 tokens of every prompt, and the counts are the engine's.
    assert plain["num_prompt_tokens"].to_list() == [21, 23, 21]
    assert fewshot["num_prompt_tokens"].to_list() == [58, 60, 58]
    assert fewshot["num_prompt_tokens"].to_list() == [
        len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in fewshot["prompt"]
    ]
    # Measured once: the example text is in the fixed prefix, tokenized once, and in the whole prompts
    # of the check that splicing is exact (its sample and sentinels: never every row of a big file),
    # and once more by the encoder of a sentinel's special-token text.
    check = len(set(texts)) + len(SENTINELS) + 2
    assert sum("Broke after a day" in text for text in counting.texts) == 1 + check + 1
    # The rows' messages are tokenized alone, each distinct one once, outside the check.
    assert counting.texts.count("Post: not bad at all") == 2
    # The budget estimate adds them up per row: 3 rows x 37 more tokens.
    task = spec(EXAMPLES)
    assert (
        estimate_cost(fewshot, task_format(task)).prompt_tokens
        == estimate_cost(plain, task_format(task)).prompt_tokens + 3 * 37
        == 176
    )


def test_a_row_too_long_with_the_examples_says_how_much_they_take(tokenizer) -> None:
    fmt = PromptFormat.of(spec(EXAMPLES))
    out = format_prompts(rows(["meh"]), fmt, tokenizer, max_model_len=65, max_tokens=8, source_file="a.jsonl")
    assert out["error"][0] == (
        "prompt_too_long: a.jsonl line 1: 58 prompt tokens + 8 max_tokens exceed max_model_len 65 "
        "(2 prompt.examples take 37 tokens of every prompt)"
    )


# --- code versions and the inference fingerprint --------------------------------------------------


def test_examples_change_the_code_versions_and_a_task_without_them_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    # The versions this task had before examples existed: partitions made then are not stale now.
    assert task_code_versions(spec()) == {
        "formatted_prompts": "d6fc0e4d57076cf6",
        "inference_outputs": "89e477e57753ec7f",
        "validated_labels": "255cb19b0cd6bdb1",
    }
    assert task_code_versions(spec([])) == task_code_versions(spec())
    with_examples = task_code_versions(spec(EXAMPLES))
    assert with_examples == {
        "formatted_prompts": "f138cc90b5bc8ed6",
        "inference_outputs": "fedd01beebd815ac",
        "validated_labels": "c129e77b950a7734",
    }
    # Another answer, or the same examples in another order, is another version.
    changed = [EXAMPLES[0], {**EXAMPLES[1], "answer": "neutral"}]
    assert task_code_versions(spec(changed))["formatted_prompts"] != with_examples["formatted_prompts"]
    assert task_code_versions(spec(EXAMPLES[::-1]))["inference_outputs"] != with_examples["inference_outputs"]


def test_examples_change_the_fingerprint_of_checkpoints_and_cached_results(monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.lib.assets import inference_fingerprint
    from batch_assets.pipeline.task_formats import task_format

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    settings = VLLMEngine().settings(spec())
    # Unchanged without examples: results cached before examples existed are still found.
    assert inference_fingerprint(task_format(spec()), settings) == "810609a07e801e9e"
    assert inference_fingerprint(task_format(spec(EXAMPLES)), settings) == "897b8249d7889c96"
    # Another answer is another fingerprint (how turns are laid out in the text is in each request's key).
    changed = [EXAMPLES[0], {**EXAMPLES[1], "answer": "neutral"}]
    assert inference_fingerprint(task_format(spec(changed)), settings) not in ("810609a07e801e9e", "897b8249d7889c96")


# --- the measured variant of the industry task ----------------------------------------------------


def test_industry_fewshot_is_the_industry_task_plus_examples_none_from_the_sample() -> None:
    from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR

    repo = BUNDLED_TASKS_DIR.parent.parent
    fewshot = load_task_spec(repo / "examples" / "tasks" / "industry_fewshot.yaml")
    industry = load_task_spec(BUNDLED_TASKS_DIR / "industry.yaml")
    assert fewshot.prompt.model_dump(exclude={"examples"}) == industry.prompt.model_dump(exclude={"examples"})
    assert (fewshot.engine, fewshot.sampling, fewshot.output) == (industry.engine, industry.sampling, industry.output)
    # One per industry, so the comparison in the README is not one label's examples against none.
    assert sorted(example.answer for example in fewshot.prompt.examples) == sorted(industry.output.choices)
    sample = pl.read_csv(repo / "batch_assets" / "samples" / "industry" / "customers-sample.csv")
    assert not {example.input["Company"] for example in fewshot.prompt.examples} & set(sample["Company"])
