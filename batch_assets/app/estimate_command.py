"""`batch-assets estimate TASK FILE...`: what each file would cost, before anything runs.

Each file is read and formatted as its run would read and format it (the task's parser, template and
tokenizer: the same `num_prompt_tokens` the run's `prompt_tokens` sums), then estimated by
lib/estimates.py. No engine is started and no request is sent: the in-process engine's tokenizer is
read from the model's files, an endpoint's from its local tokenizer. Nothing is copied into the drop
zone and no partition is registered.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batch_assets.app.runner import RunRefused, loaded_task
from batch_assets.engines.kinds import engine_for, resolve_settings
from batch_assets.lib.assets import inference_fingerprint, parse_options
from batch_assets.lib.estimates import PartitionEstimate, cached_keys_in, estimate_lines, task_history
from batch_assets.pipeline.inputs.read_prompts import read_prompts
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpecError
from batch_assets.runtime.instance import open_instance
from batch_assets.storage.drop_zone_copies import read_named_files


def command_estimate(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """Prints each file's estimate (and a total for several); exit 0, or 2 for a refusal (raised)."""
    from batch_assets.lib.estimates import estimate_partition

    task = loaded_task(args.task, args.source)
    if task.input.image_fields:
        raise RunRefused(f"task {task.name!r} reads images: `estimate` does not count image tokens yet")
    named = read_named_files([Path(file) for file in args.files])
    definitions = args.source.definitions()
    try:
        resolve_settings(task, definitions.resources)
    except TaskSpecError as exc:
        raise RunRefused(str(exc)) from None
    engine: Any = engine_for(_Resources(definitions.resources), task)
    # An endpoint that is asked which model it serves would be sent a request: not here.
    settings = engine.settings(task, offline=True) if task.engine.kind != "vllm" else engine.settings(task)
    tokenizer = engine.tokenizer(settings)
    fmt = task_format(task)
    if settings.tokenizer_note:
        say(f"note: {settings.tokenizer_note}")
    with open_instance() as instance:
        history = task_history(instance, task.name)
        cached = cached_keys_in(task.name, inference_fingerprint(fmt, settings), instance)
        estimates = []
        for file in named:
            raw = read_prompts(file.content, file.path.name, parse_options(task))
            formatted = fmt.format(raw, engine, tokenizer, settings, source_file=file.key)
            estimate = estimate_partition(formatted, fmt, settings, history, cached)
            estimates.append(estimate)
            for line in estimate_lines(f"{task.name}/{file.path.name}", estimate):
                say(line)
    if len(estimates) > 1:
        say(total_line(estimates))
    return 0


def total_line(estimates: list[PartitionEstimate]) -> str:
    """The files together: rows, prompt tokens, the most generated tokens and the worst cost."""
    rows = sum(e.rows for e in estimates)
    prompt = sum(e.worst.prompt_tokens for e in estimates)
    generated = sum(e.worst.max_generated_tokens for e in estimates)
    costs = [e.worst.cost_usd for e in estimates if e.worst.cost_usd is not None]
    cost = f", cost at most ${sum(costs):,.6f}" if costs else ""
    return (
        f"total of {len(estimates)} files: {rows:,} rows, {prompt:,} prompt tokens, "
        f"at most {generated:,} generated tokens{cost}"
    )


class _Resources:
    """A definitions' resources by attribute, as an asset's context offers them to `engine_for`."""

    def __init__(self, resources: dict) -> None:
        self._resources = resources

    def __getattr__(self, name: str):
        return self._resources[name]
