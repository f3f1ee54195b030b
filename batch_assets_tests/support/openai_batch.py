"""OpenAI batch files in tests: request lines, a file's bytes, one run of a batch task through Dagster,
and vLLM's own run-batch on the same lines (from its golden file when the key matches).

The peer runs `python -m vllm.entrypoints.openai.run_batch` with the engine arguments the in-process
engine uses for the task, so the two can be compared line by line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl

from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.openai_batch.formatting import format_batch_prompts
from batch_assets.pipeline.openai_batch.lines import read_batch_requests
from batch_assets.pipeline.task_spec import SamplingSpec, TaskSpec, load_task_specs
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import drop
from batch_assets_tests.support.golden import content_digest, kept_or_made, versions

TASK = "openai_batch"
# The sampling defaults the formatting tests share (format_lines).
DEFAULTS = SamplingSpec(temperature=0, top_p=1.0, max_tokens=64)


def chat(custom_id: str, text: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], **body},
    }


def as_jsonl(lines: list[dict | str]) -> str:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)


def materialize(data: Path, name: str, content: str, instance: dg.DagsterInstance, task: str = TASK):
    drop(data, task, name, content)
    key = partition_key_for(name)
    instance.add_dynamic_partitions(partitions_def_name(task), [key])
    result = (
        build_definitions()
        .resolve_job_def(pipeline_job_name(task))
        .execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
    )
    assert result.success, [e.step_failure_data.error.to_string() for e in result.all_events if e.is_step_failure]
    return key, result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def engine_flags(task: TaskSpec) -> list[str]:
    """The command-line flags of vLLM's run-batch and serve for the engine arguments the in-process
    engine uses for `task` (its model included)."""
    args = []
    for name, value in VLLMEngine().settings(task).engine_args().items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            args += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return args


def golden_key_of(args: list[str], lines: list[dict], served: str) -> list:
    """What decides run-batch's answers: the versions, the engine flags (the model as its files'
    digest, the same weights anywhere), the served name and the requests."""
    model = args[args.index("--model") + 1]
    portable = [content_digest(Path(arg)) if arg == model and Path(arg).is_dir() else arg for arg in args]
    return [{**versions(), "args": portable, "served": served}, lines]


def run_vllm_batch(lines: list[dict], work: Path, task_name: str = TASK, served: str = "tiny") -> dict[str, dict]:
    """vLLM's own run-batch over `lines`, with the engine settings the task's engine uses, serving
    the model under the name `served`: from its golden file when that was made for the same key."""
    task = {t.name: t for t in load_task_specs()}[task_name]
    args = engine_flags(task)
    return kept_or_made(
        f"run_batch-{task_name}-{served}.json",
        golden_key_of(args, lines, served),
        lambda: _run_vllm_batch(lines, work, args, served),
        made_of="weights or requests",
    )


def _run_vllm_batch(lines: list[dict], work: Path, args: list[str], served: str) -> dict[str, dict]:
    source, target = work / "peer-in.jsonl", work / "peer-out.jsonl"
    source.write_text(as_jsonl(lines), encoding="utf-8")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(source), "-o", str(target)]
    completed = subprocess.run(
        [*command, *args, "--served-model-name", served], capture_output=True, text=True, env=env, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return {record["custom_id"]: record for record in read_jsonl(target)}


def chat_line(custom_id: str, messages: list[dict] | None = None, **body) -> dict:
    messages = messages if messages is not None else [{"role": "user", "content": f"question {custom_id}"}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": messages, **body},
    }


def jsonl(*lines: dict | str) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode("utf-8")


def format_lines(data: bytes, tokenizer, **options) -> pl.DataFrame:
    """A batch file's lines, read and formatted with the defaults these tests share."""
    return format_batch_prompts(
        read_batch_requests(data, "in.jsonl"),
        tokenizer,
        sampling_defaults=DEFAULTS,
        max_model_len=512,
        source_file="in.jsonl",
        **options,
    )


def answer_differences(lines: list[dict], by_id: dict[str, dict], peer: dict[str, dict]) -> list[str]:
    """The lines whose answer (text, finish reason, prompt and completion tokens) is not the same in
    our output lines `by_id` as in the peer's (both by custom_id), each described; every peer line answered."""
    differences = []
    for line in lines:
        ours, theirs = by_id[line["custom_id"]]["response"]["body"], peer[line["custom_id"]]["response"]["body"]
        assert peer[line["custom_id"]]["error"] is None
        usage = ("prompt_tokens", "completion_tokens")
        mine = (
            ours["choices"][0]["message"]["content"],
            ours["choices"][0]["finish_reason"],
            *(ours["usage"][k] for k in usage),
        )
        other = (
            theirs["choices"][0]["message"]["content"],
            theirs["choices"][0]["finish_reason"],
            *(theirs["usage"][k] for k in usage),
        )
        if mine != other:
            differences.append(
                f"{line['custom_id']}: ours {mine[0][:80]!r} {mine[1:]}, run-batch {other[0][:80]!r} {other[1:]}"
            )
    return differences
