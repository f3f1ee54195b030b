"""`batch-assets run` and `batch-assets demo`: files run through their task's job in this process.

`run_partitions` copies each file into the task's drop zone, registers its partitions and
materializes them through the task's Dagster job (the same job, assets and checks the UI and the
sensors use), recorded in the instance at `DAGSTER_HOME`. The runs execute in this process, so the
engine starts once for all the files of one call; they are grouped as a backfill of these partitions
would be (ranges of adjacent partitions, each shard of a big file alone) and tagged like the
sensor's runs, plus the path each file came from, so a later file of the same name from another
folder is not taken for a new version of it.

Whoever calls it hears of the run through a `RunReporter` (the command line prints to the
terminal; a test can leave it out). Problems the user can fix before anything ran raise one of
`REFUSALS`; anything else is a failed run in the outcome.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from batch_assets.app.projects import BUNDLED, ProjectRefused, TaskSource
from batch_assets.app.run_outcomes import (
    PartitionOutcome,
    accuracy_side_by_side,
    failed_before_inference,
    file_outcome,
    partition_outcome,
    run_outcomes,
    sample_accuracies,
)
from batch_assets.engines.kinds import engine_kind, resolve_settings
from batch_assets.engines.model_check import ModelNotFound, check_model
from batch_assets.engines.vllm_lifecycle import keep_engine_warm, shutdown_engines
from batch_assets.lib.automation import materialized_code_versions
from batch_assets.lib.partition_versions import file_validated_from_version
from batch_assets.lib.run_requests import (
    LAUNCHED_BY_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    SOURCE_FILE_TAG,
    SOURCE_VERSION_TAG,
    partition_ranges,
)
from batch_assets.pipeline.engine_contract import ResolvedSettings
from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.pipeline.task_spec import EMBEDDED_MODEL, TaskSpec, TaskSpecError, engine_lora_rank
from batch_assets.runtime.instance import dagster_home, home_lock, open_instance
from batch_assets.runtime.interrupts import Stopped, raise_if_stopped, stop_requested
from batch_assets.runtime.pool_waits import install_pool_workarounds
from batch_assets.runtime.run_recovery import (
    ProcessLease,
    fail_runs_of_dead_processes,
    others_wait_for_pool,
    wait_for_pool_slot,
)
from batch_assets.storage.drop_files import DropFile, find_drop_file, partitions_def_name, version_digest
from batch_assets.storage.drop_zone_copies import CopyRefused, NamedFile, copy_into_drop_zone, read_named_files
from batch_assets.storage.partition_registration import add_partitions, file_partitions
from batch_assets.storage.shards import partitions_by_file

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
# The absolute path of the file a CLI run was given, so a later file of the same name from another
# folder is not taken for a new version of it.
ORIGIN_TAG = "batch_assets/origin"
# A run over several files (up to the task's `runs.max_partitions_per_run`) records each file's
# origin here instead, as JSON {partition key: path}.
ORIGINS_TAG = "batch_assets/origins"


class RunRefused(Exception):
    """The task named cannot be run (unknown, or its task file failed to load)."""


# Problems the user can fix, found before anything was copied or run (exit status 2 at the command line).
REFUSALS: tuple[type[Exception], ...] = (RunRefused, CopyRefused, ModelNotFound, ProjectRefused)


def _ignore(*_args: object) -> None:
    pass


@dataclass(frozen=True)
class RunReporter:
    """What a run tells whoever started it; every part may be left out (then nothing is reported)."""

    # A note while files run: a file replaced, partitions retired, a wait for the pool, a range split up.
    say: Callable[[str], None] = _ignore
    # The files' outcomes, once per `run_partitions` call, as its runs are done.
    files_done: Callable[[list[PartitionOutcome]], None] = _ignore
    # A handler for the log records of each run, given the run's label (`task/partition`): the
    # command line turns the inference progress lines into its own.
    run_log_handler: Callable[[str], logging.Handler] | None = None
    # Dagster's own console log of each run too (`--verbose`).
    console_log: bool = False


QUIET = RunReporter()  # for callers that only want the outcomes


@dataclass
class _RegisteredFile:
    named: NamedFile
    drop: DropFile  # the copy in the drop zone
    digest: str  # of the drop file's version, as the sensor tags its runs
    partition_keys: list[str]  # its own, or its shards'


@dataclass
class _RunContext:
    """What the steps of one `run_partitions` call share."""

    task: TaskSpec
    instance: dg.DagsterInstance
    job: dg.JobDefinition
    lease: ProcessLease
    reporter: RunReporter
    use_result_cache: bool = True  # False: `inference_outputs` neither reads nor writes the result cache
    # The code version of each of the task's versioned assets in the definitions run (asset name ->
    # version): a partition materialized with others is not up to date.
    code_versions: dict[str, str | None] = field(default_factory=dict)


def run_partitions(
    task_name: str,
    files: list[Path],
    *,
    skip_up_to_date: bool = False,
    replace: bool = False,
    reporter: RunReporter = QUIET,
    definitions: dg.Definitions | None = None,
    use_result_cache: bool = True,
    source: TaskSource = BUNDLED,
) -> list[PartitionOutcome]:
    """Run the files through the task's job: one outcome per file, in the order named. With
    `skip_up_to_date`, a file whose partitions are materialized from this version of it and with the
    assets' current code versions is not run again (its outcome says UP TO DATE).
    `definitions`: the code location's, when the caller built them already (the demo, for every task).
    `use_result_cache=False`: the runs neither read nor write the task's result cache.
    `source`: where the task and its definitions come from (a user's dg project, or the bundled tasks)."""
    # Imported here: importing the code location builds its definitions.
    from batch_assets.lib.task_definitions import pipeline_job_name

    install_pool_workarounds()  # this process executes the runs (runtime/pool_waits.py)
    task = loaded_task(task_name, source)
    named = read_named_files(files)
    definitions = definitions or source.definitions()
    check_model(_resolved(task, definitions))
    # One process runs every named file, so the in-process engine is started once.
    job = definitions.resolve_job_def(pipeline_job_name(task_name))
    with open_instance() as instance:
        context = _RunContext(task, instance, job, ProcessLease(dagster_home()), reporter, use_result_cache)
        context.code_versions = _code_versions(definitions, task.name)
        return _run_files(context, named, replace, skip_up_to_date)


def _code_versions(definitions: dg.Definitions, task_name: str) -> dict[str, str | None]:
    """The code version of each of the task's versioned assets, as these definitions build them."""
    from batch_assets.pipeline.code_versions import VERSIONED_ASSETS

    keys = [dg.AssetKey([task_name, asset]) for asset in VERSIONED_ASSETS]
    return {key.path[-1]: definitions.resolve_assets_def(key).code_versions_by_key.get(key) for key in keys}


def register_partitions(
    task_name: str, files: list[Path], source: TaskSource, say: Callable[[str], None], replace: bool = False
) -> dict[str, list[str]]:
    """What `run_partitions` does before it runs, and no more: the files copied into the task's drop
    zone and their partitions registered, for Dagster's own verbs (`dg launch`, the launchpad, the
    drops sensor) to run. {file key: its partition keys (its own, or its shards')}."""
    from batch_assets.lib.task_definitions import pipeline_job_name

    task = loaded_task(task_name, source)
    named = read_named_files(files)
    job = source.definitions().resolve_job_def(pipeline_job_name(task_name))
    with open_instance() as instance:
        context = _RunContext(task, instance, job, ProcessLease(dagster_home()), RunReporter(say=say))
        with context.lease:  # released on return: the partitions are anyone's to run
            return {file.named.key: file.partition_keys for file in _register_files(context, named, replace=replace)}


def _run_files(
    context: _RunContext, named: list[NamedFile], replace: bool, skip_up_to_date: bool
) -> list[PartitionOutcome]:
    """`run_partitions` once its task, files, job and instance are known."""
    instance, reporter, task_name = context.instance, context.reporter, context.task.name
    with context.lease:
        registered = _register_files(context, named, replace=replace)
        for run_id in fail_runs_of_dead_processes(instance):
            reporter.say(
                f"run {run_id[:8]}: its batch-assets process died before it finished; marked failed, pool slots freed"
            )
        by_key = _up_to_date(context, registered) if skip_up_to_date else {}
        to_run = [key for key in _partition_keys(registered) if key not in by_key]
        by_key |= _run_in_ranges(context, registered, to_run)
        registered = _run_replaced_files(context, registered, by_key)
        outcomes = [file_outcome(instance, task_name, f.named.key, f.partition_keys, by_key) for f in registered]
        reporter.files_done(outcomes)
    return outcomes


def run_demo(tasks: Sequence[TaskSpec], reporter: RunReporter, *, use_result_cache: bool = True) -> bool:
    """The bundled sample drops of every task, skipping files already validated from the same
    content; whether every file came out OK."""
    from batch_assets.lib.task_definitions import build_definitions

    all_ok = True
    definitions = build_definitions()
    # One engine start per model: the tasks of one model run one after another, the longest context
    # first, so that its engine serves the others too (`VLLMSettings.serves`); on a GPU, where the
    # chat and the embedding engine take turns, each starts once.
    with keep_engine_warm():
        for task in sorted(tasks, key=lambda task: _engine_order(task, definitions)):
            folder = SAMPLES_DIR / task.name
            files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.exists() else []
            if not files:
                reporter.say(f"{task.name}: no bundled samples in {folder}")
                continue
            outcomes = run_partitions(
                task.name,
                files,
                skip_up_to_date=True,
                reporter=reporter,
                definitions=definitions,
                use_result_cache=use_result_cache,
            )
            all_ok = all_ok and all(outcome.ok for outcome in outcomes)
    with open_instance() as instance:
        side_by_side = accuracy_side_by_side(sample_accuracies(instance, tasks, SAMPLES_DIR))
    if side_by_side:
        reporter.say(side_by_side)
    return all_ok


def _engine_order(task: TaskSpec, definitions: dg.Definitions) -> tuple:
    """Where the demo runs a task: by engine and model, the tasks with a LoRA adapter after the others
    (their engine has LoRA on), the largest adapter rank and the longest context first, then by name."""
    try:
        settings = resolve_settings(task, definitions.resources)
    except TaskSpecError:
        return ("~", "", False, 0, 0, task.name)  # refused when it runs, with the reason, after the others
    lora = settings.lora
    rank = engine_lora_rank(lora.rank or 0) if lora is not None else 0
    return (settings.kind, settings.model, lora is not None, -rank, -settings.max_model_len, task.name)


def demo_note(tasks: Sequence[TaskSpec]) -> str | None:
    """The caution printed once after the demo's summaries, when a task ran on the embedded model
    (a task its engine refused ran on none)."""
    return EMBEDDED_MODEL_NOTE if any(_model_or_none(task) == EMBEDDED_MODEL for task in tasks) else None


def _model_or_none(task: TaskSpec) -> str | None:
    """The model the task runs; None when its engine refused it or an endpoint serves its own."""
    try:
        settings = resolve_settings(task)
    except TaskSpecError:
        return None
    return None if settings.model_from_server else settings.model


EMBEDDED_MODEL_NOTE = """
Note: these labels come from the embedded SmolLM2-135M-Instruct, a 135-million-parameter model that
demonstrates the plumbing (assets, checks, storage, resumable runs); it is not a labeler, and the
accuracy figures above show it. For real labels, point a task at a real model: `engine.model` in its
YAML (a local folder or a Hugging Face model id, run by vLLM on a GPU), `engine.kind: openai` with
`engine.base_url` for an OpenAI-compatible endpoint, or BATCH_ASSETS_MODEL=<model> for every chat task.
Measure it first on a hand-labelled sample (`checks.gold_field`, docs/outputs.md "Accuracy on a labelled sample")."""


def _resolved(task: TaskSpec, definitions: dg.Definitions) -> ResolvedSettings:
    """The task's settings as the engine of these definitions decides them; refused when they do not fit."""
    try:
        return resolve_settings(task, definitions.resources)
    except TaskSpecError as exc:
        raise RunRefused(str(exc)) from None


def loaded_task(task_name: str, source: TaskSource) -> TaskSpec:
    loaded = source.load_tasks()
    tasks = {task.name: task for task in loaded.tasks}
    for error in loaded.errors:
        if error.name == task_name:
            raise RunRefused(f"task {task_name!r} cannot be loaded: {error.message}")
    if task_name not in tasks:
        raise RunRefused(f"unknown task {task_name!r} in {source.describe()}; tasks: {', '.join(sorted(tasks))}")
    return tasks[task_name]


def _register_files(context: _RunContext, named: list[NamedFile], *, replace: bool) -> list[_RegisteredFile]:
    """Copy the files into the drop zone, register their partitions and claim them in this process's
    lease (so a drop sensor does not queue them again)."""
    task, instance, say = context.task, context.instance, context.reporter.say
    # Checking, copying and registering under the home's lock: two commands naming files of the
    # same name see each other's copy, and never add the same partition twice.
    with home_lock(dagster_home()):
        copy_into_drop_zone(
            task.name,
            named,
            last_origin=lambda file: _last_origin(instance, context.job.name, file.key),
            replace=replace,
            say=say,
            input_spec=task.input,  # an image task's files bring the pictures they name beside them
        )
        return _register_drops(context, named)


def _register_drops(context: _RunContext, named: list[NamedFile]) -> list[_RegisteredFile]:
    """Register the partitions of the files' copies as they are in the drop zone now (the caller
    holds the home's lock)."""
    task, instance = context.task, context.instance
    drops = {file.key: find_drop_file(task.name, file.key) for file in named}
    # A file with more records than input.max_rows_per_partition runs as several shards.
    registered_keys = partitions_by_file(instance.get_dynamic_partitions(partitions_def_name(task.name)))
    say = context.reporter.say
    registered = [
        _RegisteredFile(
            file,
            drops[file.key],
            version_digest(drops[file.key].version),
            file_partitions(instance, task, drops[file.key], registered_keys.get(file.key, []), say=say),
        )
        for file in named
    ]
    add_partitions(instance, partitions_def_name(task.name), _partition_keys(registered))
    context.lease.claim(task.name, [(key, file.digest) for file in registered for key in file.partition_keys])
    return registered


# Rounds of "the drop file was replaced while it ran: run its new version" before the command gives up.
_REPLACED_ROUNDS = 3


def _run_replaced_files(
    context: _RunContext, files: list[_RegisteredFile], by_key: dict[str, PartitionOutcome]
) -> list[_RegisteredFile]:
    """Files replaced in the drop zone while they ran are split again and run whole at their new
    version, so that the command ends with each file labelled at one version (`by_key` gets the new
    outcomes); the files as finally run."""
    for _ in range(_REPLACED_ROUNDS):
        replaced = [file for file in files if _replaced_since(context.task.name, file)]
        if not replaced:
            break
        for file in replaced:
            context.reporter.say(f"{file.named.key}: replaced in the drop zone while it ran; running its new version")
        with home_lock(dagster_home()):
            again = {file.named.key: file for file in _register_drops(context, [f.named for f in replaced])}
        files = [again.get(file.named.key, file) for file in files]
        by_key |= _run_in_ranges(context, list(again.values()), _partition_keys(list(again.values())))
    return files


def _replaced_since(task_name: str, file: _RegisteredFile) -> bool:
    try:
        return find_drop_file(task_name, file.named.key).version != file.drop.version
    except (FileNotFoundError, DropFileError):
        return False  # removed or refused: its outcome says what its run met


def _partition_keys(files: list[_RegisteredFile]) -> list[str]:
    return list(dict.fromkeys(key for file in files for key in file.partition_keys))


def _last_origin(instance: dg.DagsterInstance, job_name: str, key: str) -> str | None:
    """The file the newest CLI run of this partition was given (None when unknown): a run of this
    file alone tags its origin, a run over several files tags each file's origin in one JSON tag."""
    singles = list(
        instance.get_run_records(filters=dg.RunsFilter(job_name=job_name, tags={"dagster/partition": key}), limit=20)
    )
    # A file run as shards: each shard's run is tagged with the file's key.
    singles += instance.get_run_records(
        filters=dg.RunsFilter(job_name=job_name, tags={SOURCE_FILE_TAG: key, LAUNCHED_BY_TAG: "cli"}), limit=20
    )
    ranges = instance.get_run_records(filters=dg.RunsFilter(job_name=job_name, tags={LAUNCHED_BY_TAG: "cli"}), limit=50)
    # (when, origin); the creation time is the run record's, not the run's (DagsterRun has none).
    candidates = [(record.create_timestamp, record.dagster_run.tags.get(ORIGIN_TAG)) for record in singles]
    candidates += [
        (record.create_timestamp, json.loads(record.dagster_run.tags.get(ORIGINS_TAG, "{}")).get(key))
        for record in ranges
    ]
    known = [(when, origin) for when, origin in candidates if origin is not None]
    return max(known, key=lambda candidate: candidate[0])[1] if known else None


def _up_to_date(context: _RunContext, files: list[_RegisteredFile]) -> dict[str, PartitionOutcome]:
    """Outcomes (UP TO DATE) of the partitions of each file whose every partition is already
    validated from this version of the file, each versioned asset's latest materialization made with
    its current code version (a task edit that changes outputs makes the file run again)."""
    task_name, instance = context.task.name, context.instance
    current = [
        file for file in files if file_validated_from_version(instance, task_name, file.drop, file.partition_keys)
    ]
    keys = [key for file in current for key in file.partition_keys]
    stale: set[str] = set()
    for asset, version in context.code_versions.items():
        made = materialized_code_versions(instance, dg.AssetKey([task_name, asset]), keys)
        stale |= {key for key in keys if made.get(key) != version}
    return {
        key: partition_outcome(task_name, key, instance, run_id=None, skipped=True)
        for file in current
        if not stale & set(file.partition_keys)
        for key in file.partition_keys
    }


def _run_in_ranges(context: _RunContext, files: list[_RegisteredFile], keys: list[str]) -> dict[str, PartitionOutcome]:
    """Run the partitions `keys`, grouped as a backfill of these partitions is: one run per range of
    adjacent partitions, up to the task's `runs.max_partitions_per_run`, one engine stream per run."""
    task, instance, say = context.task, context.instance, context.reporter.say
    file_of = {key: file for file in files for key in file.partition_keys}
    shards = [key for key, file in file_of.items() if key != file.named.key]
    ordered = instance.get_dynamic_partitions(partitions_def_name(task.name))
    pool = engine_kind(task).pool
    by_key: dict[str, PartitionOutcome] = {}
    ranges = list(partition_ranges(ordered, keys, task.runs.max_partitions_per_run, alone=shards))
    # No range left to run: the last one's engine shuts down while its run validates and checks.
    with keep_engine_warm(
        wanted_elsewhere=lambda: others_wait_for_pool(instance, pool), wanted_later=lambda: bool(ranges)
    ):
        while ranges:
            raise_if_stopped()
            run_keys = ranges.pop(0)
            wait_for_pool_slot(instance, pool, say=say, before_waiting=shutdown_engines)
            try:
                result = _execute(context, run_keys, file_of)
            except BaseException:  # Dagster's own interrupt error (not a KeyboardInterrupt) after Ctrl-C
                if stop_requested(wait_for_signal=True):
                    raise Stopped() from None
                raise
            raise_if_stopped()
            if len(run_keys) > 1 and failed_before_inference(result):
                # Dagster fails a step for every partition of its range: a bad file (unreadable,
                # missing column) or a failed blocking check of one file would fail the others too.
                # Run the range again file by file, so only the bad file fails; the engine stays
                # warm in this process, and checkpoints and the result cache keep finished work.
                say(f"{_run_label(task.name, run_keys)}: failed as a whole; running its files one by one")
                ranges[:0] = [[key] for key in run_keys]
                continue
            by_key |= {
                outcome.partition_key: outcome for outcome in run_outcomes(task.name, run_keys, result, instance)
            }
    return by_key


def _run_label(task_name: str, run_keys: list[str]) -> str:
    if len(run_keys) == 1:
        return f"{task_name}/{run_keys[0]}"
    return f"{task_name}/{run_keys[0]}..{run_keys[-1]} ({len(run_keys)} files)"


def _execute(
    context: _RunContext, run_keys: list[str], file_of: dict[str, _RegisteredFile]
) -> dg.ExecuteInProcessResult:
    """One run of the job in this process: a partition, or a range of adjacent ones, tagged as the
    sensor tags its runs, with the files' origins."""
    selection: dict[str, Any]
    if len(run_keys) == 1:
        file = file_of[run_keys[0]]
        selection = {"partition_key": run_keys[0]}
        tags = {SOURCE_FILE_TAG: file.named.key, SOURCE_VERSION_TAG: file.digest, ORIGIN_TAG: file.named.origin}
    else:
        selection = {}
        tags = {
            RANGE_START_TAG: run_keys[0],
            RANGE_END_TAG: run_keys[-1],
            ORIGINS_TAG: json.dumps({key: file_of[key].named.origin for key in run_keys}),
        }
    run_job, run_config = _job_reporting_to(context.reporter, context.job, _run_label(context.task.name, run_keys))
    if not context.use_result_cache:
        # `inference_outputs`' launch config, as the launchpad sets it; its op is named by its asset key.
        op_name = dg.AssetKey([context.task.name, "inference_outputs"]).to_python_identifier()
        run_config["ops"] = {op_name: {"config": {"use_result_cache": False}}}
    return run_job.execute_in_process(
        run_config=run_config,
        instance=context.instance,
        raise_on_error=False,
        tags={**tags, LAUNCHED_BY_TAG: "cli", **context.lease.tags()},
        **selection,
    )


def _job_reporting_to(reporter: RunReporter, job: dg.JobDefinition, label: str) -> tuple[dg.JobDefinition, dict]:
    """The job with the reporter's loggers added; everything else stays in the run's log."""
    loggers: dict[str, dg.LoggerDefinition] = {}
    config: dict[str, Any] = {}
    make_handler = reporter.run_log_handler
    if make_handler is not None:

        @dg.logger
        def cli_progress(_init_context) -> logging.Logger:
            logger = logging.Logger(f"batch_assets.cli.{label}", logging.INFO)
            logger.addHandler(make_handler(label))
            return logger

        loggers["cli_progress"] = cli_progress
        config["cli_progress"] = {}
    if reporter.console_log:
        loggers["console"] = dg.colored_console_logger
        config["console"] = {"config": {"log_level": "INFO"}}
    return job.with_logger_defs({**job.loggers, **loggers}), {"loggers": config}
