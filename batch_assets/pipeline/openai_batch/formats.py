"""The task formats of OpenAI batch lines (pipeline/formats.py's contract): chat and
completion lines answered by a chat model (`OpenAIBatchLines`), `/v1/embeddings` lines by an
embedding model (`OpenAIBatchEmbeddings`); both write the partition's batch output and error files
beside the result table."""

from __future__ import annotations

import polars as pl

from batch_assets.pipeline.embeddings.formats import EmbeddingRecords
from batch_assets.pipeline.engine_contract import Engine, EngineSettings, model_name
from batch_assets.pipeline.format_prompts import Tokenizer
from batch_assets.pipeline.formats import OutputFiles, PartitionEncoders, TaskFormat
from batch_assets.pipeline.inputs.read_prompts import ParseOptions
from batch_assets.pipeline.openai_batch.engine_prompts import batch_prompt_encoder
from batch_assets.pipeline.openai_batch.formatting import (
    accepted_model_names,
    format_batch_embedding_prompts,
    format_batch_prompts,
)
from batch_assets.pipeline.openai_batch.lines import read_batch_requests
from batch_assets.pipeline.openai_batch.output import (
    batch_files,
    jsonl_bytes,
    validate_batch_embeddings,
    validate_batch_outputs,
)


class OpenAIBatchLines(TaskFormat):
    """Lines of an OpenAI Batch API request file, each with its own messages, sampling and
    `response_format` (formatting.py); the answers also go to the partition's batch output and
    error files (output.py)."""

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
    texts answered by one output line (formatting.py, output.py)."""

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
