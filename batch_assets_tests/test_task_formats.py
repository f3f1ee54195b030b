"""The task formats (pipeline/task_formats.py): every shipped task gets the format object of its kind
from the registry, and the asset and check factories never ask which kind a task is (issue 27,
item 2). Fast: no engine, no Dagster run."""

from __future__ import annotations

import ast
from pathlib import Path

import polars as pl
import pytest

from batch_assets.pipeline.cascade.formats import CascadeRecords
from batch_assets.pipeline.chat_records import ChatRecords
from batch_assets.pipeline.embeddings.formats import EmbeddingRecords, SimilarityRecords
from batch_assets.pipeline.formats import TaskFormat
from batch_assets.pipeline.openai_batch.formats import OpenAIBatchEmbeddings, OpenAIBatchLines
from batch_assets.pipeline.task_formats import TASK_FORMATS, format_class, task_format
from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR, load_task_spec, load_task_specs
from batch_assets_tests.support import REPO_ROOT

EXPECTED = {
    "answers": ChatRecords,
    "document_qa": ChatRecords,
    "embeddings": EmbeddingRecords,
    "industry": ChatRecords,
    "industry_similarity": SimilarityRecords,
    "industry_cascade": CascadeRecords,
    "openai_batch": OpenAIBatchLines,
    "openai_batch_embeddings": OpenAIBatchEmbeddings,
    "sentiment": ChatRecords,
    "industry_fewshot": ChatRecords,
    "images": ChatRecords,  # records with image fields: the same chat format, images beside the text
}
# The Dagster modules that build a task's assets and checks: they call the task's format object.
FACTORIES = ("batch_assets/lib/assets.py", "batch_assets/lib/checks.py", "batch_assets/lib/gate_checks.py")
KIND_NAMES = (
    "records",
    "openai_batch",
    "embedding",
    "similarity",
    "cascade",
    "generate",
    "choices",
    "regex",
    "json_schema",
)


def shipped_tasks() -> list:
    examples = [load_task_spec(path) for path in sorted((REPO_ROOT / "examples" / "tasks").glob("*.yaml"))]
    return [*load_task_specs(BUNDLED_TASKS_DIR), *examples]


def test_every_shipped_task_maps_to_the_format_of_its_kind() -> None:
    tasks = shipped_tasks()
    assert sorted(task.name for task in tasks) == sorted(EXPECTED)
    for task in tasks:
        fmt = task_format(task)
        assert type(fmt) is EXPECTED[task.name], task.name
        assert fmt.task is task


def test_the_registry_names_each_kind_once_and_each_name_is_a_kind() -> None:
    kinds = [format_class(key) for key in TASK_FORMATS]
    assert len(set(kinds)) == len(TASK_FORMATS) == 6
    assert all(issubclass(kind, TaskFormat) for kind in kinds)


def test_what_each_kind_asks_of_inference() -> None:
    by_name = {task.name: task_format(task) for task in shipped_tasks()}
    # Embeddings generate nothing and are deterministic; batch lines carry their own sampling.
    assert (by_name["embeddings"].max_tokens, by_name["embeddings"].deduplicate) == (0, True)
    assert (by_name["industry_similarity"].max_tokens, by_name["industry_similarity"].deduplicate) == (0, True)
    assert by_name["openai_batch"].deduplicate is True
    assert (by_name["openai_batch_embeddings"].max_tokens, by_name["openai_batch_embeddings"].deduplicate) == (0, True)
    industry = by_name["industry"]
    assert industry.max_tokens == industry.task.sampling.max_tokens
    # What the demo prints beside each sample's accuracy.
    assert industry.labelled_by("/models/chat") == "chat model /models/chat, structured outputs"
    similarity = by_name["industry_similarity"]
    assert similarity.labelled_by("embedded:all-MiniLM-L6-v2") == "embedding similarity, embedded:all-MiniLM-L6-v2"
    assert industry.deduplicate == industry.task.sampling.deterministic
    # What a validated row carries names its output checks; only closed label sets are counted.
    assert {name for name, fmt in by_name.items() if fmt.result == "embeddings"} == {
        "embeddings",
        "openai_batch_embeddings",
    }
    assert {name for name, fmt in by_name.items() if fmt.counts_labels} == {
        "industry",
        "industry_similarity",
        "industry_cascade",
        "sentiment",
        "industry_fewshot",
        "images",
    }
    assert not by_name["openai_batch"].measures_confidence
    assert not by_name["openai_batch_embeddings"].measures_confidence
    assert by_name["openai_batch_embeddings"].preview_columns(pl.DataFrame()) == ["custom_id", "input", "error"]


def test_an_unknown_kind_is_refused_by_name() -> None:
    task = next(task for task in shipped_tasks() if task.name == "embeddings")
    # model_copy does not validate: a format no TaskSpec accepts stands for a kind not registered yet.
    unknown = task.model_copy(update={"input": task.input.model_copy(update={"format": "xml_rows"})})
    with pytest.raises(ValueError, match="no task format for input.format xml_rows with embed"):
        task_format(unknown)


def _kind_tests(path: Path) -> list[str]:
    """Where a module tests which kind a task is: `.pooling`, or a comparison with a task's
    `output.kind` / `output.method` / `input.format` or with the name of a kind."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "pooling":
            found.append(f"{path.name}:{node.lineno}: .pooling")
        if not isinstance(node, ast.Compare):
            continue
        for part in ast.walk(node):
            if (
                isinstance(part, ast.Attribute)
                and part.attr in ("kind", "method", "format")
                and isinstance(part.value, ast.Attribute)
                and part.value.attr in ("output", "input")
            ):
                found.append(f"{path.name}:{node.lineno}: {part.value.attr}.{part.attr}")
            if isinstance(part, ast.Constant) and part.value in KIND_NAMES:
                found.append(f"{path.name}:{node.lineno}: {part.value!r}")
    return found


def test_the_asset_and_check_factories_never_test_which_kind_a_task_is() -> None:
    found = [hit for module in FACTORIES for hit in _kind_tests(REPO_ROOT / module)]
    assert not found, f"ask the task's format object (pipeline/task_formats.py) instead: {found}"


def test_the_guard_sees_a_kind_test(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "batch = task.input.format == 'openai_batch'\n"
        "pooling = task.output.pooling\n"
        "labels = task.output.kind in ('choices', 'regex')\n"
    )
    assert len(_kind_tests(probe)) == 6


def test_the_tokens_a_partition_may_generate_are_its_kinds() -> None:
    by_name = {task.name: task_format(task) for task in shipped_tasks()}
    rows = pl.DataFrame({"max_tokens": [5, None, 7]}, schema={"max_tokens": pl.Int64})
    # A chat task: every row may write sampling.max_tokens.
    industry = by_name["industry"]
    assert industry.max_generated_tokens(rows) == 3 * industry.task.sampling.max_tokens
    # Batch lines: each line's own max_tokens, the task's where a line has none.
    batch = by_name["openai_batch"]
    assert batch.max_generated_tokens(rows) == 5 + batch.task.sampling.max_tokens + 7
    # Embeddings generate nothing.
    assert by_name["embeddings"].max_generated_tokens(rows) == 0
    assert by_name["openai_batch_embeddings"].max_generated_tokens(rows) == 0
