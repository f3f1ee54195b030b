"""`prompt:`: the system prompt, the user template, few-shot examples and the raw (no chat template)
formats, each checked where a typo would otherwise fail every row."""

from __future__ import annotations

import json
import re
import string
from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import SettingError, _Strict
from .output import OutputSpec, schema_error


def template_placeholders(template: str, setting: str) -> set[str]:
    """The field names of a prompt template; anything but plain `{name}` placeholders is refused.

    Templates are filled column-wise, so `{}` / `{0}` (positional), `{text!r}` (conversion),
    `{text:>10}` (format spec) and `{text.attr}` / `{text[0]}` (attribute or index access) could
    only fail later, on every row of every run; the message names the placeholder and the setting.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{setting}: not a valid template ({exc}); write a literal brace as {{{{ or }}}}") from None
    names: set[str] = set()
    for _, name, format_spec, conversion in parsed:
        if name is None:
            continue
        placeholder = "{" + name + (f"!{conversion}" if conversion else "") + (f":{format_spec}" if format_spec else "")
        placeholder += "}"
        if not name or name.isdigit():
            problem = "positional placeholders are not supported; name an input field, e.g. {text}"
        elif conversion:
            problem = "conversions (!r, !s, !a) are not supported; write {" + name + "}"
        elif format_spec:
            problem = "format specs are not supported; write {" + name.split(".")[0].split("[")[0] + "}"
        elif not name.isidentifier():
            problem = "attribute and index access are not supported; name an input field, e.g. {text}"
        else:
            names.add(name)
            continue
        raise ValueError(f"{setting}: placeholder {placeholder}: {problem} (a literal brace is written {{{{ or }}}})")
    return names


class ExampleSpec(_Strict):
    """One few-shot example: the input fields the template uses, and the answer expected for them."""

    input: dict[str, str]
    # The label as the model should give it: a choice, a regex match, free text; for a json_schema
    # task a JSON text or a YAML mapping / list (the JSON value). Checked against `output` by TaskSpec.
    answer: Any

    @model_validator(mode="before")
    @classmethod
    def _fields_go_under_input(cls, raw: Any) -> Any:
        # `- {text: ..., answer: ...}` is the likely first try; say where the fields go.
        if isinstance(raw, dict) and "input" not in raw and raw.keys() - {"answer"}:
            field = sorted(str(key) for key in raw.keys() - {"answer"})[0]
            raise SettingError(
                f"put the example's fields under `input:` and its expected answer under `answer:`, "
                f"e.g. {{input: {{{field}: ...}}, answer: ...}}",
                (field,),
            )
        return raw


# How each example is written into `prompt.raw_template`'s `{examples}` (models without a chat template).
DEFAULT_RAW_EXAMPLE_TEMPLATE = "{user}\n{answer}\n\n"


class PromptSpec(_Strict):
    """System prompt and user template; `{field}` placeholders name input fields."""

    system: str = ""
    template: str
    # For models without a chat template (e.g. Llama 2 / Mistral `[INST]` formats): a plain
    # format string over `{system}`, `{user}` (and `{examples}`) used instead of the tokenizer's
    # chat template.
    raw_template: str | None = None
    # Few-shot examples, rendered before the row's message as earlier user / assistant turns
    # (or, with `raw_template`, each through `raw_example_template` into `{examples}`).
    examples: list[ExampleSpec] = Field(default_factory=list)
    raw_example_template: str | None = None

    @field_validator("template")
    @classmethod
    def _template_has_plain_placeholders(cls, template: str) -> str:
        template_placeholders(template, "prompt.template")
        return template

    @field_validator("raw_template")
    @classmethod
    def _raw_template_uses_system_and_user(cls, raw_template: str | None) -> str | None:
        if raw_template is not None:
            unknown = template_placeholders(raw_template, "prompt.raw_template") - {"system", "user", "examples"}
            if unknown:
                raise ValueError(
                    f"prompt.raw_template: use only {{system}}, {{user}} and {{examples}}, not {sorted(unknown)}"
                )
        return raw_template

    @field_validator("raw_example_template")
    @classmethod
    def _raw_example_template_uses_user_and_answer(cls, template: str | None) -> str | None:
        if template is not None:
            used = template_placeholders(template, "prompt.raw_example_template")
            if used != {"user", "answer"}:
                raise ValueError(
                    f"prompt.raw_example_template: use {{user}} and {{answer}}, each at least once (it uses "
                    f"{sorted(used)}), e.g. {DEFAULT_RAW_EXAMPLE_TEMPLATE!r}"
                )
        return template

    @model_validator(mode="after")
    def _examples_fill_the_template(self) -> PromptSpec:
        used = self.placeholders()
        for index, example in enumerate(self.examples):
            check_example_input(index, example.input, used)
        return self

    @model_validator(mode="after")
    def _raw_template_has_a_place_for_examples(self) -> PromptSpec:
        if self.raw_example_template is not None and self.raw_template is None:
            raise SettingError(
                "prompt.raw_example_template applies with prompt.raw_template only "
                "(a chat template renders the examples as earlier turns): remove it",
                ("raw_example_template",),
            )
        if self.examples and self.raw_template is not None and "examples" not in self.raw_template_placeholders():
            # Without the placeholder the examples would be dropped from every prompt, silently.
            raise SettingError(
                "prompt.raw_template: add {examples} where prompt.examples go (e.g. before {user}); "
                "each is written as prompt.raw_example_template",
                ("raw_template",),
            )
        return self

    def placeholders(self) -> set[str]:
        return template_placeholders(self.template, "prompt.template")

    def raw_template_placeholders(self) -> set[str]:
        return template_placeholders(self.raw_template or "", "prompt.raw_template")

    def decision(self) -> dict[str, Any]:
        """What decides the prompts, for code versions. The example settings count only when set:
        a task without examples keeps the code versions it had before they existed."""
        unset = {key for key in ("examples", "raw_example_template") if not getattr(self, key)}
        return self.model_dump(exclude=unset)


def check_example_input(index: int, fields: dict[str, str], used: set[str]) -> None:
    """An example gives every field the template uses, each with text, and no other field (a typo
    in a field name would otherwise leave the real field missing, or be ignored)."""
    where = f"prompt.examples.{index}.input"
    missing = sorted(used - fields.keys())
    if missing:
        raise SettingError(
            f"{where}: has no field {missing[0]!r}; prompt.template uses {{{missing[0]}}}, so every example needs it",
            ("examples", index, "input"),
        )
    for field in fields:
        if field not in used:
            raise SettingError(
                f"{where}.{field}: not a field prompt.template uses ({', '.join(sorted(used))}): "
                "remove it or fix its name",
                ("examples", index, "input", field),
            )
        if not fields[field].strip():
            raise SettingError(
                f"{where}.{field}: is empty; an example needs the text a row would have",
                ("examples", index, "input", field),
            )


def example_answer_text(answer: Any, output: OutputSpec) -> str:
    """An example's answer as the model is asked to produce it (the assistant turn), refused where
    the task's output could not be it: a choices task answers with one of the choices, a regex task
    with a full match, a json_schema task with JSON valid against the schema (written back as one
    line of JSON, keys in the order given), a text task with any non-empty text."""
    if output.kind == "json_schema":
        return _json_answer_text(answer, output.json_schema or {})
    if not isinstance(answer, str):
        raise ValueError(f"must be text, not {type(answer).__name__} (quote it in the YAML)")
    if output.kind == "choices" and answer not in (output.choices or []):
        raise ValueError(f"{answer!r} is not one of output.choices {output.choices}")
    if output.kind == "regex" and not re.fullmatch(output.regex or "", answer):
        raise ValueError(f"{answer!r} does not match output.regex {output.regex!r}")
    if not answer.strip():
        raise ValueError("is empty; write the answer the model should give")
    return answer


def _json_answer_text(answer: Any, schema: dict[str, Any]) -> str:
    value = answer
    if isinstance(answer, str):
        try:
            value = json.loads(answer)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"not valid JSON ({exc.msg} at column {exc.colno}); or write it as a YAML mapping"
            ) from None
    elif answer is None:
        raise ValueError("is empty; write the JSON the model should give")
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:  # a YAML date, or .nan
        raise ValueError(f"not a JSON value ({exc}); quote dates and write numbers as numbers") from None
    # Checked as validated_labels checks a generated label, so an example is a label the task accepts.
    error = schema_error(json.loads(text), schema)
    if error:
        raise ValueError(f"does not fit output.json_schema: {error.removeprefix('schema_mismatch: ')}")
    return text
