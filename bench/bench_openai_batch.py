"""`batch-assets run openai_batch FILE` vs vLLM's own run-batch over the same OpenAI batch file.

    .venv/bin/python bench/bench_openai_batch.py --requests 3000 --runs 2 [--max-tokens 16] [--repeat-share 0]

Writes a batch file of distinct chat requests (temperature 0, the same `max_tokens` on every line),
then alternates (a) `python -m vllm.entrypoints.openai.run_batch -i FILE -o OUT` with the engine
settings the task's engine uses (model, context, KV cache, eager mode, no chunked prefill on a CPU)
and (b) `batch-assets run openai_batch FILE` in a fresh DAGSTER_HOME and data folder (no cache from
earlier runs). Both are new processes, timed from outside (engine start included on both sides).
Prints medians and the ratio (b)/(a), and checks that both answered every line the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
TOPICS = [
    "the moon",
    "rivers",
    "bread",
    "volcanoes",
    "bicycles",
    "owls",
    "glass",
    "tea",
    "maps",
    "clocks",
    "snow",
    "bees",
]


def batch_file(path: Path, requests: int, max_tokens: int, repeat_share: float) -> None:
    distinct = max(1, round(requests * (1 - repeat_share)))
    with path.open("w", encoding="utf-8") as handle:
        for i in range(requests):
            n = i % distinct
            question = f"Request {n}: tell me one short fact about {TOPICS[n % len(TOPICS)]}."
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            handle.write(
                json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
            )


def vllm_flags() -> list[str]:
    """vLLM CLI flags for the engine settings the openai_batch task runs with."""
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.pipeline.task_spec import load_task_specs

    task = {t.name: t for t in load_task_specs()}["openai_batch"]
    flags = []
    for name, value in VLLMEngine().settings(task).engine_args().items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags + ["--served-model-name", "bench"]


def answers(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        out[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    return out


def run(command: list[str], **kwargs) -> None:
    """Runs one side; on failure prints its output tail, which capture_output would otherwise hide."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"{command[:3]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def run_batch(source: Path, work: Path, flags: list[str]) -> tuple[float, dict[str, str]]:
    target = work / "run-batch-out.jsonl"
    started = time.perf_counter()
    run([sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(source), "-o", str(target), *flags])
    return time.perf_counter() - started, answers(target)


def pipeline(source: Path, work: Path) -> tuple[float, dict[str, str], dict]:
    env = {**os.environ, "DAGSTER_HOME": str(work / "home"), "BATCH_ASSETS_DATA": str(work / "data")}
    started = time.perf_counter()
    run([str(VENV_BIN / "batch-assets"), "run", "openai_batch", str(source)], env=env, cwd=work)
    wall = time.perf_counter() - started
    outputs = next((work / "data" / "storage" / "openai_batch" / "batch_output").glob("*.jsonl"))
    return wall, answers(outputs), inference_metadata(work / "home")


def inference_metadata(home: Path) -> dict:
    os.environ["DAGSTER_HOME"] = str(home)
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        record = instance.fetch_materializations(dg.AssetKey(["openai_batch", "inference_outputs"]), limit=1).records[0]
        return {k: v.value for k, v in record.asset_materialization.metadata.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeat-share", type=float, default=0.0, help="share of lines repeating an earlier request")
    args = parser.parse_args()
    flags = vllm_flags()
    peer_walls, our_walls, engine_seconds, mismatches = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-openai-batch-") as tmp:
        source = Path(tmp) / "requests.jsonl"
        batch_file(source, args.requests, args.max_tokens, args.repeat_share)
        for attempt in range(args.runs):
            peer_wall, theirs = run_batch(source, Path(tmp), flags)
            print(json.dumps({"run": attempt, "run_batch_wall_s": round(peer_wall, 1)}), flush=True)
            work = Path(tmp) / f"pipeline-{attempt}"
            work.mkdir()
            our_wall, ours, metadata = pipeline(source, work)
            peer_walls.append(peer_wall)
            our_walls.append(our_wall)
            engine_seconds.append(metadata["engine_seconds"])
            mismatches.append(sum(ours.get(k) != v for k, v in theirs.items()))
            print(
                json.dumps(
                    {
                        "run": attempt,
                        "run_batch_wall_s": round(peer_wall, 1),
                        "batch_assets_wall_s": round(our_wall, 1),
                        "batch_assets_engine_s": metadata["engine_seconds"],
                        "rows_deduplicated": metadata["rows_deduplicated"],
                        "answers_differing": mismatches[-1],
                    }
                ),
                flush=True,
            )
    peer, ours = statistics.median(peer_walls), statistics.median(our_walls)
    print(
        json.dumps(
            {
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "runs": args.runs,
                "run_batch_wall_s": round(peer, 1),
                "batch_assets_wall_s": round(ours, 1),
                "ratio": round(ours / peer, 3),
                "answers_differing": mismatches,
            }
        )
    )


if __name__ == "__main__":
    main()
