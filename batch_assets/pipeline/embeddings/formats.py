"""`("records", "embed")` and `("records", "similarity")`: records whose template text (no chat
template) goes to an embedding model; an `embedding` per row (`output.kind: embedding`), or the
label of the most similar choice (`output.method: similarity`). Their formatting, vectors, checks
and similarity labels are the modules beside this one."""

from __future__ import annotations

from typing import Any

import polars as pl

from batch_assets.pipeline.embeddings.prompts import (
    embedding_encoder,
    format_embedding_prompts,
    unknown_token_rows,
    unknown_token_warning,
)
from batch_assets.pipeline.embeddings.results import embedding_outputs, embedding_report, validate_embeddings
from batch_assets.pipeline.embeddings.similarity import choice_texts, choice_vectors, choices_frame, similarity_outputs
from batch_assets.pipeline.engine_contract import Engine, EngineSettings
from batch_assets.pipeline.format_prompts import Tokenizer
from batch_assets.pipeline.formats import InferenceStream, PartitionEncoders, TaskFormat
from batch_assets.pipeline.inference_requests import InferenceStats, PartitionInput


class EmbeddedRecords(TaskFormat):
    """Records whose template text (no chat template) goes to an embedding model on vLLM's pooling
    runner (pipeline/embeddings/): what embedding and similarity tasks share."""

    def formatted_description(self) -> str:
        return (
            f"The text the embedding model embeds for each `{self.task.name}` row: the task's template over its "
            "fields (no chat template), with `num_prompt_tokens`. Rows with empty text or too long for "
            "the model get an `error` (or, with `input.truncate`, are cut: `truncated`)."
        )

    def embedder(self, engine_name: str) -> str:
        """Where the vectors come from, for the descriptions."""
        return "vLLM's pooling runner" if self.task.engine.kind == "vllm" else f"{engine_name} (/v1/embeddings)"

    def format(
        self, raw: pl.DataFrame, engine: Engine, tokenizer: Tokenizer, settings: EngineSettings, *, source_file: str
    ) -> pl.DataFrame:
        prompt = self.task.prompt
        assert prompt is not None  # a records task always has a prompt section (TaskSpec)
        return format_embedding_prompts(
            raw,
            prompt.template,
            self.task.input.text_fields,
            tokenizer,
            max_model_len=settings.max_model_len,
            truncate=self.task.input.truncate,
            source_file=source_file,
        )

    def formatting_metadata(self, formatted: pl.DataFrame) -> dict[str, Any]:
        return {"unknown_token_rows": unknown_token_rows(formatted)}

    def formatting_warnings(self, formatted: pl.DataFrame, source_file: str) -> list[str]:
        warning = unknown_token_warning(formatted, source_file)
        return [warning] if warning else []

    def encoders(self, engine: Engine, tokenizer: Tokenizer, max_model_len: int) -> PartitionEncoders:
        encode = embedding_encoder(tokenizer, max_model_len, self.task.input.truncate)
        return lambda formatted: encode

    @property
    def max_tokens(self) -> int:
        return 0  # an embedding generates nothing: the whole context is the text's

    @property
    def deduplicate(self) -> bool:
        return True  # an embedding is deterministic

    def output_identity(self, settings: EngineSettings) -> dict[str, Any]:
        # An embedding depends on the model and the text alone: a similarity task's choices and
        # descriptions, or sampling, do not change it.
        return {"output": "embedding"}

    def inference_metadata(self, outputs: pl.DataFrame) -> dict[str, Any]:
        """The vectors' dimension and how many rows were cut to fit."""
        dtype = outputs.schema["embedding"]
        metadata: dict[str, Any] = {"dimension": dtype.size if isinstance(dtype, pl.Array) else None}
        if "truncated" in outputs.columns:
            metadata["truncated_rows"] = int(outputs["truncated"].sum() or 0)
        return metadata


class EmbeddingRecords(EmbeddedRecords):
    """`output.kind: embedding`: an `embedding` column per row instead of a label."""

    result = "embeddings"

    def inference_description(self, engine_name: str) -> str:
        return f"Embeddings of each `{self.task.name}` row from {self.embedder(engine_name)}."

    def validated_description(self) -> str:
        return (
            f"The `{self.task.name}` result table: every input column, `embedding` (fixed-size float32, unit "
            "length), `num_prompt_tokens` and `error` (null when the row is fine). Exactly one row per input "
            "record, in input order."
        )

    def infer(self, parts: list[PartitionInput], stream: InferenceStream) -> list[tuple[pl.DataFrame, InferenceStats]]:
        return [(embedding_outputs(frame), stats) for frame, stats in stream.run(parts)]

    def validate(self, outputs: pl.DataFrame) -> pl.DataFrame:
        return validate_embeddings(outputs)

    def preview_columns(self, labels: pl.DataFrame) -> list[str]:
        return [*self.task.input.text_fields, "num_prompt_tokens", "error"]

    def label_metadata(self, labels: pl.DataFrame) -> dict[str, Any]:
        # The tokens embedded: an error row before the engine (too long, empty) was never sent.
        embedded = labels.filter(pl.col("embedding").is_not_null())
        return {**embedding_report(labels).metadata(), "prompt_tokens": int(embedded["num_prompt_tokens"].sum() or 0)}

    @property
    def counts_labels(self) -> bool:
        return False

    @property
    def measures_confidence(self) -> bool:
        return False


class SimilarityRecords(EmbeddedRecords):
    """`output.method: similarity` on a choices task: rows embedded as EmbeddingRecords, each labelled
    by the choice whose embedding is the most similar, with its `confidence`; the labels are then
    those of a choices task (validation, metadata, checks)."""

    def inference_description(self, engine_name: str) -> str:
        return (
            f"Embeddings of each `{self.task.name}` row from {self.embedder(engine_name)}, and its label by cosine "
            "similarity to each choice's embedding."
        )

    def labelled_by(self, model: str) -> str:
        return f"embedding similarity, {model}"

    def infer(self, parts: list[PartitionInput], stream: InferenceStream) -> list[tuple[pl.DataFrame, InferenceStats]]:
        """The choices go into the same stream as one more partition, so their embeddings are
        computed once per run (or come from the result cache) by the same model."""
        output = self.task.output
        texts = choice_texts(output)
        choices_part = PartitionInput(
            choices_frame(texts, stream.tokenizer),
            embedding_encoder(stream.tokenizer, stream.max_model_len, True),
            label="choices",
        )
        *results, (choice_results, _) = stream.run([*parts, choices_part])
        vectors = choice_vectors(choice_results, output.choices or [], texts)
        return [(similarity_outputs(frame, vectors, output.choices or []), stats) for frame, stats in results]
