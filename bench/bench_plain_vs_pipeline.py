"""Plain vLLM script vs `batch-assets run`, side by side on the same customers CSV.

    .venv/bin/python bench/bench_plain_vs_pipeline.py --rows 3000 --runs 3 [--repeat-share 0.3] [--no-confidence]

Each run alternates (a) bench/plain_vllm_script.py and (b) `batch-assets run industry FILE` in a
fresh DAGSTER_HOME and data folder (no cache from earlier runs), both as new processes, wall time
measured from outside. Engine phase: the plain script's `LLM.chat` seconds vs the inference asset's
`inference_seconds` metadata (tokenization, engine calls and checkpoint writes). Medians, and ratios.
"""

from __future__ import annotations

import argparse
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


def plain(csv_path: Path, work: Path) -> dict:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(HERE / "plain_vllm_script.py"), str(csv_path), str(work / "plain.parquet")],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - started
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    return {
        "wall": wall,
        "engine_rows_per_s": result["rows"] / result["chat_seconds"],
        "tokens_per_s": result["generated_tokens"] / result["chat_seconds"],
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


def pipeline(csv_path: Path, work: Path, tasks_dir: Path | None = None) -> dict:
    env = {**os.environ, "DAGSTER_HOME": str(work / "home"), "BATCH_ASSETS_DATA": str(work / "data")}
    if tasks_dir is not None:
        env["BATCH_ASSETS_TASKS_DIR"] = str(tasks_dir)
    started = time.perf_counter()
    done = subprocess.run(
        [str(VENV_BIN / "batch-assets"), "run", "industry", str(csv_path)],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:  # say why, instead of a bare CalledProcessError
        raise SystemExit(f"batch-assets run failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    wall = time.perf_counter() - started
    metadata = inference_metadata(work / "home")
    seconds = metadata.get("inference_seconds", metadata["engine_seconds"])
    return {
        "wall": wall,
        "engine_rows_per_s": metadata["rows"] / seconds,
        "tokens_per_s": metadata["generated_tokens"] / seconds,
        "rows_deduplicated": metadata["rows_deduplicated"],
    }


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
    args = parser.parse_args()
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
                bucket.append(plain(csv_path, work) if kind == "plain" else pipeline(csv_path, work, tasks_dir))
                print(
                    f"run {index + 1} {kind}: {json.dumps({k: round(v, 2) for k, v in bucket[-1].items()})}", flush=True
                )

        def med(rows: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in rows)

        print(f"\nrows {args.rows}, repeat share {args.repeat_share}, {args.runs} runs each, medians:")
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


if __name__ == "__main__":
    main()
