"""`("records", "generate")`: records whose fields fill the task's template, rendered with the
model's chat template; a chat model writes each row's label (choices, JSON schema, regex or free
text), validated by pipeline/validate_labels.py."""

from __future__ import annotations

from typing import Any

import polars as pl

from batch_assets.pipeline.engine_contract import Engine, EngineSettings
from batch_assets.pipeline.format_prompts import PromptFormat, Tokenizer, format_prompts, prompt_encoders
from batch_assets.pipeline.formats import InferenceStream, PartitionEncoders, TaskFormat
from batch_assets.pipeline.inference_requests import InferenceStats, PartitionInput
from batch_assets.pipeline.inputs.images import IMAGES_COLUMN
from batch_assets.pipeline.prompt_tokens import PROMPT_TOKEN_IDS
from batch_assets.pipeline.task_spec import TaskSpec


class ChatRecords(TaskFormat):
    """Records whose fields fill the task's template, rendered with the model's chat template; the
    chat model writes each row's label (pipeline/format_prompts.py)."""

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
