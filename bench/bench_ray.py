"""Many small partitions as runs on Ray (dagster-ray's RayRunLauncher) against the same through Dagster's
default launcher: runs per minute, and what each run costs beyond its inference.

    .venv/bin/python bench/bench_ray.py                                  # 200 partitions, ray then default
    .venv/bin/python bench/bench_ray.py --partitions 4 --launchers ray   # a quick look

Each launcher gets a new Dagster home (the repo's dagster.yaml; for Ray, docs/ray.md's launcher block
with the address of a single-node Ray head this script starts on 127.0.0.1, offering `--slots`
`batch_assets_engine` slots), a new data folder with `--partitions` files of `--rows` rows dropped
for the sensor, and a real daemon whose code location is bench/ray_location.py: every task on the
zero-cost engine, so a run's cost is Dagster's, Ray's and the pipeline's, not a model's. Each file is
its own run (`runs.max_partitions_per_run: 1`); `--concurrent` runs at once (max_concurrent_runs and
the `gpu` pool limit). Reported, from the instance's run records and the partitions' metadata:

- runs per minute: runs / (the last run's end - the first run's launch);
- per run, medians: launch to start (Ray: job submission, placement, the job's process and
  `dagster api execute_run` loading the code location; default: the run worker's process), start to
  end, and beyond inference: launch to end minus the step's `inference_seconds` and `engine_start_seconds`
  (the zero-cost engine's start is 0); on Ray also the Ray job's own start to the run's start.

Everything printed also goes to `--out` (default bench/results/ray.txt). On one machine both
launchers start every run's process on the same CPUs; the figures compare the launchers' fixed
costs, not a cluster's throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from batch_assets_tests.ray_head import ray_head  # noqa: E402
from batch_assets_tests.support import running_daemon  # noqa: E402
from batch_assets_tests.tiny_model import built_tiny_model  # noqa: E402

TASK = "raybench"


def task_yaml() -> dict:
    return {
        "name": TASK,
        "input": {"text_fields": ["text"]},
        "prompt": {"system": "Answer with one letter.", "template": "Item: {text}"},
        "engine": {"max_model_len": 512},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "output": {"kind": "choices", "choices": ["a", "b"]},
        "runs": {"max_partitions_per_run": 1},
        "sensor": {"running_by_default": True, "minimum_interval_seconds": 5},
    }


def docs_block(address: str) -> dict:
    import re

    text = (REPO / "docs" / "ray.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL) if "RayRunLauncher" in b)
    return yaml.safe_load(block.replace("<ray-address>", address))


def write_home(home: Path, address: str | None, concurrent: int, extra_env: list[str]) -> None:
    home.mkdir(parents=True)
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    if address:
        config.update(docs_block(address))
        config["run_launcher"]["config"]["ray"]["env_vars"] += extra_env
    config["concurrency"]["runs"]["max_concurrent_runs"] = concurrent
    config["concurrency"]["pools"]["default_limit"] = concurrent
    config["code_servers"] = {"local_startup_timeout": 600}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))


def drop(zone: Path, partitions: int, rows: int) -> None:
    zone.mkdir(parents=True)
    settled = time.time() - 100
    for n in range(partitions):
        path = zone / f"part{n:04d}.jsonl"
        path.write_text("".join(f'{{"text": "part {n} item {i}"}}\n' for i in range(rows)))
        os.utime(path, (settled + n * 0.001, settled + n * 0.001))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(launcher: str, args: argparse.Namespace, folder: Path, address: str | None) -> list[str]:
    return report(launcher, run_backlog(args, folder, address), args, address)


def run_backlog(args: argparse.Namespace, folder: Path, address: str | None, location: Path = HERE / "ray_location.py"):
    """`args.partitions` files of `args.rows` rows through a real daemon, with `address`'s Ray (else
    the default launcher) and the code location `location`; its instance once every run has ended."""
    import dagster as dg

    home, data, tasks = folder / "home", folder / "data", folder / "tasks"
    extra_env = ["BATCH_ASSETS_RAY_CPU_ONLY", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "PYTHONPATH", "PATH"]
    write_home(home, address, args.concurrent, extra_env)
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(yaml.safe_dump(task_yaml()))
    drop(data / "drops" / TASK, args.partitions, args.rows)
    workspace = folder / "workspace.yaml"
    location = {"relative_path": str(location), "working_directory": str(REPO)}
    workspace.write_text(yaml.safe_dump({"load_from": [{"python_file": {**location, "location_name": "bench"}}]}))
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_DATA": str(data),
        "BATCH_ASSETS_MODEL": str(built_tiny_model()),
        "BATCH_ASSETS_TASKS_DIR": str(tasks),
        "BATCH_ASSETS_RAY_CPU_ONLY": "1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    instance = dg.DagsterInstance.from_config(str(home))
    key = dg.AssetKey([TASK, "validated_labels"])

    def done() -> bool:
        runs = instance.get_runs()
        finished = len(runs) >= args.partitions and all(run.is_finished for run in runs)
        return finished and len(instance.get_materialized_partitions(key)) >= args.partitions

    with running_daemon(env, folder / "daemon.log", workspace) as daemon:
        daemon.wait_until(done, lambda: f"{len(instance.get_runs())} runs", args.timeout)
    return instance


def report(launcher: str, instance, args: argparse.Namespace, address: str | None) -> list[str]:
    import dagster as dg

    records = instance.get_run_records()
    stats = {record.dagster_run.run_id: instance.get_run_stats(record.dagster_run.run_id) for record in records}
    failed = [r for r in records if r.dagster_run.status != dg.DagsterRunStatus.SUCCESS]
    launches = [s.launch_time for s in stats.values() if s.launch_time]
    ends = [s.end_time for s in stats.values() if s.end_time]
    inference = {}
    for record in instance.fetch_materializations(dg.AssetKey([TASK, "inference_outputs"]), limit=10_000).records:
        metadata = record.asset_materialization.metadata
        seconds = metadata["inference_seconds"].value + metadata["engine_start_seconds"].value
        inference[record.run_id] = inference.get(record.run_id, 0.0) + seconds
    to_start = [s.start_time - s.launch_time for s in stats.values() if s.start_time and s.launch_time]
    to_end = [s.end_time - s.start_time for s in stats.values() if s.end_time and s.start_time]
    beyond = [
        s.end_time - s.launch_time - inference.get(run_id, 0.0)
        for run_id, s in stats.items()
        if s.end_time and s.launch_time
    ]
    inferring = median(list(inference.values()))
    span = max(ends) - min(launches)
    lines = [
        f"{launcher}: {len(records)} runs ({len(failed)} not successful) of {args.rows} rows, "
        f"{args.concurrent} at once: {60 * len(records) / span:.1f} runs/min over {span:.0f} s",
        f"  per run (medians): launch to start {median(to_start):.1f} s, start to end {median(to_end):.1f} s, "
        f"beyond inference {median(beyond):.1f} s (inference and engine start {inferring:.2f} s)",
    ]
    if address:
        from ray.job_submission import JobSubmissionClient

        jobs = {job.submission_id: job for job in JobSubmissionClient(address).list_jobs()}
        job_to_run = [
            stats[run_id].start_time - jobs[f"dagster-run-{run_id}"].start_time / 1000
            for run_id in stats
            if f"dagster-run-{run_id}" in jobs and stats[run_id].start_time and jobs[f"dagster-run-{run_id}"].start_time
        ]
        lines.append(f"  Ray job start to run start (median): {median(job_to_run):.1f} s")
    return lines


@contextlib.contextmanager
def cluster(slots: int) -> Iterator[str]:
    with ray_head({"batch_assets_engine": slots}, num_cpus=max(2, slots)) as head:
        yield head.address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=200)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=2, help="runs at once (and Ray engine slots)")
    parser.add_argument("--slots", type=int, help="the head's batch_assets_engine slots (default: --concurrent)")
    parser.add_argument("--launchers", default="ray,default")
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ray.txt")
    args = parser.parse_args()
    lines = [f"bench_ray.py {' '.join(sys.argv[1:])}".strip()]
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as scratch:
        for launcher in args.launchers.split(","):
            folder = Path(scratch) / launcher
            folder.mkdir()
            if launcher == "ray":
                with cluster(args.slots or args.concurrent) as address:
                    found = measure(launcher, args, folder, address)
            else:
                found = measure(launcher, args, folder, None)
            for line in found:
                print(line, flush=True)
            lines += found
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
