"""Dagster code versions of a task's assets, derived from the settings that decide their outputs.

A task edit that can change an asset's output (prompt, template, model, sampling, output
constraint, an engine setting that changes outputs) changes that asset's code version, and Dagster
then shows the partitions materialized before the edit as stale. Settings that change only speed
(batch size, KV cache, concurrency, retries) leave the version as it is, so tuning does not force
a re-run. The version is a hash of the task's settings as its engine resolved them
(`ResolvedSettings`: a model or vLLM argument set on the engine's resource or in the environment
counts like one in the YAML, as it does in the checkpoint fingerprint): the same task and engine
settings give the same version in every process and after every restart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from batch_assets.pipeline.engine_contract import ResolvedSettings
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.pipeline.task_spec.batch_api import BATCH_API_FIELDS
from batch_assets.pipeline.task_spec.input import ImageLimits, InputSpec

# Raise when a change in this package's code changes what an asset writes for the same task.
PIPELINE_OUTPUT_VERSION = 1

# Fields of a task's `engine:` that change how fast outputs come, never what they are (vLLM's own
# arguments are sorted by the engines: engines/vllm_args.py). Every other field (including ones added
# later) counts as output-changing: a wrong "stale" costs a re-run that the result cache mostly
# serves, a wrong "fresh" would hide a change.
THROUGHPUT_ONLY_ENGINE_FIELDS = BATCH_API_FIELDS | frozenset(
    {
        "batch_size",
        "concurrency",
        "kv_cache_memory_gib",
        "max_retries",
        "request_timeout_s",
        "tensor_parallel_size",
        "data_parallel_size",
        "api_key_env",
        "price",
    }
)

VERSIONED_ASSETS = ("formatted_prompts", "inference_outputs", "validated_labels")


def _digest(parts: dict) -> str:
    text = json.dumps({"pipeline": PIPELINE_OUTPUT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def code_versions(task: TaskSpec, settings: ResolvedSettings) -> dict[str, str]:
    """The code version of each versioned asset of `task` run with `settings`, by asset name."""
    engine = task.engine.model_dump(exclude={*THROUGHPUT_ONLY_ENGINE_FIELDS, "vllm_args", "lora"})
    # vLLM arguments count like engine fields (dtype and seed were engine fields before vllm_args);
    # the engine's resolver left out those that change speed only.
    engine.update(settings.vllm_args)
    # An endpoint's unnamed model is the server's: its name is not known before the run, and the
    # resolved settings name the task's default for it.
    engine["model"] = settings.model
    engine["max_model_len"] = settings.max_model_len
    if settings.lora is not None:
        # The adapter's files (a hash), not its folder: changed weights make partitions stale, a copy
        # elsewhere does not. Absent without one, so other tasks keep their versions.
        engine["lora"] = settings.lora.identity
    formatting = {
        # How rows are grouped into partitions changes no row's prompt.
        # `truncate` only when on: tasks written before it keep their versions.
        # Image settings likewise only with image fields, or off their defaults (an openai_batch task's
        # limits on its lines' pictures), and `fetch_urls` only when on: other tasks keep their versions.
        "input": task.input.model_dump(exclude=_input_left_out(task.input)),
        "prompt": task.prompt.decision() if task.prompt is not None else None,
        # The tokenizer renders the chat template and counts tokens; the context decides which rows
        # are too long and max_tokens how much room they need.
        "tokenizer": {key: engine.get(key) for key in ("kind", "model", "tokenizer")},
        "max_model_len": settings.max_model_len,
        "max_tokens": task.sampling.max_tokens,
    }
    inference = {
        "formatting": formatting,
        "engine": engine,
        "sampling": task.sampling.model_dump(),
        "output": task.output.decision(),
    }
    if settings.teacher is not None:  # a cascade's chat teacher: its model decides labels too
        teacher = settings.teacher
        # An endpoint teacher's unnamed model counts as none here (as it always has: its versions stay).
        model = None if teacher.model_from_server else teacher.model
        inference["teacher"] = {"model": model, "max_model_len": teacher.max_model_len, **teacher.vllm_args}
    return {
        "formatted_prompts": _digest(formatting),
        "inference_outputs": _digest(inference),
        # Labels are parsed from the outputs: whatever changes the outputs changes them. (Dagster does
        # not mark a partition stale for an upstream partition's new code version alone.)
        "validated_labels": _digest({"inference": inference, "validation": _validation(task)}),
    }


def _validation(task: TaskSpec) -> dict[str, Any]:
    """What decides the labels besides the outputs. `confidence: false` drops a column and
    `calibrate: true` maps it, so they count, and only when set: other tasks keep their code versions."""
    validation = task.output.decision()
    if not task.output.confidence:
        validation["confidence"] = False
    if task.output.calibrate:
        # Fitted on the gold column's labels: another column, another calibration.
        validation["calibrate"] = {"gold_field": task.checks.gold_field}
    return validation


def _input_left_out(spec: InputSpec) -> dict[str, Any]:
    """The `input` settings that do not count in the code versions (see `formatting` above)."""
    left_out: dict[str, Any] = {"max_rows_per_partition": True}
    if not spec.truncate:
        left_out["truncate"] = True
    if not spec.image_fields:
        left_out["image_fields"] = True
    if not spec.image_fields and spec.images == ImageLimits():
        left_out["images"] = True
    elif not spec.images.fetch_urls:
        left_out["images"] = {"fetch_urls": True}
    return left_out
