"""`batch-assets`: run drop files through the pipeline from a shell, recorded in the Dagster instance.

    batch-assets run TASK FILE...   copy each file into TASK's drop zone, register its partition and
                                    materialize its four assets and checks; one summary line each
    batch-assets tasks              the tasks and their drop zones
    batch-assets demo               the bundled sample drops of every task, skipping partitions
                                    that already succeeded with the same file

Runs go through the task's Dagster job (the same job, assets and checks the UI and the sensors use)
in this process, grouped as a backfill groups them: ranges of up to the task's
`runs.max_partitions_per_run` partitions per run. The engine starts once for all the files of one command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES_DIR = Path(__file__).resolve().parent / "samples"
DEFAULT_DAGSTER_HOME = ".dagster_home"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


def ensure_dagster_home() -> Path:
    """`DAGSTER_HOME` (default `.dagster_home/`), created with the repo's dagster.yaml if missing."""
    home = Path(os.environ.get("DAGSTER_HOME") or DEFAULT_DAGSTER_HOME).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    template = REPO_ROOT / "dagster.yaml"
    if not config.exists() and template.exists():
        shutil.copyfile(template, config)
    os.environ["DAGSTER_HOME"] = str(home)
    return home


@dataclass
class PartitionOutcome:
    task: str
    partition_key: str
    success: bool
    run_id: str | None
    summary: str
    failed_error_checks: list[str]
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.success and not self.failed_error_checks


def latest_materialization(instance, asset_key, partition_key: str):
    """The newest materialization event record of one partition of an asset, or None."""
    import dagster as dg

    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition_key]), limit=1
    ).records
    return records[0] if records else None


def _summary_line(task_name: str, partition_key: str, instance) -> str:
    import polars as pl

    import dagster as dg
    from batch_assets.storage.locations import output_path

    path = output_path(task_name, "validated_labels", partition_key)
    if not path.exists():
        return "no validated_labels written"
    with path.open("rb") as handle:
        labels = pl.read_parquet(handle)
    errors = int(labels["error"].is_not_null().sum())
    counts = labels.filter(pl.col("label").is_not_null()).group_by("label").len().sort("len", descending=True)
    if counts.height and counts.height <= 12:
        label_text = ", ".join(f"{row['label']}={row['len']}" for row in counts.to_dicts())
    else:
        label_text = f"{int(labels['label'].is_not_null().sum())} labelled"
    rate = ""
    record = latest_materialization(instance, dg.AssetKey([task_name, "inference_outputs"]), partition_key)
    if record is not None and record.asset_materialization is not None:
        metadata = record.asset_materialization.metadata
        value = metadata.get("generated_tokens_per_second")
        rate = f", {value.value:.1f} generated tok/s" if value is not None else ""
    return f"{labels.height} rows, {errors} error rows, labels: {label_text}{rate}"


def run_partitions(task_name: str, files: list[Path], *, skip_succeeded: bool = False) -> list[PartitionOutcome]:
    ensure_dagster_home()
    import dagster as dg
    from batch_assets.definitions import build_definitions, pipeline_job_name, share_engine_setting
    from batch_assets.storage.drop_files import (
        find_drop_file,
        input_file_problem,
        partition_key_for,
        partitions_def_name,
    )
    from batch_assets.engines.vllm_engine import VLLMEngine, keep_engine_warm
    from batch_assets.dagster_defs.sensors import (
        SOURCE_FILE_TAG,
        SOURCE_VERSION_TAG,
        partition_ranges,
        validated_from_version,
        version_digest,
    )
    from batch_assets.pipeline.task_spec import load_tasks
    from batch_assets.dagster_defs.run_recovery import fail_runs_of_dead_processes, process_tags
    from batch_assets.storage.locations import drop_zone, write_bytes_atomically

    loaded = load_tasks()
    tasks = {task.name: task for task in loaded.tasks}
    for error in loaded.errors:
        if error.name == task_name:
            raise SystemExit(f"task {task_name!r} cannot be loaded: {error.message}")
    if task_name not in tasks:
        raise SystemExit(f"unknown task {task_name!r}; tasks: {', '.join(sorted(tasks))}")
    instance = dg.DagsterInstance.get()
    # One process runs every named file, so an in-process engine is started once anyway; runs
    # share the engine host only when BATCH_ASSETS_SHARE_ENGINE=1.
    defs = build_definitions(engine=VLLMEngine(share_engine=share_engine_setting(default=False)))
    job = defs.resolve_job_def(pipeline_job_name(task_name))
    zone = drop_zone(task_name)

    # Refuse what the drop zone would skip or cannot read before copying anything.
    problems = [f"{file}: no such file" for file in files if not file.is_file()]
    problems += [f"{file}: {problem}" for file in files if (problem := input_file_problem(file.name))]
    if problems:
        raise SystemExit("\n".join(problems))
    keys: list[tuple[str, str]] = []
    for file in files:
        if not file.is_file():
            raise SystemExit(f"{file}: no such file")
        content, target = file.read_bytes(), zone / file.name
        # Re-copying identical bytes would only change the file's version and force a re-run.
        if not (target.exists() and target.read_bytes() == content):
            write_bytes_atomically(target, content)
        key = partition_key_for(file.name)
        keys.append((key, version_digest(find_drop_file(task_name, key).version)))
    instance.add_dynamic_partitions(partitions_def_name(task_name), [key for key, _ in keys])
    # A batch-assets process killed earlier left its run STARTED, holding the `gpu` pool slot.
    for run_id in fail_runs_of_dead_processes(instance):
        print(f"run {run_id[:8]}: its process died before it finished; marked failed, pool slots freed", flush=True)

    outcomes: dict[str, PartitionOutcome] = {}
    to_run: list[str] = []
    for key, _ in keys:
        if skip_succeeded and validated_from_version(instance, task_name, find_drop_file(task_name, key)):
            outcomes[key] = PartitionOutcome(task_name, key, True, None, _summary_line(task_name, key, instance), [], skipped=True)
        elif key not in to_run:
            to_run.append(key)
    digests = dict(keys)
    ordered = instance.get_dynamic_partitions(partitions_def_name(task_name))
    with keep_engine_warm():
        # The grouping a backfill of these partitions gets: one run per range of adjacent partitions.
        for keys_of_run in partition_ranges(ordered, to_run, tasks[task_name].runs.max_partitions_per_run):
            if len(keys_of_run) == 1:
                [key] = keys_of_run
                selection = {"partition_key": key}
                tags = {SOURCE_FILE_TAG: key, SOURCE_VERSION_TAG: digests[key]}
            else:
                selection = {}
                tags = {RANGE_START_TAG: keys_of_run[0], RANGE_END_TAG: keys_of_run[-1]}
            result = job.execute_in_process(
                instance=instance,
                raise_on_error=False,
                tags={**tags, "batch_assets/launched_by": "cli", **process_tags()},
                **selection,
            )
            evaluations = result.get_asset_check_evaluations()
            for key in keys_of_run:
                failed_checks = [
                    f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"
                    for evaluation in evaluations
                    if evaluation.partition == key
                    and not evaluation.passed
                    and evaluation.severity == dg.AssetCheckSeverity.ERROR
                ]
                summary = _summary_line(task_name, key, instance) if result.success else _failure_text(result)
                outcomes[key] = PartitionOutcome(task_name, key, result.success, result.run_id, summary, failed_checks)
    return [outcomes[key] for key in dict.fromkeys(key for key, _ in keys)]


def _failure_text(result) -> str:
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            error = event.step_failure_data.error
            while error.cause is not None:  # Dagster wraps the user's exception; show the user's
                error = error.cause
            message = error.message.strip().splitlines()
            return f"failed in {event.step_key}: {message[-1] if message else 'unknown error'}"
    return "run failed"


def _print_outcomes(outcomes: list[PartitionOutcome]) -> None:
    for outcome in outcomes:
        if outcome.skipped:
            status = "UP TO DATE"
        elif not outcome.success:
            status = "FAILED"
        elif outcome.failed_error_checks:
            status = "CHECKS FAILED (" + ", ".join(outcome.failed_error_checks) + ")"
        else:
            status = "OK"
        run = f" run {outcome.run_id[:8]}" if outcome.run_id else ""
        print(f"{outcome.task}/{outcome.partition_key}: {status}{run}: {outcome.summary}", flush=True)


def command_tasks() -> int:
    """The loaded tasks; each task file that failed to load is named on stderr, and the exit is 1."""
    from batch_assets.pipeline.task_spec import load_tasks
    from batch_assets.storage.locations import drop_zone

    loaded = load_tasks()
    for task in loaded.tasks:
        print(f"{task.name}\t{task.output.kind}\t{task.model}\tdrop zone: {drop_zone(task.name)}")
    for error in loaded.errors:
        print(f"ERROR: task {error.name!r} not loaded: {error.message}", file=sys.stderr)
    return 1 if loaded.errors else 0


def command_run(task_name: str, files: list[str]) -> int:
    outcomes = run_partitions(task_name, [Path(f) for f in files])
    _print_outcomes(outcomes)
    return 0 if all(outcome.ok for outcome in outcomes) else 1


def command_demo() -> int:
    from batch_assets.engines.vllm_engine import keep_engine_warm
    from batch_assets.pipeline.task_spec import load_tasks

    loaded = load_tasks()
    for error in loaded.errors:
        print(f"ERROR: task {error.name!r} not loaded: {error.message}", file=sys.stderr)
    # One engine for every task that shares its settings (the shipped ones all do).
    with keep_engine_warm():
        all_ok = _demo_tasks(loaded.tasks)
    return 0 if all_ok and not loaded.errors else 1


def _demo_tasks(tasks) -> bool:
    all_ok = True
    for task in tasks:
        folder = SAMPLES_DIR / task.name
        files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.exists() else []
        if not files:
            print(f"{task.name}: no bundled samples in {folder}")
            continue
        outcomes = run_partitions(task.name, files, skip_succeeded=True)
        _print_outcomes(outcomes)
        all_ok = all_ok and all(outcome.ok for outcome in outcomes)
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batch-assets", description="Offline LLM batch inference as Dagster assets.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run files through a task's pipeline")
    run.add_argument("task")
    run.add_argument("files", nargs="+")
    commands.add_parser("tasks", help="list the tasks and their drop zones")
    commands.add_parser("demo", help="run the bundled sample drops of every task")
    args = parser.parse_args(argv)
    if args.command == "tasks":
        return command_tasks()
    if args.command == "run":
        return command_run(args.task, args.files)
    return command_demo()


if __name__ == "__main__":
    sys.exit(main())
