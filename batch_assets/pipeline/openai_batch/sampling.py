"""What one line asks of the engine: its sampling (the task's `sampling:` fills what the line
leaves out) and its output constraint (`response_format`, or vLLM's `structured_outputs` with a
`choice` or `regex`), and the canonical JSON of them that is part of its request key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec


class RequestSampling(SamplingSpec):
    """A line's sampling: the task's sampling fields plus the line's stop strings and, when it asks
    for `logprobs`, its `top_logprobs` (the alternatives per token returned with each sampled token's
    log-probability; None: not asked)."""

    stop: tuple[str, ...] | None = None
    logprobs: int | None = None


@dataclass(frozen=True)
class RequestSpec:
    """What one line asks of the engine, resolved against the task's defaults."""

    sampling: RequestSampling
    output: OutputSpec | None  # None: free text

    def params_json(self, sample_id: str | None) -> str:
        """Canonical JSON of everything besides the prompt that decides the output: part of the
        request key, so identical requests share a result and different sampling never does.
        `sample_id` makes a non-deterministic request (temperature > 0, no seed) its own."""
        value: dict[str, Any] = {
            # `logprobs` only when asked: the keys of lines without it stay as they were before it.
            "sampling": self.sampling.model_dump(exclude={"logprobs"} if self.sampling.logprobs is None else None),
            # `confidence` asks for log-probabilities only; it decides nothing of the output.
            "output": self.output.model_dump(exclude_none=True, exclude={"confidence"})
            if self.output is not None
            else None,
        }
        if sample_id is not None:
            value["sample"] = sample_id
        return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_params_json(cls, text: str) -> RequestSpec:
        value = json.loads(text)
        output = value.get("output")
        return cls(
            sampling=RequestSampling(**value["sampling"]),
            output=OutputSpec(**output) if output else None,
        )


def output_for(response_format: str | None) -> OutputSpec | None:
    """`response_format` as the structured-output constraint the engine enforces."""
    if response_format is None:
        return None
    value = json.loads(response_format)
    if value["type"] == "json_schema":
        return OutputSpec(kind="json_schema", json_schema=value["json_schema"]["schema"])
    if value["type"] == "json_object":
        # Any JSON object: the schema form of OpenAI's JSON mode.
        return OutputSpec(kind="json_schema", json_schema={"type": "object"})
    if value["type"] == "choice":
        return OutputSpec(kind="choices", choices=value["choice"], confidence=False)
    if value["type"] == "regex":
        return OutputSpec(kind="regex", regex=value["regex"], confidence=False)
    return None


def request_spec(row: dict, defaults: SamplingSpec) -> RequestSpec:
    def pick(field: str):
        return row[field] if row.get(field) is not None else getattr(defaults, field)

    sampling = RequestSampling(
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        max_tokens=pick("max_tokens"),
        seed=pick("seed"),
        stop=tuple(json.loads(row["stop"])) if row.get("stop") else None,
        logprobs=row.get("top_logprobs"),
    )
    return RequestSpec(sampling=sampling, output=output_for(row.get("response_format")))
