"""`<task>_drops_sensor`: a new or replaced file in the task's drop zone becomes a partition and is run.

Each tick lists the drop zone (a local folder, or an S3 prefix paged 1,000 keys at a time), and in
the same tick adds a dynamic partition for every new input file and requests its processing
(`SensorResult` with the partition requests, run requests and the new cursor):
- one file found in the tick: one run of that partition (its four assets and checks);
- several: one run per range of up to `runs.max_partitions_per_run` partitions (`partition_ranges`):
  as few runs as that cap allows, of even sizes (20 files at 16: 10 + 10), so a burst of drops pays
  the engine start and the per-run overhead once per range, not per file. Dynamic partitions are
  ordered by when they were added, so the files of one burst form one range.
  The sensor requests these range runs itself instead of a backfill: Dagster's backfill daemon looks
  for new backfills every 30 s (a fixed interval), which a burst would wait for on top of the tick;
  a run requested by the sensor is queued in the tick. Backfills from the UI use the same policy.
A file with more records than the task's `input.max_rows_per_partition` is split into shards
(storage/shards.py), one partition each, and each shard is a run of its own (a shard is as big as a
run should hold); the once-per-version rules below hold per file, over all its shards. Splitting
reads the file, so a tick reads at most `TICK_SPLIT_BYTES` of files: a bigger file is split by a
run of `<task>_split_file` (lib/split_job.py, which says why) and its shards are added and
requested by the first tick after that run; files that would overrun what is left of the tick's
bytes wait for the next tick.
New and replaced files are requested apart (their own runs), so the replaced-file tag below marks
exactly the runs that re-process replaced files.

Once per file version:
- The cursor holds an 8-byte fingerprint of (relative path, version) for every file already
  requested; version = ETag + size on S3, modification time + size locally. About 11 bytes per
  file, so 10,000 files make a ~110 kB cursor. Deleted files drop out of it.
- Run keys are `<partition_key>@<version digest>` (a range: `<first>..<last>@<digest of every
  key and version in it>`): Dagster launches at most one run per key for this sensor, even if a
  tick is retried or the cursor is lost.
- A file whose partition already has `validated_labels` from the same version (for example run
  with `batch-assets run`) is recorded in the cursor without a new run. The version a partition was
  made from is the `source_version` metadata of its raw_prompts materialization. What the
  instance recorded of all the tick's files is read at once (`PartitionRecords`: a few queries
  for thousands of files, not two per file).
- A file that a live `batch-assets run` process is running or about to run (it announces them in
  its lease, see run_recovery.py) gets no run in this tick; a later tick finds it done, or runs it
  if that process died first.
A replaced file (same name, new ETag / modification time) has a new fingerprint, so it is run once
more, in a run tagged `batch_assets/replaced_file=true` when an earlier version of it was read (its
partition's raw_prompts recorded another version; a partition that `batch-assets run` added for
a run that was killed or failed replaces nothing). Files that are not inputs are skipped with
the reason in the tick's log and skip message. At most `max_runs_per_tick` files are requested per
tick (oldest first, grouped into ranges as above); the rest wait for the next tick, which keeps
every tick short.
"""

import base64
import binascii
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import dagster as dg

from batch_assets.lib.partition_versions import PartitionRecords
from batch_assets.lib.run_requests import SOURCE_FILE_TAG, run_requests_for, split_run_request
from batch_assets.lib.split_job import build_split_job, failed_split_runs
from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.runtime.run_recovery import partitions_claimed_by_live_processes
from batch_assets.storage.drop_files import (
    DropFile,
    file_key_of,
    list_drop_files,
    partitions_def_name,
    version_digest,
)
from batch_assets.storage.locations import drop_zone
from batch_assets.storage.shards import (
    file_partition_keys,
    partitions_by_file,
    retire,
    retired_partitions,
    split_cost,
)

# Files requested per tick at most (one run each, or ranges of them); the daemon creates and queues
# each run, so this bounds a tick.
MAX_RUNS_PER_TICK = 500
# Bytes of drop files one tick may read to split them into shards (a CSV this size takes ~0.2 s to
# scan locally); a file over it alone is split by a run (lib/split_job.py).
TICK_SPLIT_BYTES = 16 << 20
# A local file must be unchanged this long before it counts as fully copied in.
LOCAL_SETTLE_SECONDS = 5.0
CURSOR_VERSION = "v2:"
FINGERPRINT_BYTES = 8
SKIPPED_NAMES_SHOWN = 20


def file_fingerprint(drop: DropFile) -> bytes:
    return hashlib.blake2b(f"{drop.relative_path}\0{drop.version}".encode(), digest_size=FINGERPRINT_BYTES).digest()


def encode_cursor(fingerprints: Iterable[bytes]) -> str:
    return CURSOR_VERSION + base64.b64encode(b"".join(sorted(fingerprints))).decode("ascii")


def decode_cursor(cursor: str | None) -> set[bytes]:
    """The fingerprints in a cursor; raises ValueError for a cursor this sensor did not write."""
    if not cursor:
        return set()
    if not cursor.startswith(CURSOR_VERSION):
        raise ValueError("unknown cursor format")
    try:
        raw = base64.b64decode(cursor[len(CURSOR_VERSION) :], validate=True)
    except binascii.Error as error:
        raise ValueError(f"corrupt cursor: {error}") from None
    if len(raw) % FINGERPRINT_BYTES:
        raise ValueError("corrupt cursor: truncated fingerprint")
    return {raw[i : i + FINGERPRINT_BYTES] for i in range(0, len(raw), FINGERPRINT_BYTES)}


@dataclass
class TickPlan:
    """What one tick does: files to run (with whether each replaces an earlier version) and the next cursor."""

    to_run: list[tuple[DropFile, bool]] = field(default_factory=list)
    to_split: list[DropFile] = field(default_factory=list)  # too big to split in a tick: a split run each
    seen: set[bytes] = field(default_factory=set)
    known: int = 0
    already_done: int = 0
    waiting: int = 0
    in_progress: int = 0


def plan_tick(
    files: list[DropFile],
    seen: set[bytes],
    existing_partitions: set[str],
    *,
    max_runs: int | None,
    already_done: Callable[[DropFile], bool] = lambda drop: False,
    in_progress: Callable[[DropFile], bool] = lambda drop: False,
    read_version: Callable[[DropFile], str | None] = lambda drop: None,
    split_cost: Callable[[DropFile], int | None] = lambda drop: 0,
    split_budget: int | None = None,
) -> TickPlan:
    """Pure decision of a tick: which files are new or replaced since the cursor `seen`.

    Finding a file's partitions may read it (`split_cost`: bytes, None when unknown): the tick reads
    at most `split_budget` bytes (None: no limit); a file over it alone is left to a split run, one
    over what is left of it waits for the next tick (neither is in the cursor yet).

    A file replaces an earlier one when its partition's (or a shard's) latest `raw_prompts` read another
    version of it (`read_version`). A partition alone proves nothing: `batch-assets run` adds it before its run,
    which may have been killed or failed before the file was read, or after reading this version."""
    plan = TickPlan()
    existing_files = {file_key_of(key) for key in existing_partitions}
    fresh: list[tuple[bytes, DropFile]] = []
    for drop in files:
        fingerprint = file_fingerprint(drop)
        if fingerprint in seen:
            plan.seen.add(fingerprint)
            plan.known += 1
        else:
            fresh.append((fingerprint, drop))
    # Oldest first, so a burst of files is worked through in the order it arrived.
    fresh.sort(key=lambda item: (item[1].modified or 0.0, item[1].relative_path))
    spent = 0  # bytes read to split files
    for fingerprint, drop in fresh:
        if in_progress(drop):
            plan.in_progress += 1  # not in the cursor: looked at again next tick
            continue
        # Files found already done count too, so a tick's work stays bounded.
        if max_runs is not None and len(plan.to_run) + plan.already_done + len(plan.to_split) >= max_runs:
            plan.waiting += 1
            continue
        cost = split_cost(drop)
        if split_budget is not None:
            if cost is None or cost > split_budget:
                plan.to_split.append(drop)
                continue
            if cost > split_budget - spent:
                plan.waiting += 1
                continue
            spent += cost
        existing = drop.partition_key in existing_files
        if existing and already_done(drop):
            plan.already_done += 1
        else:
            replaced = existing and read_version(drop) not in (None, drop.version)
            plan.to_run.append((drop, replaced))
        plan.seen.add(fingerprint)
    return plan


def _partition_keys_of(task: TaskSpec, log) -> Callable[[DropFile], list[str]]:
    """A tick's memo of each file's partitions (one pass over a big file per version, kept in
    storage too). A file whose records cannot be counted (a corrupt gzip or parquet file, a bad CSV
    header) is one partition: its run fails with that error, naming the file."""
    known: dict[tuple[str, str], list[str]] = {}

    def keys_of(drop: DropFile) -> list[str]:
        file = (drop.relative_path, drop.version)
        if file not in known:
            try:
                known[file] = file_partition_keys(task.name, drop, task.input.shard_rows)
            except DropFileError as error:
                log.warning(f"{drop.relative_path}: cannot be split into shards ({error}); run as one partition")
                known[file] = [drop.partition_key]
        return known[file]

    return keys_of


def _skipped_text(skipped: dict[str, str]) -> str:
    shown = [f"{name}: {reason}" for name, reason in list(skipped.items())[:SKIPPED_NAMES_SHOWN]]
    more = f", and {len(skipped) - SKIPPED_NAMES_SHOWN} more" if len(skipped) > SKIPPED_NAMES_SHOWN else ""
    return f"skipped {len(skipped)} file(s): " + "; ".join(shown) + more


def build_drops_sensor(
    task: TaskSpec,
    job,
    *,
    split_job: dg.JobDefinition | None = None,
    max_runs_per_tick: int | None = MAX_RUNS_PER_TICK,
    settle_seconds: float = LOCAL_SETTLE_SECONDS,
) -> dg.SensorDefinition:
    """The sensor over the task's drop zone; its runs are of `job` (the task's four assets and their
    checks) and, for a task whose files are split into shards, of `split_job` (the task's
    `build_split_job`, made here when not given)."""
    # The job's tags (a GPU count for the Kubernetes run launcher) are on each request too, so that
    # they show in the tick.
    job_tags = {key: value if isinstance(value, str) else json.dumps(value) for key, value in (job.tags or {}).items()}
    if task.input.shard_rows is not None:
        split_job = split_job or build_split_job(task)
    targets = [job, split_job] if split_job else [job]
    jobs = Jobs(job.name, split_job.name if split_job else "")

    @dg.sensor(
        name=f"{task.name}_drops_sensor",
        jobs=targets,
        minimum_interval_seconds=task.sensor.minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING
        if task.sensor.running_by_default
        else dg.DefaultSensorStatus.STOPPED,
        description=(
            f"Turns each new or replaced file in the `{task.name}` drop zone "
            f"(`<BATCH_ASSETS_DATA>/drops/{task.name}/`) into a partition and runs it: one file, one run; "
            f"several, one run per range of up to {task.runs.max_partitions_per_run} partitions. "
            "Skips hidden, temporary and unknown files, with the reason in the tick."
        ),
    )
    def drops_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        return drops_tick(
            context, task, job_tags, jobs, max_runs_per_tick=max_runs_per_tick, settle_seconds=settle_seconds
        )

    return drops_sensor


@dataclass(frozen=True)
class Jobs:
    """The names of the jobs the drops sensor requests runs of."""

    pipeline: str
    split: str  # "" for a task whose files are not split (no file is ever over `split_cost` 0)


def _cursor_fingerprints(context: dg.SensorEvaluationContext) -> set[bytes]:
    """The files the sensor requested before; all of them checked again when the cursor is unreadable."""
    try:
        return decode_cursor(context.cursor)
    except ValueError as error:
        # Run keys still prevent repeated runs for files requested before.
        context.log.warning(f"ignoring the sensor cursor ({error}); every file is checked again")
        return set()


def plan_drops_tick(
    context: dg.SensorEvaluationContext,
    task: TaskSpec,
    files: list[DropFile],
    seen: set[bytes],
    ordered: list[str],
    registered: Mapping[str, list[str]],
    keys_of: Callable[[DropFile], list[str]],
    max_runs_per_tick: int | None,
) -> TickPlan:
    """`plan_tick` with what the instance, the kept shard plans and the live `batch-assets` processes
    say about each file (`registered`: the partitions in `ordered`, by file)."""
    # By file, not by partition: a file's partitions may take a pass over it to know.
    claimed = {
        (file_key_of(key), digest)
        for key, digest in partitions_claimed_by_live_processes(context.instance.root_directory, task.name)
    }
    # The instance's records of every partition the plan may ask about, read at once.
    records = PartitionRecords(context.instance, task.name)
    records.load(
        key for drop in files if file_fingerprint(drop) not in seen for key in registered.get(drop.partition_key, [])
    )
    return plan_tick(
        files,
        seen,
        set(ordered),
        max_runs=max_runs_per_tick,
        already_done=lambda drop: records.file_done(drop, keys_of(drop)),
        in_progress=lambda drop: (drop.partition_key, version_digest(drop.version)) in claimed,
        read_version=lambda drop: records.file_read_version(registered, drop),
        split_cost=lambda drop: split_cost(task.name, drop, task.input.shard_rows),
        split_budget=TICK_SPLIT_BYTES,
    )


def drops_tick(
    context: dg.SensorEvaluationContext,
    task: TaskSpec,
    job_tags: Mapping[str, str],
    jobs: Jobs,
    *,
    max_runs_per_tick: int | None,
    settle_seconds: float,
) -> dg.SensorResult:
    """One tick of the drops sensor: list the drop zone, plan, and request the runs."""
    started = time.monotonic()
    zone = drop_zone(task.name)
    # A listing failure (no bucket, access denied, endpoint down) fails the tick with a StorageError
    # naming the URL and cause; the cursor stays as it was.
    files, skipped = list_drop_files(task.name, zone, settle_seconds=settle_seconds)
    seen = _cursor_fingerprints(context)
    ordered = list(context.instance.get_dynamic_partitions(partitions_def_name(task.name)))
    keys_of = _partition_keys_of(task, context.log)
    registered = partitions_by_file(ordered)
    plan = plan_drops_tick(context, task, files, seen, ordered, registered, keys_of, max_runs_per_tick)
    context.log.info(
        f"{len(files)} input file(s) in {zone}: {len(plan.to_run)} to run, {plan.known} already requested, "
        f"{plan.already_done} already done, {plan.in_progress} being run by batch-assets, "
        f"{len(plan.to_split)} being split by {jobs.split} runs, {plan.waiting} waiting for the next tick "
        f"({time.monotonic() - started:.2f} s)"
    )
    if skipped:
        context.log.info(_skipped_text(skipped))
    cursor = encode_cursor(plan.seen)
    if not plan.to_run and not plan.to_split:
        reason = f"no new or replaced files ({len(files)} known)"
        if skipped:
            reason += "; " + _skipped_text(skipped)
        return dg.SensorResult(skip_reason=dg.SkipReason(reason), cursor=cursor if plan.seen != seen else None)
    return _tick_requests(context, task, plan, ordered, registered, keys_of, job_tags, jobs, cursor)


def _warn_of_failed_splits(context: dg.SensorEvaluationContext, task: str, split_requests: list[dg.RunRequest]) -> None:
    """Name the files whose split run failed: Dagster does not launch a run key twice, so they wait
    for a new version of the file or a re-execution of the run."""
    by_key = {request.run_key: request.tags[SOURCE_FILE_TAG] for request in split_requests if request.run_key}
    for key, run_id in failed_split_runs(context.instance, task, list(by_key)).items():
        context.log.warning(
            f"{by_key[key]}: its split run {run_id} failed (its log says why); the file waits until it is "
            "replaced, or until that run is re-executed"
        )


def _tick_requests(
    context: dg.SensorEvaluationContext,
    task: TaskSpec,
    plan: TickPlan,
    ordered: list[str],
    registered: Mapping[str, list[str]],
    keys_of: Callable[[DropFile], list[str]],
    job_tags: Mapping[str, str],
    jobs: Jobs,
    cursor: str,
) -> dg.SensorResult:
    """The tick's new partitions (and those the new file versions retire) and its runs: of the files
    to run, and a split run of each file too big to split in the tick."""
    partitions_name = partitions_def_name(task.name)
    existing = set(ordered)
    # Added oldest file first: the partitions' order, which decides the ranges, is arrival order.
    new_partitions = list(dict.fromkeys(key for drop, _ in plan.to_run for key in keys_of(drop) if key not in existing))
    retired_by_file = [
        (drop, retired_partitions(registered.get(drop.partition_key, []), drop.partition_key, keys_of(drop)))
        for drop, _ in plan.to_run
    ]
    retired = [key for _, keys in retired_by_file for key in keys]
    if retired:
        context.log.info(f"retiring partitions the new file versions split differently: {retired}")
        for drop, keys in retired_by_file:
            if keys:
                retire(task.name, drop, keys_of(drop), keys, task.input.shard_rows)
    # New partitions are added in this order before the tick's runs are created.
    run_requests = run_requests_for(
        plan.to_run,
        ordered + new_partitions,
        task.runs.max_partitions_per_run,
        job_tags=job_tags,
        keys_of=keys_of,
        job_name=jobs.pipeline,
    )
    split_requests = [split_run_request(drop, task.name, jobs.split) for drop in plan.to_split]
    _warn_of_failed_splits(context, task.name, split_requests)
    partition_requests: list = []
    if new_partitions:
        partition_requests.append(dg.AddDynamicPartitionsRequest(partitions_name, new_partitions))
    if retired:
        partition_requests.append(dg.DeleteDynamicPartitionsRequest(partitions_name, retired))
    return dg.SensorResult(
        run_requests=run_requests + split_requests, dynamic_partitions_requests=partition_requests, cursor=cursor
    )
