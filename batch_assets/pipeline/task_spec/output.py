"""`sampling:` and `output:`: how a label is sampled and what shape it must have (choices, a regex,
a JSON schema, free text, a vector), and the checks of those settings."""

from __future__ import annotations

import functools
import json
import re

# Python's own regex parser (the one `re.compile` uses): it knows the widths a pattern can match.
from re import _parser as _re_parser  # type: ignore[attr-defined]
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import MAX_COUNT, SettingError, _Strict
from .cascade import CascadeSpec, cascade_problem


class SamplingSpec(_Strict):
    temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=16, ge=1, le=MAX_COUNT)
    seed: int | None = None

    @property
    def deterministic(self) -> bool:
        return self.temperature == 0 or self.seed is not None


class OutputSpec(_Strict):
    """The output constraint, enforced by vLLM's structured outputs and checked afterwards.

    `kind: embedding` asks for no text at all: each row's text goes to the model's pooling runner and
    comes back as a vector. `method: similarity` on a choices task labels each row by the cosine
    similarity of its embedding to each choice's (the choice's name, or its `descriptions` entry).
    """

    kind: Literal["choices", "json_schema", "regex", "text", "embedding"]
    # `generate`: the chat model writes the label (structured outputs); `similarity`: choices task only.
    method: Literal["generate", "similarity", "cascade"] = "generate"
    # `method: cascade` (pipeline/cascade/run.py): a teacher labels a sample and the uncertain rows.
    cascade: CascadeSpec | None = None
    descriptions: dict[str, str] | None = None
    choices: list[str] | None = None
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    # Choices and regex labels get a `confidence` (the engine's token log-probabilities); `false`
    # saves their cost in the engine (a log-softmax over the vocabulary per generated token).
    confidence: bool = True
    # Choices and regex labels: `confidence` mapped through a calibration fitted on the partition's
    # gold rows (pipeline/calibration.py), the raw value kept in `raw_confidence`; needs checks.gold_field.
    calibrate: bool = False

    @field_validator("choices")
    @classmethod
    def _choices_are_distinct_labels(cls, choices: list[str] | None) -> list[str] | None:
        if choices is not None:
            check_choices(choices)
        return choices

    @field_validator("regex")
    @classmethod
    def _regex_can_match_a_label(cls, regex: str | None) -> str | None:
        if regex is not None:
            check_label_regex(regex)
        return regex

    @field_validator("json_schema")
    @classmethod
    def _json_schema_is_a_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            check_json_schema(schema)
        return schema

    @model_validator(mode="after")
    def _matches_kind(self) -> OutputSpec:
        needed = {"choices": self.choices, "json_schema": self.json_schema, "regex": self.regex}
        if self.kind in needed and not needed[self.kind]:
            # The missing entry has no line; the `kind` that asks for it has.
            raise SettingError(f"output kind {self.kind!r} needs a non-empty `{self.kind}` entry", ("kind",))
        if self.method == "similarity" and self.kind != "choices":
            raise SettingError(
                f"output.method similarity labels a choices task (by embedding similarity to each choice), not kind "
                f"{self.kind!r}: set output.kind: choices with output.choices, or remove output.method",
                ("method",),
            )
        if problem := cascade_problem(self.kind, self.method, self.cascade):
            raise SettingError(*problem)
        if self.descriptions is not None:
            check_descriptions(self.descriptions, self.choices or [], self.method)
        if "confidence" in self.model_fields_set and self.confidence and self.kind not in ("choices", "regex"):
            raise SettingError(
                "output.confidence applies to `kind: choices` or `regex` only "
                "(labels of free text and JSON tasks have no confidence)",
                ("confidence",),
            )
        if self.calibrate and not self.has_confidence:
            raise SettingError(
                "output.calibrate maps the labels' confidence: it needs `kind: choices` or `regex` with "
                "output.confidence on",
                ("calibrate",),
            )
        return self

    @property
    def has_confidence(self) -> bool:
        """Labels of a closed set (choices, a regex) get a confidence from the engine's token
        log-probabilities unless the task sets `confidence: false`; free text and JSON objects do
        not (their probability says little)."""
        return self.confidence and self.kind in ("choices", "regex")

    @property
    def chat_teacher(self) -> bool:
        """A cascade whose teacher is a chat model (`teacher: llm`): a chat engine beside the embedding one."""
        return self.cascade is not None and self.cascade.teacher == "llm"

    @property
    def pooling(self) -> bool:
        """The task runs on vLLM's pooling runner (an embedding model), not on a chat model."""
        return self.kind == "embedding" or self.method in ("similarity", "cascade")

    def decision(self) -> dict[str, Any]:
        """What decides the outputs: the constraint. Asking for log-probabilities does not change
        which tokens are sampled, so `confidence` is left out (checkpoints, cached results and code
        versions stay valid when it is switched), and so is `calibrate` (it maps the labels afterwards:
        code_versions counts it for validated_labels). `method` and `descriptions` are left out at
        their defaults, so tasks written before them keep their code versions. `cascade.max_training_rows`
        is left out too: it decides what `<task>/label_model` trains on when next materialized, not
        how a partition's rows are labelled with the model it finds; and `cascade.teacher_price`,
        which prices the labels, never makes them."""
        defaults = {"method"} if self.method == "generate" else set()
        defaults |= {"descriptions"} if self.descriptions is None else set()
        defaults |= {"cascade"} if self.cascade is None else set()
        exclude: dict[str, Any] = dict.fromkeys(("confidence", "calibrate", *defaults), True)
        if self.cascade is not None:
            # An unset target is left out too, so cascades written before it keep their code versions.
            exclude["cascade"] = {
                "max_training_rows",
                "teacher_price",
                # Without a target, on_unreachable plays no part: threshold cascades keep their versions.
                *(("target", "on_unreachable") if self.cascade.target is None else ()),
            }
        return self.model_dump(exclude=exclude)


def check_descriptions(descriptions: dict[str, str], choices: list[str], method: str) -> None:
    """`output.descriptions` says what each choice means for the similarity method: its keys are choices,
    its texts are not blank (a choice without one is embedded by its name)."""
    if method != "similarity":
        raise SettingError(
            "output.descriptions is used by output.method: similarity only (the texts choices are compared "
            "with); set method: similarity or remove it",
            ("descriptions",),
        )
    for key, text in descriptions.items():
        if key not in choices:
            raise SettingError(
                f"output.descriptions.{key}: {key!r} is not one of output.choices {choices}", ("descriptions", key)
            )
        if not isinstance(text, str) or not text.strip():
            raise SettingError(
                f"output.descriptions.{key}: the description is empty; write what the choice means, or remove "
                "the entry to compare with the choice's name",
                ("descriptions", key),
            )


def check_choices(choices: list[str]) -> None:
    """Each choice is a label the model must be able to spell and a reader tell apart: no empty or
    blank choice, no two that are the same once surrounding spaces are stripped."""
    seen: dict[str, int] = {}
    for index, choice in enumerate(choices):
        if not choice.strip():
            raise SettingError(
                f"output.choices.{index}: {choice!r} is empty or blank; every choice must be a visible label",
                (index,),
            )
        first = seen.setdefault(choice.strip(), index)
        if first != index:
            same = "repeats" if choices[first] == choice else "differs only in surrounding spaces from"
            raise SettingError(
                f"output.choices.{index}: {choice!r} {same} choice {first} ({choices[first]!r}); "
                "choices must be distinct",
                (index,),
            )


def check_label_regex(regex: str) -> None:
    """The regex must compile with Python's `re` (labels are checked with `re.fullmatch`) and be able
    to match a non-empty label.

    Python's own regex parser gives the widths a pattern can match: a maximum of 0 means the
    regex matches the empty string only, or nothing (`^$`, `()`, `a{0}`, `(?!)`): every label
    would be empty or invalid. Deciding in general whether a pattern matches any string at all
    needs an automaton (the ones structured-output libraries build cost time exponential in
    counted repetitions such as `[a-z]{1,5000}`, and do not model anchors, lookarounds or
    back-references), which a task load must not pay; width 0 is exact and costs nothing.
    """
    try:
        re.compile(regex)
    except re.error as exc:
        raise SettingError(f"output.regex: not a valid regular expression: {exc}") from None
    _, longest = _re_parser.parse(regex).getwidth()
    if longest == 0:
        raise SettingError(
            f"output.regex: {regex!r} can only match the empty string (or nothing), so every label would be "
            "empty or invalid; write the pattern of a label, e.g. [A-Z]{3}-[0-9]+"
        )


def check_json_schema(schema: dict[str, Any]) -> None:
    """The schema must be a valid JSON Schema (checked against its metaschema, the draft its
    `$schema` names or the latest): a typo such as `type: objekt` would otherwise reach vLLM's
    grammar compiler and fail every partition there, naming no file or key."""
    import jsonschema

    if "$schema" in schema and not isinstance(schema["$schema"], str):
        # jsonschema looks the dialect up by this URI and fails with an AttributeError on anything else.
        raise SettingError("output.json_schema.$schema: must be a string (a JSON Schema dialect URI)", ("$schema",))
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f".{part}" for part in exc.absolute_path)
        raise SettingError(
            f"output.json_schema{where}: not a valid JSON schema: {exc.message}", tuple(exc.absolute_path)
        ) from None


@functools.lru_cache(maxsize=32)
def _schema_validator(schema_json: str):
    """One validator per schema: labels are checked row by row against the same one."""
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(schema_json))


def schema_error(value: Any, schema: dict) -> str | None:
    """Why `value` does not fit the task's JSON schema (None when it does): for generated labels and
    for few-shot answers alike."""
    import jsonschema

    best = jsonschema.exceptions.best_match(_schema_validator(json.dumps(schema, sort_keys=True)).iter_errors(value))
    if best is None:
        return None
    where = "/".join(str(p) for p in best.absolute_path) or "(root)"
    return f"schema_mismatch: at {where}: {best.message[:160]}"
