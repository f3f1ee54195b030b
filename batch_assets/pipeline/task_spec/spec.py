"""The whole task: its sections together (`TaskSpec`), with the rules that span sections, and
whether its context fits the model."""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import ConfigDict, field_validator, model_validator

from .base import SettingError, _Strict
from .checks import BudgetSpec, ChecksSpec
from .engine import EMBEDDED_EMBEDDING_MODEL, EMBEDDED_MODEL, EngineSpec
from .input import InputSpec
from .model_folders import ALLOW_LONG_MAX_MODEL_LEN_ENV, model_context_limit, model_folder_kind
from .output import OutputSpec, SamplingSpec
from .prompt import PromptSpec, example_answer_text
from .runs import AutomationSpec, CacheSpec, RunsSpec, SensorSpec

TASK_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


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
            output.get("kind") == "embedding" or output.get("method") in ("similarity", "cascade")
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
        what = "output.kind: embedding" if self.output.kind == "embedding" else f"output.method: {self.output.method}"
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
        if self.engine.lora is not None:
            raise SettingError(
                f"engine.lora: {what} runs an embedding model, which takes no LoRA adapter", ("engine", "lora")
            )
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
        if self.output.chat_teacher:
            return self  # the chat teacher reads the whole prompt; the embedding, the template alone
        # Few-shot examples are chat turns: an embedding has no conversation to put them in.
        for key in ("system", "raw_template", "examples", "raw_example_template"):
            if getattr(self.prompt, key):
                raise SettingError(
                    f"prompt.{key}: {what} embeds the template's text as it is (no chat prompt); remove prompt.{key}",
                    ("prompt", key),
                )
        return self

    @model_validator(mode="after")
    def _images_go_to_a_chat_model(self) -> TaskSpec:
        # Every engine kind takes images with a chat request: in process as multi-modal data with the
        # ids, an endpoint or batch API as `image_url` content parts. An embedding, similarity or
        # cascade task embeds text only, and a raw_template (completion-style) prompt has no place for
        # an image the model's processor or a chat API could fill.
        if self.input.image_fields and (self.output.method != "generate" or self.output.pooling):
            raise SettingError(
                "input.image_fields needs a chat task (output.kind text, choices or json); embeddings, "
                "similarity and cascades take text only",
                ("input", "image_fields"),
            )
        if self.input.image_fields and self.prompt is not None and self.prompt.raw_template is not None:
            raise SettingError(
                "input.image_fields needs the model's chat template to place the images; a prompt.raw_template "
                "(completion-style) has no place for them: remove prompt.raw_template",
                ("prompt", "raw_template"),
            )
        # An endpoint renders and counts prompts with `engine.tokenizer`, else with the model's own
        # folder, else with the embedded text model's tokenizer, which has no place for a picture.
        spec = self.engine
        if (
            self.input.image_fields
            and spec.kind in ("openai", "batch_api")
            and spec.tokenizer is None
            and not os.path.isdir(os.path.expanduser(spec.model))
        ):
            raise SettingError(
                f"engine.tokenizer: an image task on engine.kind {spec.kind} needs the tokenizer of the "
                "vision-language model its server runs (a local folder or a Hugging Face id whose chat template "
                "takes image parts, e.g. HuggingFaceTB/SmolVLM-256M-Instruct) to render and count its prompts; the "
                "default, the embedded text model's tokenizer, has no place for a picture",
                ("engine", "tokenizer"),
            )
        # URLs are fetched by the server an endpoint engine sends them to; the in-process engine
        # fetches nothing, and a records task's image fields read the drop zone and S3 only.
        if self.input.images.fetch_urls and (
            self.input.format != "openai_batch" or self.engine.kind not in ("openai", "batch_api")
        ):
            raise SettingError(
                "input.images.fetch_urls lets the server of an endpoint engine fetch the http(s) image URLs of "
                "OpenAI batch lines: it needs input.format: openai_batch and engine.kind openai or batch_api",
                ("input", "images", "fetch_urls"),
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
        if self.output.calibrate and not self.checks.gold_field:
            raise SettingError(
                "output.calibrate fits the confidence to known labels: set checks.gold_field to the input column "
                "holding them, or remove output.calibrate",
                ("output", "calibrate"),
            )
        if self.checks.min_agreement is not None and self.output.method != "cascade":
            raise SettingError(
                "checks.min_agreement applies to output.method: cascade (the audit's agreement with the teacher)",
                ("checks", "min_agreement"),
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


# engine.vllm_args that change the context a model takes (its config overridden at load, e.g. YaRN
# RoPE scaling through hf_overrides): the config's lengths say nothing then; vLLM's check at start decides.
_CONTEXT_OVERRIDES = frozenset({"hf_overrides"})


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
