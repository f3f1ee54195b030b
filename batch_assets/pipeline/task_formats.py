"""What a task's rows are, from the drop file to the result table: one object per kind of task.

    registry key (input.format, what the model does)   object
    ("records", "generate")     ChatRecords        input fields → the task's template → the chat template;
                                                   a chat model writes each row's label (choices, JSON
                                                   schema, regex or free text)
    ("records", "embed")        EmbeddingRecords   input fields → the template, no chat template; an
                                                   embedding model's vector per row (`output.kind: embedding`)
    ("records", "similarity")   SimilarityRecords  formatted and embedded as EmbeddingRecords, labelled by
                                                   the most similar choice (`output.method: similarity`)
    ("records", "cascade")      CascadeRecords     embedded as EmbeddingRecords; a teacher labels a sample and
                                                   the uncertain rows, a student on the embeddings the rest
                                                   (`output.method: cascade`, pipeline/cascade.py)
    ("openai_batch", "generate") OpenAIBatchLines  each line of an OpenAI Batch API file, with its own
                                                   messages and sampling; output and error files besides
    ("openai_batch", "embed")   OpenAIBatchEmbeddings  each `/v1/embeddings` line's text (or texts), embedded;
                                                   output and error files besides

Each object answers, for its kind, everything the assets and checks ask of a task's rows: the
descriptions of formatted_prompts, inference_outputs and validated_labels; how a raw partition is
formatted; the encoder of its prompts for the engine (built once per run); how inference is run (the
tokens a request may generate, whether identical requests share a result, how the engine's results
become inference_outputs, what besides the model decides them); validation; the preview columns; the
label metadata and any files written beside the result table; which output checks apply. The
assets call `task_format(task)` once and never ask which kind a task is.

A new kind is one class (here, or in a module of its own) and one entry in `TASK_FORMATS`. Pure: no
Dagster and no storage (what Dagster shows and where files go is the assets' business), in the
manner of the stages of Ray Data LLM (`ray.llm._internal.batch`): one small contract, chosen from a
registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import polars as pl

from batch_assets.pipeline.cascade import TaskCascade
from batch_assets.pipeline.cascade_labels import Teach, cascade_outputs, cascade_summary
from batch_assets.pipeline.embeddings import (
    choice_texts,
    choice_vectors,
    choices_frame,
    embedding_encoder,
    embedding_outputs,
    embedding_report,
    format_embedding_prompts,
    similarity_outputs,
    unknown_token_rows,
    unknown_token_warning,
    validate_embeddings,
)
from batch_assets.pipeline.engine_contract import Engine, EngineSettings, Prompt, model_name
from batch_assets.pipeline.format_prompts import PromptFormat, Tokenizer, format_prompts, prompt_encoders
from batch_assets.pipeline.inputs.images import IMAGES_COLUMN
from batch_assets.pipeline.label_model import LabelModel
from batch_assets.pipeline.label_quality import label_counts
from batch_assets.pipeline.openai_batch import (
    accepted_model_names,
    batch_prompt_encoder,
    format_batch_embedding_prompts,
    format_batch_prompts,
)
from batch_assets.pipeline.openai_batch_output import (
    batch_files,
    jsonl_bytes,
    validate_batch_embeddings,
    validate_batch_outputs,
)
from batch_assets.pipeline.prices import engine_price, teacher_price
from batch_assets.pipeline.prompt_tokens import PROMPT_TOKEN_IDS
from batch_assets.pipeline.run_inference import InferenceStats, PartitionInput
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.pipeline.validate_labels import validate_labels

# A partition's prompt texts (and, for OpenAI batch lines, their request params; `keys=`: each
# prompt's `Prompt.key`) → engine prompts.
Encode = Callable[..., list[Prompt]]
# formatted_prompts of one partition → its `Encode` (what is the same for every partition built once).
PartitionEncoders = Callable[[pl.DataFrame], Encode]
# `run_inference` over the given partitions with the run's session, cache and settings.
RunInference = Callable[[list[PartitionInput]], list[tuple[pl.DataFrame, InferenceStats]]]


@dataclass(frozen=True)
class InferenceStream:
    """What a kind's `infer` gets of the run: `run`, the engine's tokenizer and context length (for
    requests of the kind's own: similarity's choices), `teach`, a cascade's chat teacher
    (`teacher: llm`; None for every other task), `label_model`, a cascade task's stored student
    for this task version (None: none yet, or another kind of task), and `cascade_task`, what the
    partitions of a cascade by target share."""

    run: RunInference
    tokenizer: Tokenizer
    max_model_len: int
    teach: Teach | None = None
    label_model: LabelModel | None = None
    # A cascade by target's student version and calibration, shared by the task's partitions
    # (lib/assets.py: stored, first writer wins); None for every other task.
    cascade_task: TaskCascade | None = None


@dataclass(frozen=True)
class OutputFiles:
    """Files a kind writes beside its result table (an OpenAI batch's output and error files)."""

    metadata: dict[str, Any] = field(default_factory=dict)  # what to record about them
    # metadata key of the file's path -> (path under the task's storage folder, contents)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)


class TaskFormat(ABC):
    """The contract every kind implements. The defaults are those of labels a chat model generates
    (a kind that embeds, or brings its own requests, overrides them)."""

    key: ClassVar[tuple[str, str]]
    # What a validated row carries, which names its output checks (lib/checks.py):
    # "labels" (a label parsed and checked against the constraint) or "embeddings" (a vector).
    result: ClassVar[str] = "labels"
    # Labels partly by a teacher that audits the rest: `agreement_at_least` holds the audit (lib/checks.py).
    audits_agreement: ClassVar[bool] = False

    def __init__(self, task: TaskSpec) -> None:
        self.task = task

    # --- descriptions of the assets ---------------------------------------------------------------

    def formatted_description(self) -> str:
        return (
            f"The exact prompt the model sees for each `{self.task.name}` row: the task's system prompt and "
            "template rendered with the model's chat template, with `num_prompt_tokens`. Rows with "
            "empty text or too long for the model's context get an `error` and skip the engine."
        )

    def inference_description(self, engine_name: str) -> str:
        """The start of inference_outputs' description: what it holds."""
        return (
            f"Model outputs for each `{self.task.name}` prompt from {engine_name}, constrained by the task's "
            "structured outputs."
        )

    def validated_description(self) -> str:
        return (
            f"The `{self.task.name}` result table: every input column, `label` (parsed and checked against the "
            "task's output constraint; choices and regex tasks also give its `confidence`, 0-1), the "
            "generated text, token counts and `error` (null when the row is fine). Exactly one row per "
            "input record, in input order."
        )

    def labelled_by(self, model: str) -> str:
        """How the labels come about, for the demo's side-by-side accuracies."""
        return f"chat model {model}, structured outputs"

    # --- formatted_prompts ------------------------------------------------------------------------

    @abstractmethod
    def format(
        self, raw: pl.DataFrame, engine: Engine, tokenizer: Tokenizer, settings: EngineSettings, *, source_file: str
    ) -> pl.DataFrame:
        """raw_prompts → formatted_prompts of one partition: `prompt`, `num_prompt_tokens`, errors."""

    def formatting_metadata(self, formatted: pl.DataFrame) -> dict[str, Any]:
        """What formatted_prompts' metadata adds for this kind."""
        return {}

    def formatting_warnings(self, formatted: pl.DataFrame, source_file: str) -> list[str]:
        """Log warnings about rows that are formatted but may not give a useful answer."""
        return []

    def formatting_notes(self, source_file: str) -> list[str]:
        """Log lines on how a partition was formatted (how its prompts' token ids were made)."""
        return []

    # --- inference_outputs ------------------------------------------------------------------------

    @abstractmethod
    def encoders(self, engine: Engine, tokenizer: Tokenizer, max_model_len: int) -> PartitionEncoders:
        """The encoder of each partition's prompts for `engine`, for one run."""

    @property
    def max_tokens(self) -> int:
        """The tokens a request may generate (the rest of the context is the prompt's)."""
        return self.task.sampling.max_tokens

    @property
    def deduplicate(self) -> bool:
        """Identical requests share one result (and the result cache): deterministic decoding only."""
        return self.task.sampling.deterministic

    def infer(self, parts: list[PartitionInput], stream: InferenceStream) -> list[tuple[pl.DataFrame, InferenceStats]]:
        """The run's partitions through `stream.run` (one stream), as inference_outputs with their stats."""
        return stream.run(parts)

    def max_generated_tokens(self, to_infer: pl.DataFrame) -> int:
        """The most tokens the requests of `to_infer` (formatted rows without an error) may generate."""
        return to_infer.height * self.max_tokens

    def output_identity(self, settings: EngineSettings) -> dict[str, Any]:
        """What decides the outputs besides the model and its context (checkpoint and cache fingerprint)."""
        return {
            "structured_outputs": settings.structured_outputs,
            "sampling": self.task.sampling.model_dump(),
            "output": self.task.output.decision(),
        }

    def inference_metadata(self, outputs: pl.DataFrame) -> dict[str, Any]:
        """What inference_outputs' metadata adds for this kind."""
        return {}

    # --- validated_labels -------------------------------------------------------------------------

    def validate(self, outputs: pl.DataFrame) -> pl.DataFrame:
        """inference_outputs → validated_labels of one partition."""
        return validate_labels(outputs, self.task.output)

    def preview_columns(self, labels: pl.DataFrame) -> list[str]:
        """The columns of the preview in validated_labels' metadata."""
        shown = [c for c in ("similarity", "confidence") if c in labels.columns]
        return [*self.task.input.text_fields, "label", *shown, "error"]

    def label_metadata(self, labels: pl.DataFrame) -> dict[str, Any]:
        """What validated_labels' metadata adds for this kind (besides rows, errors and the preview)."""
        return {"labelled_rows": int(labels["label"].is_not_null().sum())}

    @property
    def counts_labels(self) -> bool:
        """Labels from a closed set (choices, a regex): counted per partition, and their drift checked."""
        return self.task.output.kind in ("choices", "regex")

    def label_counts(self, labels: pl.DataFrame) -> dict[str, int]:
        return label_counts(labels) if self.counts_labels else {}

    @property
    def measures_confidence(self) -> bool:
        """Labels get a `confidence`, which a check holds to `checks.min_confidence`."""
        return self.task.output.has_confidence

    def output_files(self, labels: pl.DataFrame, partition_key: str, created: int, model: str) -> OutputFiles:
        """Files to write beside the result table (none for most kinds)."""
        return OutputFiles()


class ChatRecords(TaskFormat):
    """Records whose fields fill the task's template, rendered with the model's chat template; the
    chat model writes each row's label (pipeline/format_prompts.py)."""

    key = ("records", "generate")

    def __init__(self, task: TaskSpec) -> None:
        super().__init__(task)
        # Worked out once per task: the few-shot examples' turns and the template's fields.
        self.prompt_format = PromptFormat.of(task)
        self._notes: dict[str, list[str]] = {}

    def format(
        self, raw: pl.DataFrame, engine: Engine, tokenizer: Tokenizer, settings: EngineSettings, *, source_file: str
    ) -> pl.DataFrame:
        notes = self._notes[source_file] = []
        return format_prompts(
            raw,
            self.prompt_format,
            tokenizer,
            max_model_len=settings.max_model_len,
            max_tokens=self.task.sampling.max_tokens,
            source_file=source_file,
            log=lambda note: notes.append(f"{source_file}: token ids: {note}"),
        )

    def formatting_notes(self, source_file: str) -> list[str]:
        return self._notes.pop(source_file, [])

    def encoders(self, engine: Engine, tokenizer: Tokenizer, max_model_len: int) -> PartitionEncoders:
        return prompt_encoders(engine, self.prompt_format, tokenizer)

    def infer(self, parts: list[PartitionInput], stream: InferenceStream) -> list[tuple[pl.DataFrame, InferenceStats]]:
        # The ids were for the engine: inference_outputs and the result table keep the prompt text.
        # An image task's image bytes likewise: the rows keep the images' digest and pixel count.
        return [
            (frame.drop(PROMPT_TOKEN_IDS, IMAGES_COLUMN, strict=False), stats) for frame, stats in stream.run(parts)
        ]

    def output_identity(self, settings: EngineSettings) -> dict[str, Any]:
        parts = super().output_identity(settings)
        # The rendered prompt (each request's key) holds the examples already; named here too, so no
        # answer given without them is reused with them whatever an engine makes of the text (an
        # endpoint is sent messages, not that text). Absent without examples: existing caches stay valid.
        if self.prompt_format.examples:
            parts["prompt_examples"] = [list(turns) for turns in self.prompt_format.examples]
        return parts


class OpenAIBatchLines(TaskFormat):
    """Lines of an OpenAI Batch API request file, each with its own messages, sampling and
    `response_format` (pipeline/openai_batch.py); the answers also go to the partition's batch
    output and error files (pipeline/openai_batch_output.py)."""

    key = ("openai_batch", "generate")

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


class _EmbeddedRecords(TaskFormat):
    """Records whose template text (no chat template) goes to an embedding model on vLLM's pooling
    runner (pipeline/embeddings.py): what embedding and similarity tasks share."""

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


class EmbeddingRecords(_EmbeddedRecords):
    """`output.kind: embedding`: an `embedding` column per row instead of a label."""

    key = ("records", "embed")
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


class SimilarityRecords(_EmbeddedRecords):
    """`output.method: similarity` on a choices task: rows embedded as EmbeddingRecords, each labelled
    by the choice whose embedding is the most similar, with its `confidence`; the labels are then
    those of a choices task (validation, metadata, checks)."""

    key = ("records", "similarity")

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


class CascadeRecords(_EmbeddedRecords):
    """`output.method: cascade` on a choices task: rows embedded as EmbeddingRecords; the teacher
    labels a sample of them and the rows the student (a classifier on the embeddings, trained on the
    sample) is unsure of, the student the rest (pipeline/cascade.py). The labels are then those of a
    choices task, with who gave each (`labelled_by`)."""

    key = ("records", "cascade")
    audits_agreement = True

    def inference_description(self, engine_name: str) -> str:
        return (
            f"Embeddings of each `{self.task.name}` row from {self.embedder(engine_name)}, and its label by the "
            "cascade: the teacher's on a sample and on the rows the student is unsure of, the student's elsewhere. "
            "The student starts from the task's label_model where one of this task version is stored "
            "(`label_model_digest`)."
        )

    def validated_description(self) -> str:
        return (
            f"The `{self.task.name}` result table: every input column, `label` and its `confidence`, "
            "`labelled_by` (teacher or student), `cascade_role` (sample, calibration, deferred, audit or student), "
            "`student_label` and `error`. Exactly one row per input record, in input order."
        )

    def labelled_by(self, model: str) -> str:
        teacher = "a chat model" if self.task.output.chat_teacher else "a teacher column"
        return f"cascade: {teacher} and a student on {model} embeddings"

    def output_identity(self, settings: EngineSettings) -> dict[str, Any]:
        # The vectors depend on the model and the text alone (so the cache holds embeddings, reused
        # whatever the cascade's settings); the labels are decided again from them on every run.
        return {"output": "embedding"}

    def infer(self, parts: list[PartitionInput], stream: InferenceStream) -> list[tuple[pl.DataFrame, InferenceStats]]:
        output = self.task.output
        assert output.cascade is not None  # method cascade requires it (OutputSpec)
        inferred = []
        for part, (frame, stats) in zip(parts, stream.run(parts), strict=True):
            # A partition the stored student learned from (a re-run, a replaced file) trains its own:
            # the stored one has seen its teacher rows, and its audit would measure them again.
            shared = stream.cascade_task
            stored = stream.label_model if shared is None else shared.stored
            learned_here = isinstance(stored, LabelModel) and part.label in stored.partitions
            task: TaskCascade | None = None
            if shared is not None:
                # A partition the task's student learned from runs alone: its own sample and calibration.
                task = TaskCascade(partition=part.label) if learned_here else shared
                task.partition = part.label
            labelled, measured = cascade_outputs(
                frame,
                output.cascade,
                output.choices or [],
                part.label,
                stream.teach,
                None if learned_here else stored,
                task,
            )
            inferred.append((labelled, replace(stats, format_metadata=measured)))
        return inferred

    def validate(self, outputs: pl.DataFrame) -> pl.DataFrame:
        return validate_labels(outputs.drop("embedding"), self.task.output)

    def preview_columns(self, labels: pl.DataFrame) -> list[str]:
        return [*self.task.input.text_fields, "label", "confidence", "labelled_by", "error"]

    def label_metadata(self, labels: pl.DataFrame) -> dict[str, Any]:
        summary = cascade_summary(labels, engine_price(self.task.engine), teacher_price(self.task))
        return {**super().label_metadata(labels), **summary.metadata()}


class OpenAIBatchEmbeddings(EmbeddingRecords):
    """The `/v1/embeddings` lines of an OpenAI Batch API file (`input.format: openai_batch` with
    `output.kind: embedding`): each text embedded as an embedding task's row is; a line of several
    texts answered by one output line (pipeline/openai_batch.py, openai_batch_output.py)."""

    key = ("openai_batch", "embed")

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
