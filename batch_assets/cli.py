"""`batch-assets`: run drop files through the pipeline from a shell, recorded in the Dagster instance.

    batch-assets run TASK FILE...   copy each file into TASK's drop zone, register its partition and
                                    materialize its four assets and checks; one summary line each
    batch-assets tasks              the tasks and their drop zones
    batch-assets demo               the bundled sample drops of every task, skipping partitions
                                    that already succeeded with the same file
    batch-assets ui                 the Dagster UI and daemon (`dg dev`) on DAGSTER_HOME, one per home

The terminal shows one line per file and progress lines; the engine's and libraries' output goes to
the run's log (and `$DAGSTER_HOME/logs/`), tracebacks too (`--verbose` shows everything). A file of
the same name as a different drop file from another folder is refused before anything is copied
(`--replace` replaces it, and says so).

Runs go through the task's Dagster job (the same job, assets and checks the UI and the sensors use)
in this process, so the engine starts once for all the files of one command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from batch_assets.dagster_defs.instance import dagster_home, home_lock, open_instance, prepare_instance

if TYPE_CHECKING:
    from upath import UPath

SAMPLES_DIR = Path(__file__).resolve().parent / "samples"
# The absolute path of the file a CLI run was given, so a later file of the same name from another
# folder is not taken for a new version of it.
ORIGIN_TAG = "batch_assets/origin"
# A run over several files (up to the task's `runs.max_partitions_per_run`) records each file's
# origin here instead, as JSON {partition key: path}.
ORIGINS_TAG = "batch_assets/origins"


class CliError(Exception):
    """A problem the user can fix: printed as one line, no traceback."""


class Terminal:
    """Where the CLI's own lines go. While partitions run, the process's stdout and stderr (engine
    logs, warnings of libraries) go to a log file instead, so the terminal shows only these lines."""

    def __init__(self) -> None:
        self.stream: TextIO | None = None  # None: whatever sys.stdout is now
        self.verbose = False
        self.log_path: Path | None = None
        self.line_open = False  # a progress line is being updated in place (terminals only)

    @property
    def out(self) -> TextIO:
        return self.stream or sys.stdout

    def say(self, text: str) -> None:
        if self.line_open:
            text = "\n" + text
            self.line_open = False
        print(text, file=self.out, flush=True)

    def update(self, text: str) -> None:
        """A progress line: rewritten in place on a terminal, one line each otherwise."""
        if not self.out.isatty():
            self.say(text)
            return
        self.out.write(f"\r\033[K{text}")
        self.out.flush()
        self.line_open = True

    @contextmanager
    def library_output_to(self, log_path: Path):
        if self.verbose:
            yield
            return
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        saved_out, saved_err = os.dup(1), os.dup(2)
        self.stream = os.fdopen(os.dup(saved_out), "w", buffering=1)
        self.log_path = log_path
        with log_path.open("a") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            self.stream.close()
            self.stream = None


TERMINAL = Terminal()


def ensure_dagster_home() -> Path:
    """`DAGSTER_HOME` (default `.dagster_home/`) with the repo's dagster.yaml and its storages created."""
    return prepare_instance()


@dataclass
class PartitionOutcome:
    task: str
    partition_key: str
    success: bool
    run_id: str | None
    summary: str
    failed_error_checks: list[str]
    skipped: bool = False
    rows: int | None = None
    error_rows: int | None = None

    @property
    def all_rows_failed(self) -> bool:
        return bool(self.rows) and self.error_rows == self.rows

    @property
    def ok(self) -> bool:
        return self.success and not self.failed_error_checks and not self.all_rows_failed


def latest_materialization(instance, asset_key, partition_key: str):
    """The newest materialization event record of one partition of an asset, or None."""
    import dagster as dg

    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition_key]), limit=1
    ).records
    return records[0] if records else None


def _label_counts(task_name: str, partition_keys: list[str]) -> tuple[int, int, str] | None:
    """(rows, error rows, label text) of the partitions' validated_labels together (a file's own
    partition, or its shards), or None when one is not written."""
    import polars as pl

    from batch_assets.storage.locations import output_path

    frames = []
    for key in partition_keys:
        path = output_path(task_name, "validated_labels", key)
        if not path.exists():
            return None
        with path.open("rb") as handle:
            frame = pl.read_parquet(handle)
        frames.append(frame.select("error", label=_label_or_embedding(frame)))
    labels = pl.concat(frames, how="vertical_relaxed")
    errors = int(labels["error"].is_not_null().sum())
    if labels.schema["label"] == pl.UInt32:  # an embedding task: the vectors' dimension
        dimensions = labels["label"].drop_nulls().unique().sort().to_list()
        shown = "/".join(map(str, dimensions)) or "-"
        return labels.height, errors, f"{int(labels['label'].is_not_null().sum())} embedded (dimension {shown})"
    counts = labels.filter(pl.col("label").is_not_null()).group_by("label").len().sort("len", descending=True)
    if counts.height and counts.height <= 12:
        label_text = ", ".join(f"{row['label']}={row['len']}" for row in counts.to_dicts())
    else:
        label_text = f"{int(labels['label'].is_not_null().sum())} labelled"
    return labels.height, errors, label_text


def _label_or_embedding(frame):
    """The `label` of a labelled table; an embedding table's vector sizes (null for error rows)."""
    import polars as pl

    if "label" in frame.columns or "embedding" not in frame.columns:
        return pl.col("label")
    return pl.col("embedding").cast(pl.List(pl.Float32)).list.len()


def _metadata_value(record, name: str):
    entry = record.asset_materialization.metadata.get(name) if record and record.asset_materialization else None
    return None if entry is None else entry.value


def _quality_notes(task_name: str, partition_keys: list[str], instance) -> list[str]:
    """Accuracy and low-confidence share over the partitions, each weighted by its rows."""
    import dagster as dg

    records = [
        latest_materialization(instance, dg.AssetKey([task_name, "validated_labels"]), key) for key in partition_keys
    ]
    notes = []
    gold = [(_metadata_value(r, "accuracy"), _metadata_value(r, "rows_with_gold")) for r in records]
    gold = [(accuracy, rows) for accuracy, rows in gold if accuracy is not None and rows]
    if gold:
        rows_with_gold = sum(rows for _, rows in gold)
        accuracy = sum(accuracy * rows for accuracy, rows in gold) / rows_with_gold
        notes.append(f"accuracy {accuracy:.0%} on {rows_with_gold} hand-labelled rows")
    low = [(_metadata_value(r, "low_confidence_share"), _metadata_value(r, "rows")) for r in records]
    minimum = _metadata_value(records[0], "min_confidence") if records else None
    low = [(share, rows) for share, rows in low if share is not None and rows]
    if low and minimum is not None:
        share = sum(share * rows for share, rows in low) / sum(rows for _, rows in low)
        notes.append(f"{share:.0%} of labels with confidence under {minimum}")
    return notes


def _summary_line(task_name: str, partition_keys: list[str], instance) -> str:
    import dagster as dg

    counts = _label_counts(task_name, partition_keys)
    if counts is None:
        return "no validated_labels written"
    rows, errors, label_text = counts
    notes = _quality_notes(task_name, partition_keys, instance)
    if notes:
        label_text += f" ({'; '.join(notes)})"
    rate = ""
    if len(partition_keys) == 1:
        record = latest_materialization(instance, dg.AssetKey([task_name, "inference_outputs"]), partition_keys[0])
        if record is not None and record.asset_materialization is not None:
            rate = _inference_text(record.asset_materialization.metadata)
    text = f"{rows} rows, {errors} error rows, labels: {label_text}{rate}"
    if rows and errors == rows:
        text += "; every record is an error (see the `error` column of validated_labels)"
    return text


def _inference_text(metadata) -> str:
    """The generation rate when this run inferred rows; where the rows came from when it inferred
    none (a rate over no inference would read as a stalled engine)."""

    def count(name: str) -> int:
        entry = metadata.get(name)
        return int(entry.value) if entry is not None and entry.value is not None else 0

    rate = metadata.get("generated_tokens_per_second")
    rows_rate = metadata.get("rows_per_second")
    if count("rows_inferred") and "dimension" in metadata and rows_rate is not None:  # embeddings
        return f", {rows_rate.value:.1f} rows/s embedded"
    if count("rows_inferred") and rate is not None:
        return f", {rate.value:.1f} generated tok/s"
    sources = [
        f"{count(name)} rows from {source}"
        for name, source in (("rows_from_cache", "the result cache"), ("rows_from_checkpoint", "checkpoints"))
        if count(name)
    ]
    return f", nothing inferred: {' and '.join(sources)}" if sources else ""


def _outcome(task_name: str, key: str, instance, **fields) -> PartitionOutcome:
    counts = _label_counts(task_name, [key]) if fields.get("success") else None
    rows, errors = (counts[0], counts[1]) if counts else (None, None)
    summary = _summary_line(task_name, [key], instance) if fields.get("success") else fields.pop("summary")
    fields.pop("summary", None)
    return PartitionOutcome(task_name, key, summary=summary, rows=rows, error_rows=errors, **fields)


@dataclass
class NamedFile:
    path: Path  # as the user named it
    content: bytes
    key: str  # its partition key in the task's drop zone

    @property
    def origin(self) -> str:
        return str(self.path.resolve())


def _read_named_files(files: list[Path]) -> list[NamedFile]:
    """Every named file, checked before anything is copied: exists, is an input, no two share a name."""
    from batch_assets.storage.drop_files import input_file_problem, partition_key_for

    named: dict[str, NamedFile] = {}
    for file in files:
        if not file.is_file():
            raise CliError(f"{file}: no such file")
        problem = input_file_problem(file.name)
        if problem is not None:
            raise CliError(f"{file}: not an input file: {problem}")
        entry = NamedFile(file, file.read_bytes(), partition_key_for(file.name))
        earlier = named.get(file.name)
        if earlier is not None and earlier.content != entry.content:
            raise CliError(
                f"{earlier.path} and {file} are different files with the same name, so both would be the drop "
                f"file {file.name!r} (partition {entry.key}); nothing was copied. Rename one, or run them in "
                "separate commands (the second with --replace to replace the first)"
            )
        named.setdefault(file.name, entry)
    return list(named.values())


def _last_origin(instance, job_name: str, key: str) -> str | None:
    """The file the newest CLI run of this partition was given (None when unknown): a run of this
    file alone tags its origin, a run over several files tags each file's origin in one JSON tag."""
    import dagster as dg

    from batch_assets.dagster_defs.sensors import SOURCE_FILE_TAG

    singles = instance.get_run_records(
        filters=dg.RunsFilter(job_name=job_name, tags={"dagster/partition": key}), limit=20
    )
    # A file run as shards: each shard's run is tagged with the file's key.
    singles += instance.get_run_records(
        filters=dg.RunsFilter(job_name=job_name, tags={SOURCE_FILE_TAG: key, "batch_assets/launched_by": "cli"}),
        limit=20,
    )
    ranges = instance.get_run_records(
        filters=dg.RunsFilter(job_name=job_name, tags={"batch_assets/launched_by": "cli"}), limit=50
    )
    # (when, origin); the creation time is the run record's, not the run's (DagsterRun has none).
    candidates = [(record.create_timestamp, record.dagster_run.tags.get(ORIGIN_TAG)) for record in singles]
    candidates += [
        (record.create_timestamp, json.loads(record.dagster_run.tags.get(ORIGINS_TAG, "{}")).get(key))
        for record in ranges
    ]
    known = [(when, origin) for when, origin in candidates if origin is not None]
    return max(known, key=lambda candidate: candidate[0])[1] if known else None


# What the drop zone holds under a name that is no regular file (a link, a FIFO): never equal to a file's bytes.
_NOT_A_REGULAR_FILE = object()


def _drop_zone_content(zone: UPath, name: str) -> bytes | object | None:
    """The bytes of the drop file `name`, None when there is none, read as the pipeline reads drops:
    a link or FIFO put there is not followed or waited on, and counts as a different file."""
    from batch_assets.storage.drop_files import DropFile, DropFileError

    if not (zone / name).exists() and not os.path.lexists(str(zone / name)):
        return None
    try:
        return DropFile(name, zone, "").read_bytes()
    except (DropFileError, FileNotFoundError):
        return _NOT_A_REGULAR_FILE


def _copy_into_drop_zone(instance, task_name: str, job_name: str, files: list[NamedFile], *, replace: bool) -> None:
    """Copy the files into the drop zone; a different file of the same name is refused unless `replace`."""
    from batch_assets.storage.locations import drop_zone, write_bytes_atomically

    zone = drop_zone(task_name)
    plans: list[tuple[NamedFile, UPath, str | None]] = []
    note: str | None
    for file in files:
        target = zone / file.path.name
        existing = _drop_zone_content(zone, file.path.name)
        if existing == file.content:
            continue  # re-copying identical bytes would only change the file's version and force a re-run
        if existing is None:
            plans.append((file, target, None))
            continue
        origin = _last_origin(instance, job_name, file.key)
        if origin == file.origin:
            note = f"{file.path}: changed since its last run; partition {file.key} is run again from the new content"
        elif replace:
            note = (
                f"{file.path}: replaces the drop file {file.path.name} (from {origin or 'elsewhere'}) as asked "
                f"(--replace); partition {file.key} and its outputs are replaced"
            )
        else:
            raise CliError(
                f"{file.path}: the {task_name} drop zone already holds a different {file.path.name} "
                f"(from {origin or 'an earlier drop'}), whose outputs running this file would replace; nothing was "
                "copied. Rename the file, or pass --replace to replace it"
            )
        plans.append((file, target, note))
    for file, target, note in plans:
        if note:
            TERMINAL.say(note)
        write_bytes_atomically(target, file.content)


def add_partitions(instance, partitions_name: str, keys: list[str]) -> None:
    """Register the partitions; one that another process (CLI, sensor) added meanwhile is fine too."""
    import sqlite3

    from sqlalchemy.exc import IntegrityError

    missing = [key for key in dict.fromkeys(keys) if not instance.has_dynamic_partition(partitions_name, key)]
    if not missing:
        return
    try:
        instance.add_dynamic_partitions(partitions_name, missing)
    except (IntegrityError, sqlite3.IntegrityError):
        # Dagster's check-then-insert races with a concurrent add of the same key; one insert wins.
        still = [key for key in missing if not instance.has_dynamic_partition(partitions_name, key)]
        if still:
            instance.add_dynamic_partitions(partitions_name, still)


_PROGRESS = re.compile(r"inferred (\d+)/(\d+) requests \((\d+)%\), ([\d.]+) rows/s")
_STARTING = re.compile(r"^(\d+) requests to infer|^reusing .*requests left to infer")


class _ProgressHandler(logging.Handler):
    """Turns run_inference's progress lines into one short line per update on the terminal."""

    def __init__(self, label: str):
        super().__init__(logging.INFO)
        self.label = label

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "dagster_meta", None) or {}
        message = str(meta.get("orig_message") or record.getMessage())
        match = _PROGRESS.search(message)
        if match:
            done, total, percent, rate = int(match[1]), int(match[2]), match[3], float(match[4])
            left = f", {_time_left((total - done) / rate)}" if rate > 0 and done < total else ""
            text = f"  {self.label}: {done}/{total} requests ({percent}%), {rate:.1f} rows/s{left}"
            TERMINAL.update(text)
        elif _STARTING.search(message):
            TERMINAL.say(f"  {self.label}: {message}")


def _time_left(seconds: float) -> str:
    return "under 1 s left" if seconds < 1 else f"about {_duration(seconds)} left"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def _cli_job(job, label: str):
    """The job with a logger that shows progress on the terminal; everything else stays in the run's log."""
    import dagster as dg

    @dg.logger
    def cli_progress(_init_context) -> logging.Logger:
        logger = logging.Logger(f"batch_assets.cli.{label}", logging.INFO)
        logger.addHandler(_ProgressHandler(label))
        return logger

    loggers = {"cli_progress": cli_progress}
    config: dict[str, Any] = {"cli_progress": {}}
    if TERMINAL.verbose:
        loggers["console"] = dg.colored_console_logger
        config["console"] = {"config": {"log_level": "INFO"}}
    return job.with_logger_defs({**job.loggers, **loggers}), {"loggers": config}


def run_partitions(
    task_name: str, files: list[Path], *, skip_succeeded: bool = False, replace: bool = False
) -> list[PartitionOutcome]:
    import dagster as dg

    from batch_assets.dagster_defs.run_recovery import (
        ProcessLease,
        fail_runs_of_dead_processes,
        others_wait_for_pool,
        wait_for_pool_slot,
    )
    from batch_assets.dagster_defs.sensors import (
        RANGE_END_TAG,
        RANGE_START_TAG,
        SOURCE_FILE_TAG,
        SOURCE_VERSION_TAG,
        file_validated_from_version,
        partition_ranges,
        version_digest,
    )
    from batch_assets.dagster_defs.task_definitions import build_definitions, pipeline_job_name
    from batch_assets.engines.kinds import engine_kind
    from batch_assets.engines.vllm_engine import keep_engine_warm, shutdown_engines
    from batch_assets.pipeline.task_spec import load_tasks
    from batch_assets.storage.drop_files import find_drop_file, partitions_def_name

    loaded = load_tasks()
    tasks = {task.name: task for task in loaded.tasks}
    for error in loaded.errors:
        if error.name == task_name:
            raise CliError(f"task {task_name!r} cannot be loaded: {error.message}")
    if task_name not in tasks:
        raise CliError(f"unknown task {task_name!r}; tasks: {', '.join(sorted(tasks))}")
    task = tasks[task_name]
    named = _read_named_files(files)
    check_model(task)
    instance = open_instance()
    # One process runs every named file, so the in-process engine is started once.
    defs = build_definitions()
    job_name = pipeline_job_name(task_name)
    job = defs.resolve_job_def(job_name)

    lease = ProcessLease(dagster_home())
    with lease:
        # Checking, copying and registering under the home's lock: two commands naming files of the
        # same name see each other's copy, and never add the same partition twice.
        with home_lock(dagster_home()):
            _copy_into_drop_zone(instance, task_name, job_name, named, replace=replace)
            drops = {file.key: find_drop_file(task_name, file.key) for file in named}
            keys = [(file, version_digest(drops[file.key].version)) for file in named]
            # A file with more records than input.max_rows_per_partition runs as several shards.
            partitions_of = {file.key: _file_partitions(instance, task, drops[file.key]) for file in named}
            add_partitions(instance, partitions_def_name(task_name), [k for ks in partitions_of.values() for k in ks])
            lease.claim(task_name, [(key, digest) for file, digest in keys for key in partitions_of[file.key]])
        for run_id in fail_runs_of_dead_processes(instance):
            TERMINAL.say(
                f"run {run_id[:8]}: its batch-assets process died before it finished; marked failed, pool slots freed"
            )

        by_key: dict[str, PartitionOutcome] = {}
        to_run: list[str] = []
        named_by_key = {key: (file, digest) for file, digest in keys for key in partitions_of[file.key]}
        for file, _ in keys:
            file_keys = partitions_of[file.key]
            if skip_succeeded and file_validated_from_version(instance, task_name, drops[file.key], file_keys):
                for key in file_keys:
                    done = _outcome(task_name, key, instance, success=True, run_id=None, failed_error_checks=[])
                    done.skipped = True
                    by_key[key] = done
            else:
                to_run += [key for key in file_keys if key not in to_run]
        shards = [key for key, (file, _) in named_by_key.items() if key != file.key]
        ordered = instance.get_dynamic_partitions(partitions_def_name(task_name))
        pool = engine_kind(task).pool
        with keep_engine_warm(wanted_elsewhere=lambda: others_wait_for_pool(instance, pool)):
            # Grouped as a backfill of these partitions is: one run per range of adjacent partitions,
            # up to the task's `runs.max_partitions_per_run`, one engine stream per run.
            ranges = list(partition_ranges(ordered, to_run, task.runs.max_partitions_per_run, alone=shards))
            while ranges:
                run_keys = ranges.pop(0)
                wait_for_pool_slot(instance, pool, say=TERMINAL.say, before_waiting=shutdown_engines)
                if len(run_keys) == 1:
                    file, digest = named_by_key[run_keys[0]]
                    label, selection = f"{task_name}/{run_keys[0]}", {"partition_key": run_keys[0]}
                    tags = {SOURCE_FILE_TAG: file.key, SOURCE_VERSION_TAG: digest, ORIGIN_TAG: file.origin}
                else:
                    label, selection = f"{task_name}/{run_keys[0]}..{run_keys[-1]} ({len(run_keys)} files)", {}
                    tags = {
                        RANGE_START_TAG: run_keys[0],
                        RANGE_END_TAG: run_keys[-1],
                        ORIGINS_TAG: json.dumps({key: named_by_key[key][0].origin for key in run_keys}),
                    }
                run_job, run_config = _cli_job(job, label)
                result = run_job.execute_in_process(
                    run_config=run_config,
                    instance=instance,
                    raise_on_error=False,
                    tags={**tags, "batch_assets/launched_by": "cli", **lease.tags()},
                    **selection,
                )
                if len(run_keys) > 1 and _failed_before_inference(result):
                    # Dagster fails a step for every partition of its range: a bad file (unreadable,
                    # missing column) or a failed blocking check of one file would fail the others too.
                    # Run the range again file by file, so only the bad file fails; the engine stays
                    # warm in this process, and checkpoints and the result cache keep finished work.
                    TERMINAL.say(f"{label}: failed as a whole; running its files one by one")
                    ranges[:0] = [[key] for key in run_keys]
                    continue
                evaluations = result.get_asset_check_evaluations()
                for key in run_keys:
                    failed = [
                        evaluation
                        for evaluation in evaluations
                        if evaluation.partition == key
                        and not evaluation.passed
                        and evaluation.severity == dg.AssetCheckSeverity.ERROR
                    ]
                    failed_checks = [f"{e.asset_key.to_user_string()}:{e.check_name}" for e in failed]
                    # A blocking check that stopped the run says why in its description (e.g. over budget).
                    stopped_by = [f"stopped by {e.check_name}: {e.description}" for e in failed if e.description]
                    failure = None if result.success else (stopped_by[0] if stopped_by else _failure_text(result, task))
                    by_key[key] = _outcome(
                        task_name,
                        key,
                        instance,
                        success=result.success,
                        run_id=result.run_id,
                        summary=failure,
                        failed_error_checks=failed_checks,
                    )
        outcomes = [
            _file_outcome(instance, task_name, key, partitions_of[key], by_key)
            for key in dict.fromkeys(file.key for file, _ in keys)
        ]
        if TERMINAL.log_path and any(not outcome.ok for outcome in outcomes):
            TERMINAL.say(f"engine and library output of this command: {TERMINAL.log_path}")
    return outcomes


def _file_partitions(instance, task, drop) -> list[str]:
    """The file's partitions (its own, or its shards); partitions of the file that its new version
    no longer has (split differently) are retired, outputs and all."""
    from batch_assets.pipeline.read_prompts import DropFileError
    from batch_assets.storage.drop_files import partitions_def_name
    from batch_assets.storage.shards import delete_partition_outputs, file_partition_keys, retired_partitions

    try:
        keys = file_partition_keys(task.name, drop, task.input.max_rows_per_partition)
    except DropFileError:
        return [drop.partition_key]  # its run fails with this error, naming the file
    partitions_name = partitions_def_name(task.name)
    retired = retired_partitions(instance.get_dynamic_partitions(partitions_name), drop.partition_key, keys)
    if retired:
        TERMINAL.say(f"{drop.relative_path}: split differently than before; retiring partitions {', '.join(retired)}")
        delete_partition_outputs(task.name, retired)
        for key in retired:
            instance.delete_dynamic_partition(partitions_name, key)
    return keys


def _file_outcome(
    instance, task_name: str, file_key: str, keys: list[str], by_key: dict[str, PartitionOutcome]
) -> PartitionOutcome:
    """One outcome per file as the user named it: its partition's, or its shards' together."""
    if keys == [file_key]:
        return by_key[file_key]
    parts = [by_key[key] for key in keys]
    failed = [part for part in parts if not part.success]
    summary = (
        "; ".join(f"shard {part.partition_key}: {part.summary}" for part in failed)
        if failed
        else f"{_summary_line(task_name, keys, instance)} ({len(keys)} shards)"
    )
    rows = [part.rows for part in parts]
    errors = [part.error_rows for part in parts]
    return PartitionOutcome(
        task_name,
        f"{file_key}~*",
        success=not failed,
        run_id=None,
        summary=summary,
        failed_error_checks=[f"{part.partition_key}: {check}" for part in parts for check in part.failed_error_checks],
        skipped=all(part.skipped for part in parts),
        rows=None if None in rows else sum(r for r in rows if r is not None),
        error_rows=None if None in errors else sum(e for e in errors if e is not None),
    )


def _failed_before_inference(result) -> bool:
    """A failed run whose failure lies in one file's input (reading, formatting, a blocking check of
    its outputs), not in the engine: worth running file by file. An engine that cannot start or died
    would fail each file again, so those failures are reported as they are."""
    if result.success:
        return False
    failed_steps = [event.step_key or "" for event in result.all_events if event.is_step_failure]
    # The step itself, not its check `<task>__inference_outputs_outputs_satisfy_constraint`.
    return not any(step.endswith("__inference_outputs") for step in failed_steps)


def check_model(task) -> None:
    """Fail at once, with the setting to change, when the task's model cannot be found."""
    from batch_assets.engines.embedded_model import EMBEDDED_PREFIX

    if task.engine.kind != "vllm":
        return
    model = task.model
    setting = f"`engine.model` in the task file of {task.name!r} (or BATCH_ASSETS_MODEL)"
    if model.startswith(EMBEDDED_PREFIX):
        return
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        if os.path.isdir(expanded) and not os.path.exists(os.path.join(expanded, "config.json")):
            raise CliError(f"model folder {expanded} has no config.json, so it is not a model; set {setting}")
        return
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise CliError(f"model folder {expanded} does not exist; set {setting} to a model folder or a Hugging Face id")
    if _cached_on_hub(model):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not _hub_reachable():
        raise CliError(
            f"model {model!r} is not in the local Hugging Face cache and the Hub cannot be reached (offline); "
            f"download it where there is a network (`hf download {model}`), or set {setting} to a local folder"
        )


def _cached_on_hub(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers within `timeout` s (a DNS failure otherwise takes ~1 min)."""
    import socket
    import threading
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    reachable = threading.Event()

    def connect() -> None:
        try:
            socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
            reachable.set()
        except OSError:
            pass

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout)
    return reachable.is_set()


# Known failures, recognised in the error text, and what to set instead.
_HINTS = [
    (
        re.compile(r"max_model_len \((\d+)\) is greater than the derived max_model_len \(\w+=(\d+)"),
        "engine.max_model_len {0} is more than the model's context length ({1} tokens): set `engine.max_model_len` "
        "in the task file to at most {1}, or leave it out",
    ),
    (
        re.compile(r"Repo id must be in the form|is not a local folder and is not a valid model identifier"),
        "the model is neither an existing folder nor a Hugging Face id: set `engine.model` in the task file "
        "(or BATCH_ASSETS_MODEL)",
    ),
]


def _failure_text(result, task=None) -> str:
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            error = event.step_failure_data.error
            texts = []
            while error is not None:  # Dagster wraps the user's exception; show the user's
                texts.append(error.message)
                last = error
                error = error.cause
            full = "\n".join(texts)
            for pattern, advice in _HINTS:
                match = pattern.search(full)
                if match:
                    return f"failed in {event.step_key}: {advice.format(*match.groups())}"
            return f"failed in {event.step_key}: {_meaningful_line(last.message)}"
    return "run failed"


def _meaningful_line(message: str) -> str:
    """The line of an error message that says what is wrong (not a documentation link)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information visit")]
    for line in lines:
        if line.startswith("Value error, "):
            return line.removeprefix("Value error, ")
    return lines[-1] if lines else "unknown error"


def _print_outcomes(outcomes: list[PartitionOutcome]) -> None:
    for outcome in outcomes:
        if outcome.skipped:
            status = "UP TO DATE"
        elif not outcome.success:
            status = "FAILED"
        elif outcome.failed_error_checks:
            status = "CHECKS FAILED (" + ", ".join(outcome.failed_error_checks) + ")"
        elif outcome.all_rows_failed:
            status = "ALL ROWS FAILED"
        else:
            status = "OK"
        run = f" run {outcome.run_id[:8]}" if outcome.run_id else ""
        TERMINAL.say(f"{outcome.task}/{outcome.partition_key}: {status}{run}: {outcome.summary}")


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


def command_run(task_name: str, files: list[str], *, replace: bool = False) -> int:
    outcomes = run_partitions(task_name, [Path(f) for f in files], replace=replace)
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
    side_by_side = accuracy_side_by_side(_sample_accuracies(loaded.tasks))
    if side_by_side:
        TERMINAL.say(side_by_side)
    note = demo_note(loaded.tasks)
    if note:
        TERMINAL.say(note)
    return 0 if all_ok and not loaded.errors else 1


def _sample_accuracies(tasks) -> list[tuple[str, str, float, int]]:
    """(task, how it labels, accuracy, rows with a gold label) of each task whose bundled samples
    carry hand-made labels, from the latest materialization of each sample partition."""
    import dagster as dg

    from batch_assets.storage.drop_files import partition_key_for

    found = []
    with open_instance() as instance:
        for task in tasks:
            folder = SAMPLES_DIR / task.name
            if not task.checks.gold_field or not folder.exists():
                continue
            key = dg.AssetKey([task.name, "validated_labels"])
            records = [
                latest_materialization(instance, key, partition_key_for(p.name)) for p in sorted(folder.glob("*"))
            ]
            gold = [(_metadata_value(r, "accuracy"), _metadata_value(r, "rows_with_gold")) for r in records]
            gold = [(accuracy, rows) for accuracy, rows in gold if accuracy is not None and rows]
            if gold:
                rows = sum(rows for _, rows in gold)
                how = (
                    f"embedding similarity, {task.model}"
                    if task.output.method == "similarity"
                    else f"chat model {task.model}, structured outputs"
                )
                found.append((task.name, how, sum(a * r for a, r in gold) / rows, rows))
    return found


def accuracy_side_by_side(accuracies: list[tuple[str, str, float, int]]) -> str | None:
    """The demo's accuracies on the hand-labelled samples, one line per task, aligned."""
    if not accuracies:
        return None
    width = max(len(name) for name, *_ in accuracies)
    lines = [f"  {name:<{width}}  {accuracy:4.0%} of {rows} rows  ({how})" for name, how, accuracy, rows in accuracies]
    return (
        "\nAccuracy on the hand-labelled samples (a few dozen invented rows; measure on your own data):\n"
        + "\n".join(lines)
    )


def demo_note(tasks) -> str | None:
    """The caution printed once after the demo's summaries, when a task ran on the embedded model."""
    from batch_assets.pipeline.task_spec import EMBEDDED_MODEL

    return EMBEDDED_MODEL_NOTE if any(task.model == EMBEDDED_MODEL for task in tasks) else None


EMBEDDED_MODEL_NOTE = """
Note: these labels come from the embedded SmolLM2-135M-Instruct, a 135-million-parameter model that
demonstrates the plumbing (assets, checks, storage, resumable runs); it is not a labeler, and the
accuracy figures above show it. For real labels, point a task at a real model: `engine.model` in its
YAML (a local folder or a Hugging Face model id, run by vLLM on a GPU), `engine.kind: openai` with
`engine.base_url` for an OpenAI-compatible endpoint, or BATCH_ASSETS_MODEL=<model> for every task.
Measure it first on a hand-labelled sample (`checks.gold_field`, README "Accuracy on a labelled sample")."""


def _demo_tasks(tasks) -> bool:
    all_ok = True
    for task in tasks:
        folder = SAMPLES_DIR / task.name
        files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.exists() else []
        if not files:
            TERMINAL.say(f"{task.name}: no bundled samples in {folder}")
            continue
        outcomes = run_partitions(task.name, files, skip_succeeded=True)
        _print_outcomes(outcomes)
        all_ok = all_ok and all(outcome.ok for outcome in outcomes)
    return all_ok


UI_LOCK_NAME = ".batch_assets_ui.lock"


def command_ui(host: str, port: int, workspace: str) -> int:
    """`dg dev` (webserver and daemon) on this home, at most one per home: a second one is refused."""
    import fcntl
    import shutil

    home = prepare_instance()
    handle = (home / UI_LOCK_NAME).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        raise CliError(
            f"the Dagster UI and daemon of {home} already run ({holder}); open that UI, or stop it "
            "(Ctrl-C in its terminal) before starting another"
        ) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}, http://{host}:{port}")
    handle.flush()
    # The lock travels into `dg dev` through exec and lasts as long as it does.
    os.set_inheritable(handle.fileno(), True)
    dg = shutil.which("dg", path=str(Path(sys.executable).parent)) or "dg"
    os.execv(dg, [dg, "dev", "-h", host, "-p", str(port), "-w", workspace])
    return 1  # not reached


def build_parser() -> argparse.ArgumentParser:
    from batch_assets.pipeline.read_prompts import SUPPORTED_SUFFIXES

    parser = argparse.ArgumentParser(prog="batch-assets", description="Offline LLM batch inference as Dagster assets.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run files through a task's pipeline",
        description=(
            "Copy each file into the task's drop zone, register it as a partition and materialize its assets "
            "and checks in this process (one engine start for all files); prints one summary line per file. "
            "Exit status: 0 when every file succeeded, 1 when one failed, failed a blocking check or had only "
            "error rows, 2 for a usage error (nothing run), 130 when interrupted."
        ),
    )
    run.add_argument("task", help="the task to run (its name as `batch-assets tasks` lists it)")
    run.add_argument(
        "files",
        nargs="+",
        help=f"input files ({', '.join(SUPPORTED_SUFFIXES)}); each is copied into the task's drop zone and becomes "
        "one partition named after the file",
    )
    run.add_argument(
        "--replace",
        action="store_true",
        help="let a file replace a different drop file of the same name (from another folder), with its outputs",
    )
    commands.add_parser("tasks", help="list the tasks and their drop zones")
    demo = commands.add_parser("demo", help="run the bundled sample drops of every task")
    for command in (run, demo):
        command.add_argument(
            "--verbose", action="store_true", help="show Dagster's and the engine's logs and full tracebacks here too"
        )
    ui = commands.add_parser("ui", help="start the Dagster UI and daemon (`dg dev`) on this DAGSTER_HOME; one per home")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=3000, help="port to listen on (default 3000)")
    ui.add_argument("--workspace", default="workspace.yaml", help="Dagster workspace file (default workspace.yaml)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    TERMINAL.verbose = getattr(args, "verbose", False)
    # SIGTERM stops the command like Ctrl-C does (a run being executed is then marked failed).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.command == "tasks":
            return command_tasks()
        if args.command == "ui":
            return command_ui(args.host, args.port, args.workspace)
        # Until the command ends (the engine stops last), library output goes to the log file.
        log_path = dagster_home() / "logs" / f"batch-assets-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        with TERMINAL.library_output_to(log_path):
            if args.command == "run":
                return command_run(args.task, args.files, replace=args.replace)
            return command_demo()
    except KeyboardInterrupt:
        TERMINAL.say("stopped (interrupted)")
        return 130
    except CliError as error:
        TERMINAL.say(f"error: {error}")
        return 2
    except Exception as error:  # noqa: BLE001 - the user gets one line; the details go to a log file
        return _unexpected(error)


def _unexpected(error: BaseException) -> int:
    from batch_assets.storage.errors import StorageError

    if TERMINAL.verbose:
        traceback.print_exc()
    else:
        log = dagster_home() / "logs" / f"batch-assets-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
    kind = "" if isinstance(error, StorageError | OSError) else f"{type(error).__name__}: "
    text = _meaningful_line(str(error)) if str(error) else type(error).__name__
    where = "" if TERMINAL.verbose else f" (traceback: {log}; or run with --verbose)"
    TERMINAL.say(f"error: {kind}{text}{where}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
