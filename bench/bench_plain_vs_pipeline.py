"""Plain vLLM script vs `batch-assets run`, side by side on the same customers CSV.

    .venv/bin/python bench/bench_plain_vs_pipeline.py --rows 3000 --runs 3 [--repeat-share 0.3] [--no-confidence]
    .venv/bin/python bench/bench_plain_vs_pipeline.py --model tiny --rows 20000 --runs 3 --profile

Each run alternates (a) bench/plain_vllm_script.py and (b) `batch-assets run industry FILE` in a
fresh DAGSTER_HOME and data folder (no cache from earlier runs), both as new processes, wall time
measured from outside. Both do the same engine work: the industry task's structured choices and,
unless --no-confidence, the sampled token's log-probability (the pipeline's confidence). Engine
phase: the plain script's `LLM.chat` seconds vs the inference asset's `inference_seconds` metadata
(tokenization, engine calls and checkpoint writes). Peak RSS: of each side's own process (not the
engine core's), sampled every 0.1 s. Medians, and ratios.

`--model tiny`: the tests' 2-layer random-weight Llama (batch_assets_tests/tiny_model.py), so small
that vLLM labels hundreds of rows a second here and the pipeline's own cost per row shows.
`--engine-env`: the engine processes' environment on both sides. `shipped` (default): each side as
users run it: the plain script with vLLM's defaults (vLLM's sampler compiles its log-probability rank
counter), the pipeline with what it sets on a CPU (engines/vllm_lifecycle.py `engine_process_environment`:
the counter eager, `TORCHDYNAMO_DISABLE=1`, for a stream under 10,000 requests, else compiled).
`eager` / `compiled`: both sides the same (`TORCHDYNAMO_DISABLE=1` / `0`, which the pipeline leaves
as set), so the ratio is the pipeline's own cost and not the rank counter's (~45 ms per 256-row step
eagerly vs ~4 ms compiled here: about a tenth of a step of the tiny model; bench_rank_counter.py).
`--profile`: one more pipeline run under py-spy (`pip install py-spy`), every thread of the
`batch-assets` process, and the functions where it spends its samples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent


def run_measured(command: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, float]:
    """(finished process, wall seconds, peak RSS in MiB of the process itself, sampled every 0.1 s).
    Output goes through temporary files: a full pipe would stall the process while we sample it."""
    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, **kwargs)
        peak = 0
        watched = psutil.Process(process.pid)
        while process.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, watched.memory_info().rss)
            time.sleep(0.1)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        finished = subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())
    return finished, wall, peak / 2**20


ENGINE_ENVIRONMENTS: dict[str, dict[str, str]] = {
    "shipped": {},
    "eager": {"TORCHDYNAMO_DISABLE": "1"},
    "compiled": {"TORCHDYNAMO_DISABLE": "0"},
}


def plain(csv_path: Path, work: Path, logprobs: bool, engine_env: dict[str, str]) -> dict:
    command = [sys.executable, str(HERE / "plain_vllm_script.py"), str(csv_path), str(work / "plain.parquet")]
    out, wall, rss = run_measured([*command, "--logprobs"] if logprobs else command, env={**os.environ, **engine_env})
    if out.returncode != 0:
        raise SystemExit(f"plain script failed:\n{(out.stdout + out.stderr)[-4000:]}")
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    return {
        "wall": wall,
        "engine_rows_per_s": result["rows"] / result["chat_seconds"],
        "tokens_per_s": result["generated_tokens"] / result["chat_seconds"],
        "peak_rss_mib": rss,
    }


def tasks_without_confidence(folder: Path) -> Path:
    """The bundled tasks, industry with `output.confidence: false` (no log-probabilities asked)."""
    import yaml

    from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR

    shutil.copytree(BUNDLED_TASKS_DIR, folder)
    industry = yaml.safe_load((folder / "industry.yaml").read_text(encoding="utf-8"))
    industry["output"]["confidence"] = False
    (folder / "industry.yaml").write_text(yaml.safe_dump(industry, sort_keys=False), encoding="utf-8")
    return folder


def pipeline_env(work: Path, tasks_dir: Path | None, engine_env: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **engine_env}
    env.update(DAGSTER_HOME=str(work / "home"), BATCH_ASSETS_DATA=str(work / "data"))
    if tasks_dir is not None:
        env["BATCH_ASSETS_TASKS_DIR"] = str(tasks_dir)
    return env


def pipeline(csv_path: Path, work: Path, tasks_dir: Path | None, engine_env: dict[str, str]) -> dict:
    done, wall, rss = run_measured(
        [str(VENV_BIN / "batch-assets"), "run", "industry", str(csv_path)],
        env=pipeline_env(work, tasks_dir, engine_env),
        cwd=work,
    )
    if done.returncode != 0:  # say why, instead of a bare CalledProcessError
        raise SystemExit(f"batch-assets run failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    metadata = inference_metadata(work / "home")
    seconds = metadata.get("inference_seconds", metadata["engine_seconds"])
    return {
        "wall": wall,
        "engine_rows_per_s": metadata["rows"] / seconds,
        "tokens_per_s": metadata["generated_tokens"] / seconds,
        "rows_deduplicated": metadata["rows_deduplicated"],
        "peak_rss_mib": rss,
    }


def profile(csv_path: Path, work: Path, tasks_dir: Path | None, engine_env: dict[str, str], top: int = 30) -> None:
    """One pipeline run under py-spy (all threads, idle samples left out); the functions with the most
    samples of their own, and the batch_assets functions with the most samples under them."""
    output = work / "profile.txt"
    command = [str(VENV_BIN / "batch-assets"), "run", "industry", str(csv_path)]
    spy = [str(VENV_BIN / "py-spy"), "record", "--rate", "200", "--format", "raw", "--output", str(output), "--"]
    subprocess.run(
        spy + command, env=pipeline_env(work, tasks_dir, engine_env), cwd=work, capture_output=True, check=True
    )
    own: dict[str, int] = {}
    under: dict[str, int] = {}
    total = 0
    for line in output.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        samples = int(count)
        total += samples
        own[frames[-1]] = own.get(frames[-1], 0) + samples
        for frame in set(frames):
            if "batch_assets" in frame:
                under[frame] = under.get(frame, 0) + samples
    print(f"\npy-spy: {total} samples of the batch-assets process (all threads, 200/s); own samples:")
    for frame, samples in sorted(own.items(), key=lambda item: -item[1])[:top]:
        print(f"  {100 * samples / total:5.1f} %  {frame}")
    print("batch_assets functions, samples under them:")
    for frame, samples in sorted(under.items(), key=lambda item: -item[1])[:top]:
        print(f"  {100 * samples / total:5.1f} %  {frame}")


def inference_metadata(home: Path) -> dict:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        record = instance.fetch_materializations(dg.AssetKey(["industry", "inference_outputs"]), limit=1).records[0]
        return {key: value.value for key, value in record.asset_materialization.metadata.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat-share", type=float, default=0.0)
    parser.add_argument(
        "--no-confidence", action="store_true", help="the pipeline's industry task with `output.confidence: false`"
    )
    parser.add_argument("--model", help="a model folder for both sides, or `tiny` (default: the task's model)")
    parser.add_argument("--profile", action="store_true", help="one more pipeline run under py-spy")
    parser.add_argument(
        "--engine-env",
        choices=sorted(ENGINE_ENVIRONMENTS),
        default="shipped",
        help="the engine processes' environment on both sides (see above)",
    )
    args = parser.parse_args()
    if args.model:
        os.environ["BATCH_ASSETS_MODEL"] = tiny_model() if args.model == "tiny" else args.model
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / f"customers-{args.rows}.csv"
        subprocess.run(
            [
                sys.executable,
                str(HERE / "generate_customers.py"),
                str(args.rows),
                str(csv_path),
                "--repeat-share",
                str(args.repeat_share),
            ],
            check=True,
        )
        tasks_dir = tasks_without_confidence(Path(tmp) / "tasks") if args.no_confidence else None
        plains, pipes = [], []
        for index in range(args.runs):
            for kind, bucket in (("plain", plains), ("pipeline", pipes)):
                work = Path(tmp) / f"{kind}-{index}"
                work.mkdir()
                engine_env = ENGINE_ENVIRONMENTS[args.engine_env]
                bucket.append(
                    plain(csv_path, work, not args.no_confidence, engine_env)
                    if kind == "plain"
                    else pipeline(csv_path, work, tasks_dir, engine_env)
                )
                print(
                    f"run {index + 1} {kind}: {json.dumps({k: round(v, 2) for k, v in bucket[-1].items()})}", flush=True
                )

        def med(rows: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in rows)

        print(
            f"\nrows {args.rows}, repeat share {args.repeat_share}, engine env {args.engine_env} "
            f"{ENGINE_ENVIRONMENTS[args.engine_env]}, {args.runs} runs each, medians:"
        )
        print(
            f"  plain script : wall {med(plains, 'wall'):7.1f} s  "
            f"engine {med(plains, 'engine_rows_per_s'):6.1f} rows/s  "
            f"{med(plains, 'tokens_per_s'):7.1f} gen tok/s"
        )
        print(
            f"  batch-assets : wall {med(pipes, 'wall'):7.1f} s  engine {med(pipes, 'engine_rows_per_s'):6.1f} rows/s  "
            f"{med(pipes, 'tokens_per_s'):7.1f} gen tok/s  (deduplicated rows {med(pipes, 'rows_deduplicated'):.0f})"
        )
        print(
            f"  ratios       : wall pipeline/plain {med(pipes, 'wall') / med(plains, 'wall'):.3f}   "
            f"engine rows/s pipeline/plain {med(pipes, 'engine_rows_per_s') / med(plains, 'engine_rows_per_s'):.3f}"
        )
        pairs = [b["engine_rows_per_s"] / a["engine_rows_per_s"] for a, b in zip(plains, pipes, strict=True)]
        print(
            f"  engine rows/s pipeline/plain pair by pair: {', '.join(f'{ratio:.3f}' for ratio in pairs)}; "
            f"median {statistics.median(pairs):.3f}"
        )
        print(
            f"  rows/s whole process: plain {args.rows / med(plains, 'wall'):.1f}, "
            f"batch-assets {args.rows / med(pipes, 'wall'):.1f}"
        )
        for name, results in (("plain script", plains), ("batch-assets", pipes)):
            rss = med(results, "peak_rss_mib")
            print(f"  peak RSS {name}: {rss:.0f} MiB, {rss * 1024 / args.rows:.2f} KiB per row")
        if args.profile:
            work = Path(tmp) / "profile"
            work.mkdir()
            profile(csv_path, work, tasks_dir, ENGINE_ENVIRONMENTS[args.engine_env])


def tiny_model() -> str:
    """The tests' tiny random-weight model, built once into .venv like the tests do."""
    sys.path.insert(0, str(HERE.parent))
    from batch_assets_tests.tiny_model import built_tiny_model

    return str(built_tiny_model())


if __name__ == "__main__":
    main()
