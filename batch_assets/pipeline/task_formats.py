"""The kinds of task, by (input.format, what the model does): `task_format(task)` picks one.

    registry key                 kind (module)
    ("records", "generate")      ChatRecords (chat_records): input fields → the task's template → the chat
                                 template; a chat model writes each row's label
    ("records", "embed")         EmbeddingRecords (embeddings/): an embedding model's vector per row
    ("records", "similarity")    SimilarityRecords (embeddings/): labelled by the most similar choice
    ("records", "cascade")       CascadeRecords (cascade/): a teacher labels a sample and the
                                 uncertain rows, a student on the embeddings the rest
    ("openai_batch", "generate") OpenAIBatchLines (openai_batch/): each line of an OpenAI Batch API file, with its own
                                 messages and sampling; output and error files besides
    ("openai_batch", "embed")    OpenAIBatchEmbeddings (openai_batch/): each `/v1/embeddings` line's text (or texts),
                                 embedded; output and error files besides

What each kind answers is the contract, pipeline/formats.py. A kind with code of its own is a package
(`embeddings/`, `cascade/`, `openai_batch/`) whose `formats` module holds its `TaskFormat` classes;
chat labels have none: their class composes the stages every kind shares (format_prompts,
prompt_tokens, validate_labels, which the contract's defaults are), so it is one module beside them.
A new kind is one package and one entry in `TASK_FORMATS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

import polars as pl

from batch_assets.pipeline.formats import TaskFormat
from batch_assets.pipeline.inputs.read_prompts import ParseOptions
from batch_assets.pipeline.task_spec import TaskSpec

# The kinds of task, by `task_format_key` → the class that handles them, by name: a new kind is a new
# entry. Named, not imported, as vLLM's model registry names its models: a kind's package imports
# the contract and the shared core beside this module, so importing the kinds here would make a
# circle of packages, and loading a task's kind loads only that kind's code.
TASK_FORMATS: dict[tuple[str, str], str] = {
    ("records", "generate"): "batch_assets.pipeline.chat_records:ChatRecords",
    ("records", "embed"): "batch_assets.pipeline.embeddings.formats:EmbeddingRecords",
    ("records", "similarity"): "batch_assets.pipeline.embeddings.formats:SimilarityRecords",
    ("records", "cascade"): "batch_assets.pipeline.cascade.formats:CascadeRecords",
    ("openai_batch", "generate"): "batch_assets.pipeline.openai_batch.formats:OpenAIBatchLines",
    ("openai_batch", "embed"): "batch_assets.pipeline.openai_batch.formats:OpenAIBatchEmbeddings",
}


@cache
def format_class(key: tuple[str, str]) -> type[TaskFormat]:
    """The `TaskFormat` class registered for `key`, imported on first use."""
    module, _, name = TASK_FORMATS[key].partition(":")
    return getattr(importlib.import_module(module), name)


def task_format_key(task: TaskSpec) -> tuple[str, str]:
    """(input.format, what the model does: `generate`, `embed` or `similarity`)."""
    does = "embed" if task.output.kind == "embedding" else task.output.method
    return (task.input.format, does)


def task_format(task: TaskSpec) -> TaskFormat:
    """The task's format object, chosen once from the registry."""
    key = task_format_key(task)
    if key not in TASK_FORMATS:
        known = ", ".join(f"{fmt}/{does}" for fmt, does in TASK_FORMATS)
        raise ValueError(f"task {task.name!r}: no task format for input.format {key[0]} with {key[1]} (known: {known})")
    return format_class(key)(task)


def raw_file_reader(input_format: str) -> Callable[[bytes, str, ParseOptions], pl.DataFrame]:
    """How a whole drop file of `input.format` is read: as its kinds read it (those of one input
    format read alike)."""
    return next(format_class(key).read_file for key in TASK_FORMATS if key[0] == input_format)
