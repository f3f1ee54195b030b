"""How long the drops sensor's tick takes when a big CSV file is dropped (issue 36 item 2).

    .venv/bin/python bench/generate_customers.py 3000000 /tmp/c3000000.csv
    .venv/bin/python bench/bench_big_file_tick.py /tmp/c300000.csv /tmp/c3000000.csv [--task industry]

Each file is linked into a fresh local drop zone of the task (default max_rows_per_partition:
1,000,000) and the task's `<task>_drops_sensor` is evaluated once, as the daemon's code server
does, with a fresh Dagster instance. Prints the tick's seconds and what it requested
(batch_assets_tests/test_big_file_tick.py counts the bytes a tick reads).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_assets.lib.drops_sensor import build_drops_sensor  # noqa: E402
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name  # noqa: E402
from batch_assets.pipeline.task_spec import load_task_specs  # noqa: E402


def one_tick(csv_path: Path, task_name: str) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        os.environ["BATCH_ASSETS_DATA"] = str(data)
        target = data / "drops" / task_name / csv_path.name
        target.parent.mkdir(parents=True)
        os.link(csv_path, target)
        stamp = time.time() - 3600
        os.utime(target, (stamp, stamp))
        task = next(task for task in load_task_specs() if task.name == task_name)
        definitions = build_definitions()
        sensor = build_drops_sensor(task, definitions.resolve_job_def(pipeline_job_name(task_name)))
        (Path(scratch) / "home").mkdir()
        with dg.instance_for_test(temp_dir=str(Path(scratch) / "home")) as instance:
            context = dg.build_sensor_context(instance=instance, definitions=definitions)
            started = time.perf_counter()
            result = sensor(context)
            seconds = time.perf_counter() - started
        requests = [request.partition_key or request.job_name for request in result.run_requests or []]
        return f"{csv_path.name}: tick {seconds:.2f} s, requested {requests}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--task", default="industry")
    args = parser.parse_args()
    for path in args.files:
        print(one_tick(path.resolve(), args.task), flush=True)


if __name__ == "__main__":
    main()
