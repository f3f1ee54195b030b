"""Embedding tasks and similarity labels without an engine: settings refused at load (naming file, key
and line), formatting (empty, too long, truncated), vectors through the result stores, similarity
labels and their confidence with concrete values, and the embedding checks' pure functions."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from batch_assets.pipeline.embeddings.prompts import format_embedding_prompts
from batch_assets.pipeline.embeddings.results import embedding_outputs, embedding_report, validate_embeddings
from batch_assets.pipeline.embeddings.similarity import (
    SIMILARITY_SCALE,
    choice_texts,
    similarity_labels,
    similarity_outputs,
)
from batch_assets.pipeline.result_stores import decode_vector, encode_vector, vectors_column
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpecError, load_task_spec
from batch_assets.pipeline.validate_labels import validate_labels
from batch_assets_tests.support import ANSWER_COLUMNS

EMBED = """
input: {text_fields: [text]}
prompt: {template: "{text}"}
output: {kind: embedding}
"""

SIMILARITY = """
input: {text_fields: [text]}
prompt: {template: "{text}"}
output:
  kind: choices
  method: similarity
  choices: [sports, cooking]
  descriptions: {cooking: recipes and kitchens}
"""


def write(tmp_path: Path, body: str, name: str = "vectors") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(body)
    return path


# --- settings -----------------------------------------------------------------------------------


def test_embedding_and_similarity_tasks_default_to_the_embedded_embedding_model(tmp_path: Path) -> None:
    embed = load_task_spec(write(tmp_path, EMBED))
    similarity = load_task_spec(write(tmp_path, SIMILARITY, "topics"))
    assert embed.engine.model == similarity.engine.model == "embedded:all-MiniLM-L6-v2"
    assert embed.output.pooling and similarity.output.pooling
    assert choice_texts(similarity.output) == ["sports", "recipes and kitchens"]


def test_embedding_and_similarity_tasks_may_use_an_endpoint(tmp_path: Path) -> None:
    endpoint = "engine: {kind: openai, base_url: 'http://127.0.0.1:8000/v1'}\n"
    for body, name in ((EMBED, "vectors"), (SIMILARITY, "topics")):
        task = load_task_spec(write(tmp_path, body + endpoint, name))
        assert task.engine.kind == "openai" and task.output.pooling
        assert task.engine.model == "embedded:all-MiniLM-L6-v2"  # the endpoint's only model, asked for


def test_model_overrides_keep_chat_and_embedding_models_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "/models/chat")
    monkeypatch.setenv("BATCH_ASSETS_EMBEDDING_MODEL", "/models/embedder")
    from batch_assets.engines.kinds import resolve_settings

    assert resolve_settings(load_task_spec(write(tmp_path, EMBED))).model == "/models/embedder"
    chat = EMBED.replace("output: {kind: embedding}", "output: {kind: text}")
    assert resolve_settings(load_task_spec(write(tmp_path, chat, "chat"))).model == "/models/chat"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # method: similarity on a task that is not choices
        (
            "input: {text_fields: [text]}\nprompt: {template: '{text}'}\noutput:\n  kind: text\n  method: similarity\n",
            "line 5: output.method similarity labels a choices task",
        ),
        # a chat model named for an embedding task
        (
            EMBED + "engine: {model: 'embedded:SmolLM2-135M-Instruct'}\n",
            "engine.model (line 5): embedded:SmolLM2-135M-Instruct is a chat model",
        ),
        # the reverse: the embedding model for a chat task
        (
            "input: {text_fields: [text]}\nprompt: {template: '{text}'}\noutput: {kind: text}\n"
            "engine: {model: 'embedded:all-MiniLM-L6-v2'}\n",
            "is an embedding model: it writes no text",
        ),
        # a chat prompt's system message on an embedding task
        (EMBED.replace('{template: "{text}"}', '{system: "Be nice.", template: "{text}"}'), "prompt.system"),
        # few-shot examples (chat turns) on a similarity task
        (
            SIMILARITY.replace(
                '{template: "{text}"}', '{template: "{text}", examples: [{input: {text: "goal!"}, answer: sports}]}'
            ),
            "prompt.examples",
        ),
        # truncate on a chat task
        (
            "input: {text_fields: [text], truncate: true}\nprompt: {template: '{text}'}\noutput: {kind: text}\n",
            "line 1: input.truncate applies to embedding and similarity tasks",
        ),
        # descriptions of something that is not a choice, or without method: similarity
        (SIMILARITY.replace("{cooking:", "{baking:"), "output.descriptions.baking"),
        (SIMILARITY.replace("  method: similarity\n", ""), "output.descriptions is used by output.method: similarity"),
        (SIMILARITY.replace("recipes and kitchens", "' '"), "output.descriptions.cooking"),
        # similarity labels need records (an OpenAI batch file has embeddings lines, not labels)
        (
            "input: {format: openai_batch}\noutput: {kind: choices, method: similarity, choices: [a, b]}\n",
            "output.method: similarity needs input.format: records",
        ),
        # accuracy needs labels
        (EMBED + "checks: {gold_field: topic}\n", "not embeddings"),
    ],
)
def test_settings_that_do_not_fit_embeddings_are_refused_at_load(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(TaskSpecError) as refused:
        load_task_spec(path)
    assert str(path) in str(refused.value)
    assert expected in str(refused.value)


def test_new_settings_leave_the_code_versions_of_existing_tasks_alone(tmp_path: Path) -> None:
    from batch_assets.engines.kinds import resolve_settings
    from batch_assets.pipeline.code_versions import code_versions as versions_with

    def code_versions(task):
        return versions_with(task, resolve_settings(task))

    chat = "input: {text_fields: [text]}\nprompt: {template: '{text}'}\noutput: {kind: choices, choices: [a, b]}\n"
    before = code_versions(load_task_spec(write(tmp_path, chat, "a")))
    explicit = chat.replace("[a, b]}", "[a, b], method: generate}").replace("[text]}", "[text], truncate: false}")
    assert code_versions(load_task_spec(write(tmp_path, explicit, "b"))) == before
    embed = code_versions(load_task_spec(write(tmp_path, EMBED, "c")))
    truncated = code_versions(load_task_spec(write(tmp_path, EMBED.replace("[text]}", "[text], truncate: true}"), "d")))
    assert embed["formatted_prompts"] != truncated["formatted_prompts"]


# --- formatting ---------------------------------------------------------------------------------


class WordTokenizer:
    """One token a word, plus [CLS] and [SEP]; truncation keeps both, as BERT's tokenizer does."""

    def __call__(self, texts, add_special_tokens=True, truncation=False, max_length=None):
        single = isinstance(texts, str)
        ids = [self._ids(text, add_special_tokens, truncation, max_length) for text in ([texts] if single else texts)]
        return {"input_ids": ids[0] if single else ids}

    @staticmethod
    def _ids(text: str, specials: bool, truncation: bool, max_length: int | None) -> list[int]:
        words = [len(word) + 1000 for word in text.split()]
        if truncation and max_length is not None:
            words = words[: max_length - (2 if specials else 0)]
        return [101, *words, 102] if specials else words


def raw_rows(texts: list[str | None]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "row_id": list(range(len(texts))),
            "source_line": [i + 1 for i in range(len(texts))],
            "text": pl.Series(texts, dtype=pl.String),
            "error": pl.Series([None] * len(texts), dtype=pl.String),
        }
    )


def test_empty_and_too_long_texts_are_error_rows_naming_file_line_and_setting() -> None:
    raw = raw_rows(["two words", "  ", "one two three four five six"])
    formatted = format_embedding_prompts(
        raw, "{text}", ["text"], WordTokenizer(), max_model_len=6, truncate=False, source_file="posts.jsonl"
    )
    assert formatted["num_prompt_tokens"].to_list() == [4, None, 8]
    assert formatted["prompt"].to_list() == ["two words", None, None]
    errors = formatted["error"].to_list()
    assert errors[0] is None
    assert errors[1] == "empty_text: posts.jsonl line 2: the text is empty"
    assert errors[2].startswith("input_too_long: posts.jsonl line 3: 8 tokens exceed the model's limit of 6")
    assert "input.truncate: true" in errors[2]
    assert "truncated" not in formatted.columns


def test_truncate_cuts_too_long_texts_and_says_so() -> None:
    raw = raw_rows(["two words", "one two three four five six", ""])
    formatted = format_embedding_prompts(
        raw, "{text}", ["text"], WordTokenizer(), max_model_len=6, truncate=True, source_file="posts.jsonl"
    )
    assert formatted["truncated"].to_list() == [False, True, None]
    assert formatted["num_prompt_tokens"].to_list()[:2] == [4, 6]
    assert formatted["error"].to_list()[:2] == [None, None]
    assert formatted["error"][2].startswith("empty_text")


def test_texts_the_tokenizer_reads_as_mostly_unknown_tokens_are_marked_counted_and_logged() -> None:
    """all-MiniLM-L6-v2 reads a word over 100 characters, or emoji, as one [UNK]: a vector that says
    nothing about the text. Such rows are embedded, but marked, counted and named with their lines."""
    from batch_assets.engines.embedded_model import embedding_model_dir
    from batch_assets.engines.tokenizers import load_tokenizer
    from batch_assets.pipeline.embeddings.prompts import unknown_token_rows, unknown_token_warning
    from batch_assets.pipeline.task_spec import OutputSpec
    from batch_assets.pipeline.validate_labels import UNKNOWN_TOKENS_COLUMN

    tokenizer = load_tokenizer(str(embedding_model_dir()))
    word = "x" * 101
    texts = [word, f"hello {word}", f"hello world {word}", "\U0001f600\U0001f600", "a plain sentence", "  "]
    formatted = format_embedding_prompts(
        raw_rows(texts), "{text}", ["text"], tokenizer, max_model_len=256, truncate=False, source_file="posts.jsonl"
    )
    # [CLS] [UNK] [SEP]: one token of one; 1 of 2 is half; 1 of 3 is not; the empty text is an error row.
    assert formatted["num_prompt_tokens"].to_list() == [3, 4, 5, 3, 5, None]
    assert formatted[UNKNOWN_TOKENS_COLUMN].to_list() == [True, True, False, True, False, None]
    assert formatted["error"].to_list()[:5] == [None] * 5
    assert unknown_token_rows(formatted) == 3
    assert unknown_token_warning(formatted, "posts.jsonl") == (
        "posts.jsonl: 3 row(s) are mostly the tokenizer's unknown token (at least 50% of their tokens; line 1, 2, 4): "
        "their embeddings say little about their text (a word over 100 characters, emoji, a script missing from "
        "the model's vocabulary). They are embedded anyway; formatted_prompts counts them in unknown_token_rows"
    )
    # The mark stays out of the result table, whose columns are fixed.
    results = formatted.with_columns(
        generated_text=pl.lit(encode_vector([0.6, 0.8])),
        finish_reason=pl.lit(None, dtype=pl.String),
        num_generated_tokens=pl.lit(0),
        cumulative_logprob=pl.lit(None, dtype=pl.Float64),
    )
    labels = validate_embeddings(embedding_outputs(results))
    assert labels.columns == ["row_id", "source_line", "text", "embedding", "num_prompt_tokens", "error"]
    output = OutputSpec(kind="choices", method="similarity", choices=["a", "b"])
    similar = validate_labels(similarity_outputs(results, np.array([[1.0, 0.0], [0.0, 1.0]]), ["a", "b"]), output)
    assert UNKNOWN_TOKENS_COLUMN not in similar.columns and similar.columns[:3] == ["row_id", "source_line", "text"]


def test_a_tokenizer_without_an_unknown_token_marks_nothing() -> None:
    from batch_assets.pipeline.embeddings.prompts import unknown_token_rows, unknown_token_warning

    formatted = format_embedding_prompts(
        raw_rows(["two words", "x" * 101]),
        "{text}",
        ["text"],
        WordTokenizer(),
        max_model_len=6,
        truncate=False,
        source_file="posts.jsonl",
    )
    assert formatted["mostly_unknown_tokens"].to_list() == [None, None]
    assert unknown_token_rows(formatted) == 0 and unknown_token_warning(formatted, "posts.jsonl") is None


class EndOfTextTokenizer(WordTokenizer):
    """GPT-2-like: its unknown, start and end token are one id, which it adds to every text."""

    unk_token_id = bos_token_id = eos_token_id = 101


def test_a_tokenizer_whose_unknown_token_is_also_the_one_it_adds_marks_nothing() -> None:
    """Before, every short text of such a tokenizer counted its own added token as unknown."""
    formatted = format_embedding_prompts(
        raw_rows(["hi"]), "{text}", ["text"], EndOfTextTokenizer(), max_model_len=6, truncate=False, source_file="p"
    )
    assert formatted["mostly_unknown_tokens"].to_list() == [None]


# --- vectors and results ------------------------------------------------------------------------


def test_vectors_survive_the_result_stores_exactly() -> None:
    vector = np.array([0.6, -0.8, 1e-7, 3.5], dtype=np.float32)
    assert np.array_equal(decode_vector(encode_vector(vector)), vector)
    column = vectors_column(pl.Series([encode_vector(vector), None], dtype=pl.String))
    assert column.dtype == pl.Array(pl.Float32, 4)
    assert column[1] is None


def results_frame(vectors: list[list[float] | None], errors: list[str | None] | None = None) -> pl.DataFrame:
    n = len(vectors)
    return pl.DataFrame(
        {
            "row_id": list(range(n)),
            "source_line": [i + 1 for i in range(n)],
            "text": [f"t{i}" for i in range(n)],
            "prompt": [f"t{i}" for i in range(n)],
            "generated_text": pl.Series([None if v is None else encode_vector(v) for v in vectors], dtype=pl.String),
            "finish_reason": pl.Series([None] * n, dtype=pl.String),
            "num_prompt_tokens": [3] * n,
            "num_generated_tokens": [0] * n,
            "error": pl.Series(errors or [None] * n, dtype=pl.String),
            "cumulative_logprob": pl.Series([None] * n, dtype=pl.Float64),
        }
    )


def test_validated_embeddings_keep_inputs_and_give_fixed_size_float32_vectors() -> None:
    frame = results_frame([[0.6, 0.8], None], [None, "input_too_long: x"])
    labels = validate_embeddings(embedding_outputs(frame))
    assert labels.columns == ["row_id", "source_line", "text", "embedding", "num_prompt_tokens", "error"]
    assert labels.schema["embedding"] == pl.Array(pl.Float32, 2)
    assert labels["embedding"][0].to_list() == pytest.approx([0.6, 0.8])
    assert labels["error"].to_list() == [None, "input_too_long: x"]


def test_the_tokens_of_a_text_never_embedded_are_not_counted(tmp_path: Path) -> None:
    """Issue 56.6: validated_labels' `prompt_tokens` counts what was embedded, not a text refused as too long."""
    fmt = task_format(load_task_spec(write(tmp_path, EMBED)))
    frame = results_frame([[0.6, 0.8], None], [None, "input_too_long: x"]).with_columns(
        num_prompt_tokens=pl.Series([3, 900])
    )
    assert fmt.label_metadata(fmt.validate(embedding_outputs(frame)))["prompt_tokens"] == 3


def test_a_row_without_embedding_or_error_gets_an_error() -> None:
    frame = results_frame([[1.0, 0.0], None])
    labels = validate_embeddings(embedding_outputs(frame))
    assert labels["error"][1] == "no_output: the engine returned no embedding"


def test_embedding_report_finds_wrong_norms_non_finite_values_and_several_dimensions() -> None:
    good = results_frame([[0.6, 0.8], [1.0, 0.0], [0.5, 0.5], [float("nan"), 1.0], None])
    report = embedding_report(embedding_outputs(good))
    assert report.dimension == 2 and report.embedded_rows == 4
    assert report.non_finite_rows == [3]
    assert report.off_norm_rows == [2]  # |(0.5, 0.5)| = 0.7071
    assert report.norm_min == pytest.approx(math.sqrt(0.5), abs=1e-6) and report.norm_max == pytest.approx(1.0)
    assert report.metadata()["dimension"] == 2
    mixed = embedding_report(embedding_outputs(results_frame([[1.0, 0.0], [1.0, 0.0, 0.0]])))
    assert mixed.dimensions == [2, 3] and mixed.dimension is None
    assert mixed.metadata()["dimension"] == "[2, 3]"


# --- similarity labels --------------------------------------------------------------------------


def test_similarity_labels_pick_the_closest_choice_with_softmax_confidence() -> None:
    choices = np.array([[1.0, 0.0], [0.0, 1.0]])
    rows = np.array([[0.8, 0.6], [0.0, 1.0], [2.0, 2.0]])
    labels, cosine, confidence = similarity_labels(rows, choices, ["sports", "cooking"])
    assert labels == ["sports", "cooking", "sports"]  # a tie goes to the earlier choice
    assert cosine == pytest.approx([0.8, 1.0, math.sqrt(0.5)])
    # softmax of 20 × cosine: row 0 has cosines (0.8, 0.6): 1 / (1 + e^(-20 × 0.2)) = 0.98201
    assert SIMILARITY_SCALE == 20.0
    assert confidence == pytest.approx([1 / (1 + math.exp(-4.0)), 1 / (1 + math.exp(-20.0)), 0.5])
    assert confidence[0] == pytest.approx(0.982014, abs=1e-6)


def test_similarity_outputs_are_a_choices_tasks_outputs() -> None:
    from batch_assets.pipeline.task_spec import OutputSpec

    output = OutputSpec(kind="choices", method="similarity", choices=["sports", "cooking"])
    frame = results_frame([[0.8, 0.6], None, [0.1, 0.9]], [None, "empty_text: f line 2: the text is empty", None])
    outputs = similarity_outputs(frame, np.array([[1.0, 0.0], [0.0, 1.0]]), ["sports", "cooking"])
    labels = validate_labels(outputs, output)
    assert labels["label"].to_list() == ["sports", None, "cooking"]
    assert labels["similarity"].to_list()[0] == pytest.approx(0.8)
    assert labels["confidence"][0] == pytest.approx(0.982014, abs=1e-6)
    assert labels["confidence"][1] is None
    assert labels["error"].to_list() == [None, "empty_text: f line 2: the text is empty", None]
    assert "embedding" not in labels.columns and "embedding" in outputs.columns
    # the columns of a choices task, with the label's similarity before its confidence
    assert labels.columns[-8:] == ["similarity", "confidence", "label", *ANSWER_COLUMNS]


def test_engine_settings_of_an_embedding_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.engines.embedded_model import embedding_model_dir
    from batch_assets.engines.vllm_engine import VLLMEngine

    monkeypatch.delenv("BATCH_ASSETS_EMBEDDING_MODEL", raising=False)
    # The resource's chat model is for chat tasks; an embedding task keeps its embedding model.
    settings = VLLMEngine(model="/models/chat").settings(load_task_spec(write(tmp_path, EMBED)), gpus=0)
    assert settings.model == str(embedding_model_dir())
    # Left out of the task, the context is the model's own limit (all-MiniLM-L6-v2: 256 tokens).
    assert settings.max_model_len == 256
    assert settings.runner == "pooling" and settings.engine_args()["runner"] == "pooling"
    assert settings.vllm_args["enable_prefix_caching"] is False and not settings.structured_outputs
    assert settings.identity()["runner"] == "pooling"


def test_the_demo_prints_both_ways_of_labelling_side_by_side() -> None:
    from batch_assets.app.run_outcomes import accuracy_side_by_side

    text = accuracy_side_by_side(
        [
            ("industry", "chat model embedded:SmolLM2-135M-Instruct, structured outputs", 0.025, 40),
            ("industry_similarity", "embedding similarity, embedded:all-MiniLM-L6-v2", 0.75, 40),
        ]
    )
    assert text is not None
    chat, similarity = text.splitlines()[-2:]
    assert chat.split()[:5] == ["industry", "2%", "of", "40", "rows"] and "structured outputs" in chat
    assert similarity.split()[:5] == ["industry_similarity", "75%", "of", "40", "rows"] and "similarity" in similarity
    assert chat.index("% of") == similarity.index("% of")  # aligned
    assert accuracy_side_by_side([]) is None


def test_local_model_folders_of_the_wrong_kind_are_refused_at_load(tmp_path: Path) -> None:
    import json

    chat_model, embedder = tmp_path / "chat-model", tmp_path / "embedder"
    chat_model.mkdir()
    (chat_model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (chat_model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    embedder.mkdir()
    (embedder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (embedder / "modules.json").write_text("[]")
    with pytest.raises(TaskSpecError, match=r"engine.model \(line 5\): .*chat-model is a chat model"):
        load_task_spec(write(tmp_path, EMBED + f"engine: {{model: '{chat_model}'}}\n"))
    chat = "input: {text_fields: [text]}\nprompt: {template: '{text}'}\noutput: {kind: text}\n"
    with pytest.raises(TaskSpecError, match="embedder is an embedding model"):
        load_task_spec(write(tmp_path, chat + f"engine: {{model: '{embedder}'}}\n", "chat"))
    assert load_task_spec(write(tmp_path, EMBED + f"engine: {{model: '{embedder}'}}\n", "ok")).output.pooling


def test_a_run_over_several_partitions_embeds_the_choices_once_in_the_same_stream(tmp_path: Path) -> None:
    from batch_assets.pipeline.formats import InferenceStream
    from batch_assets.pipeline.inference_requests import InferenceStats, PartitionInput
    from batch_assets.pipeline.task_formats import task_format

    task = load_task_spec(write(tmp_path, SIMILARITY, "topics"))
    streams: list[list[str]] = []

    def run(parts: list[PartitionInput]) -> list:
        streams.append([part.label for part in parts])
        choices = parts[-1]
        assert choices.formatted["prompt"].to_list() == ["sports", "recipes and kitchens"]
        assert [len(p) for p in choices.encode(["recipes and kitchens"])] == [5]  # [CLS] 3 words [SEP]
        chosen = pl.DataFrame(
            {
                "row_id": [0, 1],
                "generated_text": [encode_vector([1.0, 0.0]), encode_vector([0.0, 1.0])],
                "error": pl.Series([None, None], dtype=pl.String),
            }
        )
        rows = [(results_frame([[0.8, 0.6], [0.1, 0.9]]), InferenceStats()) for _ in parts[:-1]]
        return [*rows, (chosen, InferenceStats())]

    parts = [PartitionInput(pl.DataFrame(), lambda texts, keys=None: [], label=label) for label in ("a.csv", "b.csv")]
    results = task_format(task).infer(parts, InferenceStream(run, WordTokenizer(), 256))
    assert streams == [["a.csv", "b.csv", "choices"]]  # one stream, the choices once at its end
    assert [frame["generated_text"].to_list() for frame, _ in results] == [["sports", "cooking"]] * 2


@pytest.mark.parametrize("truncate", [False, True])
def test_the_encoder_sends_the_token_ids_the_models_tokenizer_gives(truncate: bool) -> None:
    """The encoder's own copy of the Rust tokenizer (no padding, truncation set once) gives what
    `tokenizer(texts, ...)` gives, which is what `LLM.embed` and sentence-transformers send."""
    from batch_assets.engines.embedded_model import embedding_model_dir
    from batch_assets.engines.tokenizers import load_tokenizer
    from batch_assets.pipeline.embeddings.prompts import embedding_encoder

    tokenizer = load_tokenizer(str(embedding_model_dir()))
    texts = [
        "short",
        "  leading and trailing spaces  ",
        "Ünïcödé, emoji 🚀 and CJK 東京",
        "[CLS] special [SEP] tokens [MASK] in the text",
        " ".join(f"word{i}" for i in range(400)),  # past the model's 256-token limit
    ]
    options = {"truncation": True, "max_length": 256} if truncate else {}
    expected = tokenizer(texts, add_special_tokens=True, **options)["input_ids"]
    prompts = embedding_encoder(tokenizer, 256, truncate)(texts)
    assert [list(prompt.token_ids) for prompt in prompts] == [list(ids) for ids in expected]
    assert [prompt.text for prompt in prompts] == texts
    assert (len(prompts[-1].token_ids) == 256) is truncate


def test_formatted_prompts_counts_and_logs_rows_of_unknown_tokens(data_dir: Path) -> None:
    """Through Dagster, no engine: formatted_prompts of the shipped embeddings task (the model's
    tokenizer only) records `unknown_token_rows` and logs a warning naming file and lines."""
    import dagster as dg

    from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
    from batch_assets.pipeline.task_spec import load_task_specs
    from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
    from batch_assets_tests.support import drop

    task = next(task for task in load_task_specs() if task.name == "embeddings")
    lines = ["A plain sentence.", "y" * 150, "Another plain one.", "\U0001f600\U0001f600\U0001f600"]
    drop(data_dir, "embeddings", "odd.jsonl", "".join(f'{{"text": "{text}"}}\n' for text in lines))
    key = partition_key_for("odd.jsonl")
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
        result = job.execute_in_process(
            instance=instance,
            partition_key=key,
            asset_selection=[
                dg.AssetKey(["embeddings", "raw_prompts"]),
                dg.AssetKey(["embeddings", "formatted_prompts"]),
            ],
        )
        warnings = [entry.user_message for entry in instance.all_logs(result.run_id) if entry.level == logging.WARNING]
    metadata = result.asset_materializations_for_node("embeddings__formatted_prompts")[0].metadata
    assert metadata["unknown_token_rows"].value == 2
    assert [w for w in warnings if "unknown token" in w] == [
        f"{key}: 2 row(s) are mostly the tokenizer's unknown token (at least 50% of their tokens; line 2, 4): "
        "their embeddings say little about their text (a word over 100 characters, emoji, a script missing from "
        "the model's vocabulary). They are embedded anyway; formatted_prompts counts them in unknown_token_rows"
    ]
