"""The four assets of a task, built from its YAML by one factory.

    drop file ─► raw_prompts ─► formatted_prompts ─► inference_outputs ─► validated_labels

Each asset is partitioned by drop file (one dynamic partition per file) and stored as parquet at
`<data>/storage/<task>/<asset>/<partition_key>.parquet` by the `parquet_storage` IO manager.
A run covers one partition or a range of up to `runs.max_partitions_per_run` of them
(`BackfillPolicy.multi_run`): every asset loops over `context.partition_keys`, returns one frame per
partition (a dict keyed by partition key) and records its metadata per partition, so outputs,
metadata and checks stay per partition while the engine starts once per run.
The row-level work lives in pure modules (parsing, formatting, inference, validation); this file
is the Dagster glue: reading the drop, calling them, and reporting metadata. What differs between
kinds of task (records for a chat model, embeddings, similarity labels, OpenAI batch lines) is asked
of the task's format object (`pipeline/task_formats.py`), never tested here; the metadata is built
by `asset_metadata.py`, which the checks share.
"""

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import dagster as dg
import polars as pl
from pydantic import Field
from upath import UPath

from batch_assets.engines.kinds import engine_for, engine_kind
from batch_assets.lib.asset_metadata import (
    asset_key,
    column_schema,
    formatted_metadata,
    image_metadata,
    inference_metadata,
    labels_metadata,
)
from batch_assets.lib.automation import stale_partitions_condition
from batch_assets.lib.cascade_task import (
    cascade_stream,
    cascade_task,
    grown_label_model,
    stored_label_model,
    task_cascade_metadata,
)
from batch_assets.lib.estimates import (
    SECONDS_PER_HOUR,
    cached_keys_in,
    engine_devices,
    estimate_partition,
    task_history,
)
from batch_assets.lib.label_model_asset import label_model_assets
from batch_assets.lib.range_failures import FAILED_PARTITIONS_METADATA
from batch_assets.lib.ray_runs import ray_node_metadata
from batch_assets.lib.run_requests import SOURCE_VERSION_TAG
from batch_assets.pipeline.calibration import calibrated_labels
from batch_assets.pipeline.cascade.labels import Teach, teacher_task
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.engine_contract import (
    Engine,
    EngineSession,
    EngineSettings,
    EngineStartError,
    ResolvedSettings,
)
from batch_assets.pipeline.extras import missing_extras
from batch_assets.pipeline.formats import InferenceStream, OutputFiles, TaskFormat
from batch_assets.pipeline.inference_requests import InferenceStats, PartitionInput
from batch_assets.pipeline.inputs.read_prompts import DropFileError, ParseOptions
from batch_assets.pipeline.label_quality import error_code_counts
from batch_assets.pipeline.run_inference import run_inference
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.runtime.interrupts import STOPPED, stop_instead_of, stop_requested
from batch_assets.storage.batch_records import BatchRecordStore, batch_records_dir
from batch_assets.storage.checkpoints import CheckpointStore, clear_checkpoints, model_identity, run_fingerprint
from batch_assets.storage.drop_files import DropFile, drop_partitions, find_drop_file, shard_index_of, version_digest
from batch_assets.storage.image_sources import attach_images
from batch_assets.storage.locations import checkpoint_dir, one_name, task_storage_dir, write_bytes_atomically
from batch_assets.storage.shards import (
    SHARD_VERSIONS_TAG,
    outdated_shards,
    outdated_shards_message,
    read_partition_rows,
)

if TYPE_CHECKING:
    from batch_assets.storage.result_cache import ResultCache

IO_MANAGER_KEY = "parquet_storage"
# The asset decorator's keyword arguments (`Any`: dg.asset's overloads type each one).
AssetArgs = dict[str, Any]


class InferenceConfig(dg.Config):
    """Launch-time options of `inference_outputs` (launchpad, or a backfill's run config)."""

    use_result_cache: bool = Field(
        default=True,
        description=(
            "Reuse results cached by earlier runs (same model, prompt and sampling; deterministic decoding only) "
            "and add new ones. Set false to infer every row again, e.g. when an endpoint now serves other weights "
            "under the same name."
        ),
    )


def inference_fingerprint(fmt: TaskFormat, settings: EngineSettings) -> str:
    """Checkpoints and cached results are reused only by a run that would produce the same outputs:
    the model, its context and what the task's kind says decides them (`TaskFormat.output_identity`);
    the prompt text itself is part of each request's key."""
    model = {
        **settings.identity(),
        "model_files": model_identity(settings.model),
        "max_model_len": settings.max_model_len,
    }
    return run_fingerprint({**model, **fmt.output_identity(settings)})


def build_task_assets(task: TaskSpec, settings: ResolvedSettings) -> list[dg.AssetsDefinition]:
    """The task's four assets (and a cascade task's label_model), versioned by the `settings` its
    engine resolved. What differs between kinds of task (records for a chat model, embeddings,
    similarity labels, OpenAI batch lines) comes from its format object."""
    fmt = task_format(task)
    common: AssetArgs = {
        "key_prefix": [task.name],
        "group_name": task.name,
        "partitions_def": drop_partitions(task.name),
        "io_manager_key": IO_MANAGER_KEY,
        "kinds": {"parquet"},
        "backfill_policy": dg.BackfillPolicy.multi_run(task.runs.max_partitions_per_run),
    }
    versions = code_versions(task, settings)
    automation = stale_partitions_condition() if task.automation.rematerialize_stale else None

    def downstream(asset: str, upstream: str) -> AssetArgs:
        """The arguments of an asset made from `upstream`, with its code version and automation."""
        return {
            "ins": {upstream: dg.AssetIn(key=asset_key(task.name, upstream))},
            "code_version": versions[asset],
            "automation_condition": automation,
            **common,
        }

    return [
        raw_prompts_asset(task, common),
        formatted_prompts_asset(task, fmt, downstream("formatted_prompts", "raw_prompts")),
        inference_outputs_asset(task, fmt, downstream("inference_outputs", "formatted_prompts")),
        # A model the endpoint names only when asked is written as the resolved settings name it.
        validated_labels_asset(task, fmt, downstream("validated_labels", "inference_outputs"), settings.model),
        # A cascade's student, kept by the version of the inference that trains it and that uses it.
        *label_model_assets(task, versions["inference_outputs"]),
    ]


def parse_options(task: TaskSpec) -> ParseOptions:
    """How the task's drop files are read (raw_prompts, and `batch-assets estimate`)."""
    return ParseOptions(
        text_fields=tuple(task.input.text_fields),
        txt_field=task.input.txt_field,
        format=task.input.format,
        images=task.input.images,
    )


def raw_prompts_asset(task: TaskSpec, args: AssetArgs) -> dg.AssetsDefinition:
    options = parse_options(task)

    @dg.asset(
        name="raw_prompts",
        description=(
            f"Records of one `{task.name}` drop file, one row each, in input order with a stable `row_id`. "
            "Reads .jsonl, .csv (header row), .parquet and .txt (one prompt a line), also gzip-compressed "
            "(.jsonl.gz, .csv.gz, .txt.gz). A record that cannot be read becomes a row with an `error` naming "
            "the file and line; none is dropped."
        ),
        **args,
    )
    def raw_prompts(context: dg.AssetExecutionContext) -> dict[str, pl.DataFrame]:
        frames: dict[str, pl.DataFrame] = {}
        unreadable: dict[str, str] = {}
        shard_versions: dict[str, str] = {}
        for partition_key in context.partition_keys:
            try:
                frames[partition_key], drop = read_partition(context, task, options, partition_key)
            except DropFileError as exc:
                # Read every file of the range first, so one failure names every bad file in it.
                unreadable[partition_key] = str(exc)
                context.log.error(str(exc))
                continue
            if shard_index_of(partition_key) is not None:
                shard_versions[partition_key] = version_digest(drop.version)
        if shard_versions:
            # The version each shard read, for the check after each of the run's outputs is written.
            context.instance.add_run_tags(context.run.run_id, {SHARD_VERSIONS_TAG: json.dumps(shard_versions)})
        if unreadable:
            raise dg.Failure(
                description=f"{len(unreadable)} of {len(context.partition_keys)} drop file(s) cannot be read: "
                + "; ".join(unreadable.values()),
                metadata={FAILED_PARTITIONS_METADATA: sorted(unreadable)},
                allow_retries=False,
            )
        return frames

    return raw_prompts


def read_partition(
    context: dg.AssetExecutionContext, task: TaskSpec, options: ParseOptions, partition_key: str
) -> tuple[pl.DataFrame, DropFile]:
    """One partition's records from its drop file, with what was read recorded as metadata."""
    drop = find_drop_file(task.name, partition_key)
    requested = context.run.tags.get(SOURCE_VERSION_TAG) if len(context.partition_keys) == 1 else None
    if shard_index_of(partition_key) is not None and requested not in (None, version_digest(drop.version)):
        raise DropFileError(
            f"{drop.relative_path}: replaced since this run of shard {partition_key} was requested; the shard is "
            "not run on another version than its siblings. The new version's shards are run instead"
        )
    frame = read_partition_rows(task.name, drop, partition_key, options, task.input.shard_rows)
    if task.input.image_fields:
        frame = attach_images(frame, drop, task.input)
    errors = error_code_counts(frame)
    if errors:
        first = frame.filter(pl.col("error").is_not_null()).head(3)["error"].to_list()
        context.log.warning(f"{sum(errors.values())} unreadable record(s) in {drop.relative_path}, e.g. {first}")
    if frame.height == 0:
        context.log.warning(
            f"{drop.relative_path} has no records (an empty file, or a CSV with only its header): zero rows"
        )
    context.add_asset_metadata(
        partition_key=partition_key,
        metadata={
            "rows": frame.height,
            "error_rows": sum(errors.values()),
            "errors_by_code": errors,
            "source_file": drop.relative_path,
            "source_version": drop.version,
            "columns": [c for c in frame.columns if c not in ("row_id", "source_line", "error")],
            "dagster/row_count": frame.height,
            "dagster/column_schema": column_schema(frame),
            **(image_metadata(frame, errors) if task.input.image_fields else {}),
        },
    )
    return frame, drop


def run_uses_result_cache(context: dg.AssetExecutionContext, task: TaskSpec) -> bool:
    """Whether this run's inference_outputs reads the result cache (its launch config, as the launchpad
    and `batch-assets run --no-result-cache` set it): formatted_prompts' estimate asks the cache only then,
    so that a run told to leave the cache alone neither reads nor writes it."""
    op_name = dg.AssetKey([task.name, "inference_outputs"]).to_python_identifier()
    config = ((context.run_config or {}).get("ops") or {}).get(op_name, {}).get("config") or {}
    return config.get("use_result_cache", True) is not False


def formatted_prompts_asset(task: TaskSpec, fmt: TaskFormat, args: AssetArgs) -> dg.AssetsDefinition:
    # The task's engine kind names its resource (in-process vLLM or an endpoint), pool and display name.
    kind = engine_kind(task)

    @dg.asset(
        name="formatted_prompts",
        description=fmt.formatted_description(),
        required_resource_keys={kind.resource_key},
        **args,
    )
    def formatted_prompts(
        context: dg.AssetExecutionContext, raw_prompts: dict[str, pl.DataFrame]
    ) -> dict[str, pl.DataFrame]:
        fail_without_extras(task)
        engine = engine_for(context.resources, task)
        settings = engine.settings(task)
        tokenizer = engine.tokenizer(settings)
        # Said on every run (the run's log, the terminal of `batch-assets run`, the metadata).
        approximate = {"token_count_note": settings.tokenizer_note} if settings.tokenizer_note else {}
        frames: dict[str, pl.DataFrame] = {}
        # What the run will cost, shown before it runs: from the task's earlier partitions and its cache.
        history = task_history(context.instance, task.name)
        fingerprint = inference_fingerprint(fmt, settings)
        uses_cache = run_uses_result_cache(context, task)
        cached = cached_keys_in(task.name, fingerprint, context.instance) if uses_cache else None
        for partition_key, raw in raw_prompts.items():
            started = time.monotonic()
            frame = frames[partition_key] = fmt.format(raw, engine, tokenizer, settings, source_file=partition_key)
            estimate = estimate_partition(frame, fmt, settings, history, cached)
            metadata = {
                **formatted_metadata(frame, fmt, seconds=time.monotonic() - started, estimate=estimate),
                **approximate,
            }
            context.add_asset_metadata(partition_key=partition_key, metadata=metadata)
            for warning in [*approximate.values(), *fmt.formatting_warnings(frame, partition_key)]:
                context.log.warning(warning)
            for note in fmt.formatting_notes(partition_key):
                context.log.info(note)
        return frames

    return formatted_prompts


def inference_outputs_asset(task: TaskSpec, fmt: TaskFormat, args: AssetArgs) -> dg.AssetsDefinition:
    kind = engine_kind(task)

    @dg.asset(
        name="inference_outputs",
        description=(
            fmt.inference_description(kind.display_name)
            + " Results are checkpointed in chunks, so a re-run after a crash infers "
            "only the rows not done yet. With deterministic decoding, identical prompts are inferred once "
            "and results are reused from the task's result cache across partitions and re-runs."
        ),
        pool=kind.pool,
        required_resource_keys={kind.resource_key},
        retry_policy=dg.RetryPolicy(max_retries=1, delay=5),
        **args,
    )
    def inference_outputs(
        context: dg.AssetExecutionContext, config: InferenceConfig, formatted_prompts: dict[str, pl.DataFrame]
    ) -> dict[str, pl.DataFrame]:
        with stopped_without_retry():
            return infer_partitions(context, config, task, fmt, formatted_prompts, args["code_version"])

    return inference_outputs


def result_cache_for(
    context: dg.AssetExecutionContext, task: TaskSpec, fingerprint: str, *, use: bool
) -> "ResultCache | None":
    """The task's result cache for `fingerprint` (None where the run turns it off), in the run's
    instance, its warnings (a damaged cache set aside) in the run's log."""
    if not use:
        return None
    from batch_assets.storage.result_cache import ResultCache  # SQLAlchemy, imported by the runs only

    return ResultCache(task_storage_dir(task.name), fingerprint, instance=context.instance, warn=context.log.warning)


def infer_partitions(
    context: dg.AssetExecutionContext,
    config: InferenceConfig,
    task: TaskSpec,
    fmt: TaskFormat,
    formatted_prompts: dict[str, pl.DataFrame],
    version: str,
) -> dict[str, pl.DataFrame]:
    """The body of `inference_outputs` at code `version`: every partition of the run through one
    engine stream (a cascade's starting from the task's label_model of that version, if stored)."""
    fail_without_extras(task)
    fail_if_outdated_shards(context, task, list(formatted_prompts))
    kind, engine = engine_kind(task), engine_for(context.resources, task)
    settings = engine.settings(task)
    fingerprint = inference_fingerprint(fmt, settings)
    tokenizer = engine.tokenizer(settings)
    encoders = fmt.encoders(engine, tokenizer, settings.max_model_len)
    parts = [
        PartitionInput(frame, encoders(frame), checkpoints_for(context, task, key, fingerprint), label=key)
        for key, frame in formatted_prompts.items()
    ]
    cache = result_cache_for(context, task, fingerprint, use=config.use_result_cache)
    stored = grown_label_model(context, task, version, stored_label_model(context, task, version))
    shared = cascade_task(context, task, version, stored)
    try:
        # One session and one stream for every partition of the run; the engine starts with the
        # first request that needs it: not for cached, empty or all-error files.
        records = (
            {"records": BatchRecordStore(batch_records_dir(task.name, fingerprint))} if kind.keeps_batch_records else {}
        )
        with (
            engine.session(task, settings, context.log.info, **records) as session,
            teacher_session(context, task, engine, use_cache=config.use_result_cache) as teach,
        ):

            def run(partitions: list[PartitionInput]) -> list[tuple[pl.DataFrame, InferenceStats]]:
                return stream(partitions, session, settings, fmt, cache, context.log.info)

            base = InferenceStream(run, tokenizer, settings.max_model_len)
            results = fmt.infer(parts, cascade_stream(task, base, teach, stored, shared))
    except EngineStartError as exc:
        # Settings that do not fit will not fit five seconds later either: fail now, with the
        # hint of what to change, instead of retrying a start-up that can take minutes.
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    # The stream's engine time, shared by its partitions by the rows each had inferred.
    inferred = sum(stats.rows_inferred for _, stats in results)
    devices = engine_devices(settings)
    for partition_key, (frame, stats) in zip(formatted_prompts, results, strict=True):
        share = stats.rows_inferred / inferred if inferred else 0.0
        gpu_hours = stats.engine_seconds * share * devices / SECONDS_PER_HOUR if devices else None
        metadata = inference_metadata(task, fmt, settings, session, frame, stats, fingerprint, gpu_hours)
        if "task_student_version" in metadata:
            # Where its figures are kept (storage/label_models.py), for validated_labels to add the cost.
            metadata["task_version"] = version
        context.add_asset_metadata({**metadata, **ray_node_metadata()}, partition_key=partition_key)
    return {key: frame for key, (frame, _) in zip(formatted_prompts, results, strict=True)}


def teacher_checkpoint_dir(task: str, partition_key: str) -> UPath:
    """A partition's checkpoints of a cascade's chat teacher: apart from the embedding's, whose run
    removes the checkpoints of other fingerprints from its own folder."""
    return task_storage_dir(task) / "_teacher_checkpoints" / one_name(partition_key)


def stream(
    parts: list[PartitionInput],
    session: EngineSession,
    settings: EngineSettings,
    fmt: TaskFormat,
    cache: "ResultCache | None",
    log: Callable[[str], None],
) -> list[tuple[pl.DataFrame, InferenceStats]]:
    """`parts` through `run_inference` as one stream of `session`, as `fmt`'s task asks."""
    return run_inference(
        parts,
        session=session,
        max_model_len=settings.max_model_len,
        max_tokens=fmt.max_tokens,
        batch_size=fmt.task.engine.batch_size,
        deduplicate=fmt.deduplicate,
        cache=cache,
        log=log,
    )


@contextmanager
def teacher_session(
    context: dg.AssetExecutionContext, task: TaskSpec, engine: Engine, *, use_cache: bool
) -> Iterator[Teach | None]:
    """`teacher: llm` of a cascade: the chat teacher's session beside the embedding one (vLLM keeps a
    chat and a pooling engine apart; the chat one starts with the first teacher request). Each
    request goes through `run_inference` as a chat choices task's (`teacher_task`): the result cache,
    checkpoints (a folder of their own, so the embedding's run never removes them), deduplication and
    error rows. None for every other task."""
    if not task.output.chat_teacher:
        yield None
        return
    teacher = teacher_task(task)
    fmt = task_format(teacher)
    settings = engine.settings(teacher)
    fingerprint = inference_fingerprint(fmt, settings)
    tokenizer = engine.tokenizer(settings)
    encoders = fmt.encoders(engine, tokenizer, settings.max_model_len)
    log = context.log.info
    cache = result_cache_for(context, task, fingerprint, use=use_cache)
    with engine.session(teacher, settings, log) as session:

        def teach(partition_key: str, rows: pl.DataFrame) -> tuple[pl.DataFrame, InferenceStats]:
            formatted = fmt.format(
                rows.with_columns(error=pl.lit(None, dtype=pl.String)),
                engine,
                tokenizer,
                settings,
                source_file=partition_key,
            )
            checkpoints = CheckpointStore(teacher_checkpoint_dir(task.name, partition_key), fingerprint)
            part = PartitionInput(formatted, encoders(formatted), checkpoints, label=f"{partition_key} (teacher)")
            [(outputs, stats)] = stream([part], session, settings, fmt, cache, log)
            return fmt.validate(outputs), stats

        yield teach


@contextmanager
def stopped_without_retry() -> Iterator[None]:
    """Ctrl-C or SIGTERM anywhere in the step (the engine's process may die of it first) ends it as
    stopped: Dagster would retry an interrupted step that has a retry policy, with a fresh engine
    (runtime/interrupts.py). A stop that came before the step: it does not start."""
    if stop_requested():
        raise dg.Failure(description=STOPPED, allow_retries=False)
    try:
        yield
    except dg.Failure:
        raise
    except BaseException as exc:
        if isinstance(exc, dg.DagsterExecutionInterruptedError) or stop_instead_of(exc):
            raise dg.Failure(description=STOPPED, allow_retries=False) from exc
        raise


def fail_without_extras(task: TaskSpec) -> None:
    """Before anything is asked of an engine: a task whose extras are not installed fails its step in
    one line naming the first, without a retry (installing one takes a person)."""
    if missing := missing_extras(task):
        raise dg.Failure(description=missing[0].missing_line(), allow_retries=False)


def fail_if_outdated_shards(context: dg.AssetExecutionContext, task: TaskSpec, partition_keys: list[str]) -> None:
    """Before the engine starts: shards whose file got a new version since this run read it are not
    inferred (their outputs could not be stored), and not retried."""
    run = context.instance.get_run_by_id(context.run.run_id)
    if outdated := outdated_shards(task.name, partition_keys, run.tags if run else {}):
        raise dg.Failure(description=outdated_shards_message(task.name, outdated), allow_retries=False)


def checkpoints_for(
    context: dg.AssetExecutionContext, task: TaskSpec, partition_key: str, fingerprint: str
) -> CheckpointStore:
    """The partition's checkpoints of this fingerprint; those of other settings are removed."""
    checkpoints = CheckpointStore(checkpoint_dir(task.name, partition_key), fingerprint)
    if stale := checkpoints.discard_other_fingerprints():
        context.log.info(f"{partition_key}: removed checkpoints made with other model/sampling settings: {stale}")
    return checkpoints


def validated_labels_asset(task: TaskSpec, fmt: TaskFormat, args: AssetArgs, model: str) -> dg.AssetsDefinition:
    @dg.asset(name="validated_labels", description=fmt.validated_description(), **args)
    def validated_labels(
        context: dg.AssetExecutionContext, inference_outputs: dict[str, pl.DataFrame]
    ) -> dict[str, pl.DataFrame]:
        return {
            key: validate_partition(context, task, fmt, key, frame, model) for key, frame in inference_outputs.items()
        }

    return validated_labels


def validate_partition(
    context: dg.AssetExecutionContext,
    task: TaskSpec,
    fmt: TaskFormat,
    partition_key: str,
    outputs: pl.DataFrame,
    model: str,
) -> pl.DataFrame:
    # inference_outputs is stored by now, so its checkpoints have served their purpose.
    clear_checkpoints(checkpoint_dir(task.name, partition_key))
    if task.output.chat_teacher:  # only such a task has them: no listing (an S3 request) for every other
        clear_checkpoints(teacher_checkpoint_dir(task.name, partition_key))
    labels = calibrated_labels(fmt.validate(outputs), task)
    files = fmt.output_files(labels, partition_key, int(time.time()), model)
    metadata = {**files.metadata, **write_output_files(task, files), **labels_metadata(labels, task, fmt)}
    metadata |= task_cascade_metadata(context, task, partition_key, metadata.get("cascade_cost_usd"))
    context.add_asset_metadata(metadata, partition_key=partition_key)
    return labels


def write_output_files(task: TaskSpec, files: OutputFiles) -> dict[str, Any]:
    """The files a kind writes beside its result table (an OpenAI batch's output and error files),
    each written atomically into the task's storage folder; their paths as metadata."""
    metadata: dict[str, Any] = {}
    for key, (relative_path, contents) in files.files.items():
        path = task_storage_dir(task.name).joinpath(*relative_path.split("/"))
        write_bytes_atomically(path, contents)
        metadata[key] = dg.MetadataValue.path(str(path))
    return metadata
