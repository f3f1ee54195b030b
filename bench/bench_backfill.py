"""Engine start-up over a backfill: one run per partition, each in a process of its own (as Dagster's
run launcher starts them), with the engine inside each run vs the shared engine host.

    .venv/bin/python bench/bench_backfill.py --partitions 20 --rows 50

Each side gets a fresh DAGSTER_HOME, data folder and engine-host folder, and the same 20 customers
files (distinct seeds, so the result cache has little to reuse either way). Runs are started one
after another with `batch-assets run industry FILE`, one process each. Engine starts are counted
from the inference asset's metadata (`engine_started_by_this_run`), not assumed.
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

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent


def run_side(files: list[Path], work: Path, share: bool, passes: int = 1) -> dict:
    env = {
        **os.environ,
        "DAGSTER_HOME": str(work / "home"),
        "BATCH_ASSETS_DATA": str(work / "data"),
        "BATCH_ASSETS_SHARE_ENGINE": "1" if share else "0",
        "BATCH_ASSETS_ENGINE_HOST_DIR": str(work / "engine_host"),
    }
    (work / "home").mkdir(parents=True)
    results = []
    try:
        for index in range(passes):
            walls = []
            started = time.perf_counter()
            for file in files:
                one = time.perf_counter()
                subprocess.run([str(VENV_BIN / "batch-assets"), "run", "industry", str(file)], env=env, cwd=work, capture_output=True, text=True, check=True)
                walls.append(time.perf_counter() - one)
                print(f"  {'shared host' if share else 'in-process '} pass {index + 1} {file.name}: {walls[-1]:.1f} s", flush=True)
            total = time.perf_counter() - started
            starts, start_seconds, from_cache = inference_summary(work / "home", [f.name for f in files])
            results.append({"total": total, "per_partition": total / len(files), "median_run": statistics.median(walls), "first_run": walls[0],
                            "engine_starts": starts, "engine_start_seconds": start_seconds, "rows_from_cache": from_cache})
    finally:
        if share:  # the host would otherwise wait out its idle time
            subprocess.run([sys.executable, "-c", "from batch_assets.engines.engine_host import stop_host; stop_host()"], env=env, check=True)
    return results


def inference_summary(home: Path, partition_keys: list[str]) -> tuple[int, float, int]:
    """Engine starts, their seconds and rows served from the result cache, over the latest
    materialization of each partition."""
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    starts, seconds, from_cache = 0, 0.0, 0
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        for key in partition_keys:
            record = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(["industry", "inference_outputs"]), asset_partitions=[key]), limit=1
            ).records[0]
            metadata = {k: v.value for k, v in record.asset_materialization.metadata.items()}
            from_cache += metadata["rows_from_cache"]
            if metadata["engine_started_by_this_run"]:
                starts += 1
                seconds += metadata["engine_start_seconds"]
    return starts, seconds, from_cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=20)
    parser.add_argument("--rows", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for index in range(args.partitions):
            path = Path(tmp) / "inputs" / f"customers-{index:02d}.csv"
            path.parent.mkdir(exist_ok=True)
            subprocess.run([sys.executable, str(HERE / "generate_customers.py"), str(args.rows), str(path), "--seed", str(1000 + index)], check=True)
            files.append(path)
        (own,) = run_side(files, Path(tmp) / "in_process", share=False)
        # The shared side runs the backfill twice: the second pass is a re-run of every partition.
        shared, rerun = run_side(files, Path(tmp) / "shared", share=True, passes=2)
        for name, side in (("in_process", own), ("shared_host", shared), ("shared_host_rerun", rerun)):
            print(json.dumps({name: {k: round(v, 2) for k, v in side.items()}}), flush=True)
        print(f"\n{args.partitions} partitions x {args.rows} rows, one run (process) per partition:")
        for name, side in (("engine in each run", own), ("shared engine host", shared), ("re-run, shared host", rerun)):
            print(f"  {name:19}: engine starts {side['engine_starts']:2d}  total {side['total']:7.1f} s  "
                  f"per partition {side['per_partition']:5.1f} s  (median run {side['median_run']:5.1f} s, first run {side['first_run']:5.1f} s)  "
                  f"rows from cache {side['rows_from_cache']}")
        print(f"  ratio per partition (shared / own): {shared['per_partition'] / own['per_partition']:.3f}")


if __name__ == "__main__":
    main()
