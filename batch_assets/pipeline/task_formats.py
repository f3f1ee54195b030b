"""The kinds of task, by (input.format, what the model does): `task_format(task)` picks one.

    registry key                 kind (module)
    ("records", "generate")      ChatRecords (chat_records): input fields → the task's template → the chat
                                 template; a chat model writes each row's label
    ("records", "embed")         EmbeddingRecords (embedding_records): an embedding model's vector per row
    ("records", "similarity")    SimilarityRecords (embedding_records): labelled by the most similar choice
    ("records", "cascade")       CascadeRecords (cascade_records): a teacher labels a sample and the
                                 uncertain rows, a student on the embeddings the rest
    ("openai_batch", "generate") OpenAIBatchLines: each line of an OpenAI Batch API file, with its own
                                 messages and sampling; output and error files besides
    ("openai_batch", "embed")    OpenAIBatchEmbeddings: each `/v1/embeddings` line's text (or texts),
                                 embedded; output and error files besides

What each kind answers is the contract, pipeline/formats.py. A new kind is a module (or package) of
its own with its `TaskFormat` class, and one entry in `TASK_FORMATS`.
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl

from batch_assets.pipeline.cascade_records import CascadeRecords
from batch_assets.pipeline.chat_records import ChatRecords
from batch_assets.pipeline.embedding_records import EmbeddingRecords, SimilarityRecords
from batch_assets.pipeline.engine_contract import Engine, EngineSettings, model_name
from batch_assets.pipeline.format_prompts import Tokenizer
from batch_assets.pipeline.formats import OutputFiles, PartitionEncoders, TaskFormat
from batch_assets.pipeline.inputs.read_prompts import ParseOptions
from batch_assets.pipeline.openai_batch import (
    accepted_model_names,
    batch_prompt_encoder,
    format_batch_embedding_prompts,
    format_batch_prompts,
    read_batch_requests,
)
from batch_assets.pipeline.openai_batch_output import (
    batch_files,
    jsonl_bytes,
    validate_batch_embeddings,
    validate_batch_outputs,
)
from batch_assets.pipeline.task_spec import TaskSpec


class OpenAIBatchLines(TaskFormat):
    """Lines of an OpenAI Batch API request file, each with its own messages, sampling and
    `response_format` (pipeline/openai_batch.py); the answers also go to the partition's batch
    output and error files (pipeline/openai_batch_output.py)."""

    key = ("openai_batch", "generate")

    @staticmethod
    def read_file(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
        return read_batch_requests(data, file_name, options.images)

    def format(
        self, raw: pl.DataFrame, engine: Engine, tokenizer: Tokenizer, settings: EngineSettings, *, source_file: str
    ) -> pl.DataFrame:
        task = self.task
        return format_batch_prompts(
            raw,
            tokenizer,
            sampling_defaults=task.sampling,
            max_model_len=settings.max_model_len,
            source_file=source_file,
            accepted_models=accepted_model_names(model_name(settings)) if task.input.require_model_match else None,
            chat_only=engine.sends_chat_messages,
        )

    def encoders(self, engine: Engine, tokenizer: Tokenizer, max_model_len: int) -> PartitionEncoders:
        return lambda formatted: batch_prompt_encoder(engine, self.task, tokenizer, formatted)

    @property
    def deduplicate(self) -> bool:
        # Lines carry their own sampling; their request keys tell deterministic ones apart.
        return True

    def max_generated_tokens(self, to_infer: pl.DataFrame) -> int:
        # Each line's own max_tokens, the task's where it has none.
        return int(to_infer["max_tokens"].fill_null(self.max_tokens).sum() or 0)

    def validate(self, outputs: pl.DataFrame) -> pl.DataFrame:
        return validate_batch_outputs(outputs)

    def preview_columns(self, labels: pl.DataFrame) -> list[str]:
        return ["custom_id", "label", "error"]

    @property
    def measures_confidence(self) -> bool:
        return False  # a line's answer is text or JSON

    def output_files(self, labels: pl.DataFrame, partition_key: str, created: int, model: str) -> OutputFiles:
        return batch_output_files(labels, partition_key, created, model)


def batch_output_files(labels: pl.DataFrame, partition_key: str, created: int, model: str) -> OutputFiles:
    """A partition's OpenAI batch output and error files (answers or embeddings, by the table)."""
    outputs, failed = batch_files(labels, model=model, partition_key=partition_key, created=created)
    return OutputFiles(
        metadata={"batch_output_lines": len(outputs), "batch_error_lines": len(failed)},
        files={
            f"{folder}_file": (f"{folder}/{partition_key}.jsonl", jsonl_bytes(records))
            for folder, records in (("batch_output", outputs), ("batch_errors", failed))
        },
    )


class OpenAIBatchEmbeddings(EmbeddingRecords):
    """The `/v1/embeddings` lines of an OpenAI Batch API file (`input.format: openai_batch` with
    `output.kind: embedding`): each text embedded as an embedding task's row is; a line of several
    texts answered by one output line (pipeline/openai_batch.py, openai_batch_output.py)."""

    key = ("openai_batch", "embed")

    @staticmethod
    def read_file(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
        return read_batch_requests(data, file_name, options.images)

    def formatted_description(self) -> str:
        return (
            f"The text of each `/v1/embeddings` line of a `{self.task.name}` batch file (one row per text of "
            "`body.input`), with `num_prompt_tokens`. Chat and completion lines, empty texts and texts too "
            "long for the model get an `error` (or, with `input.truncate`, are cut: `truncated`)."
        )

    def validated_description(self) -> str:
        return (
            f"The `{self.task.name}` result table: one row per text of each line, with `custom_id`, `embedding` "
            "(fixed-size float32, unit length), `num_prompt_tokens` and `error` (null when the row is fine). "
            "The batch output and error files, one line per request line, are written beside it."
        )

    def format(
        self, raw: pl.DataFrame, engine: Engine, tokenizer: Tokenizer, settings: EngineSettings, *, source_file: str
    ) -> pl.DataFrame:
        task = self.task
        return format_batch_embedding_prompts(
            raw,
            tokenizer,
            max_model_len=settings.max_model_len,
            truncate=task.input.truncate,
            source_file=source_file,
            accepted_models=accepted_model_names(model_name(settings)) if task.input.require_model_match else None,
        )

    def validate(self, outputs: pl.DataFrame) -> pl.DataFrame:
        return validate_batch_embeddings(outputs)

    def preview_columns(self, labels: pl.DataFrame) -> list[str]:
        return ["custom_id", "input", "error"]

    def output_files(self, labels: pl.DataFrame, partition_key: str, created: int, model: str) -> OutputFiles:
        return batch_output_files(labels, partition_key, created, model)


# The kinds of task, by `task_format_key`: a new kind is a new entry.
TASK_FORMATS: dict[tuple[str, str], type[TaskFormat]] = {
    kind.key: kind
    for kind in (
        ChatRecords,
        EmbeddingRecords,
        SimilarityRecords,
        CascadeRecords,
        OpenAIBatchLines,
        OpenAIBatchEmbeddings,
    )
}


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
    return TASK_FORMATS[key](task)


def raw_file_reader(input_format: str) -> Callable[[bytes, str, ParseOptions], pl.DataFrame]:
    """How a whole drop file of `input.format` is read: as its kinds read it (those of one input
    format read alike)."""
    return next(kind.read_file for (fmt, _), kind in TASK_FORMATS.items() if fmt == input_format)
