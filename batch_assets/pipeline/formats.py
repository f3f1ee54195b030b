"""The contract of a kind of task: what its rows are, from the drop file to the result table.

Each kind answers, for its rows, everything the assets and checks ask: how a whole drop file is
read; the descriptions of formatted_prompts, inference_outputs and validated_labels; how a raw
partition is formatted; the encoder of its prompts for the engine (built once per run); how
inference is run (the tokens a request may generate, whether identical requests share a result, how
the engine's results become inference_outputs, what besides the model decides them); validation;
the preview columns; the label metadata and any files written beside the result table; which output
checks apply. The assets call `task_format(task)` (pipeline/task_formats.py, the registry) once and
never ask which kind a task is.

Pure: no Dagster and no storage (what Dagster shows and where files go is the assets' business), in
the manner of the stages of Ray Data LLM (`ray.llm._internal.batch`): one small contract, chosen
from a registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import polars as pl

from batch_assets.pipeline.engine_contract import Engine, EngineSettings, Prompt
from batch_assets.pipeline.format_prompts import Tokenizer
from batch_assets.pipeline.inference_requests import InferenceStats, PartitionInput
from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
from batch_assets.pipeline.label_quality import label_counts
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
    """What a kind's `infer` gets of the run: `run`, and the engine's tokenizer and context length (for
    requests of the kind's own: similarity's choices). A kind that needs more of the run (the
    cascade's teacher and stored student) gets a subclass of its own, which the assets build for
    its tasks (pipeline/cascade/formats.py's `CascadeStream`)."""

    run: RunInference
    tokenizer: Tokenizer
    max_model_len: int


@dataclass(frozen=True)
class OutputFiles:
    """Files a kind writes beside its result table (an OpenAI batch's output and error files)."""

    metadata: dict[str, Any] = field(default_factory=dict)  # what to record about them
    # metadata key of the file's path -> (path under the task's storage folder, contents)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)


class TaskFormat(ABC):
    """The contract every kind implements. The defaults are those of labels a chat model generates
    (a kind that embeds, or brings its own requests, overrides them)."""

    # What a validated row carries, which names its output checks (lib/checks.py):
    # "labels" (a label parsed and checked against the constraint) or "embeddings" (a vector).
    result: ClassVar[str] = "labels"
    # Labels partly by a teacher that audits the rest: `agreement_at_least` holds the audit (lib/gate_checks.py).
    audits_agreement: ClassVar[bool] = False

    def __init__(self, task: TaskSpec) -> None:
        self.task = task

    # --- raw_prompts ------------------------------------------------------------------------------

    @staticmethod
    def read_file(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
        """A whole drop file's raw_prompts rows: records by default (a kind of another input format
        reads its own). A big file's shards are records, read by storage/shards.py."""
        return read_prompts(data, file_name, options)

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
