"""The four assets of a task, built from its YAML by one factory.

    drop file ─► raw_prompts ─► formatted_prompts ─► inference_outputs ─► validated_labels

Each asset is partitioned by drop file (one dynamic partition per file) and stored as parquet at
`<data>/storage/<task>/<asset>/<partition_key>.parquet` by the `parquet_storage` IO manager.
A run covers one partition or a range of up to `runs.max_partitions_per_run` of them
(`BackfillPolicy.multi_run`): every asset loops over `context.partition_keys`, returns one frame per
partition (a dict keyed by partition key) and records its metadata per partition, so outputs,
metadata and checks stay per partition while the engine starts once per run.
The row-level work lives in pure modules (parsing, formatting, inference, validation); this file
is the Dagster glue: reading the drop, calling them, and reporting metadata.
"""

import time
from collections.abc import Callable
from typing import Any, cast

import dagster as dg
import polars as pl
from pydantic import Field

from batch_assets.dagster_defs.materializations import latest_materialization
from batch_assets.dagster_defs.range_failures import FAILED_PARTITIONS_METADATA
from batch_assets.engines.kinds import engine_for, engine_kind
from batch_assets.pipeline.budget import actual_cost_metadata, estimate_cost
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.embeddings import (
    choice_texts,
    choice_vectors,
    choices_frame,
    embedding_encoder,
    embedding_outputs,
    embedding_report,
    format_embedding_prompts,
    similarity_outputs,
    validate_embeddings,
)
from batch_assets.pipeline.engine_contract import EngineSession, EngineSettings, EngineStartError
from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts, prompt_encoder
from batch_assets.pipeline.label_quality import accuracy_report, confidence_report
from batch_assets.pipeline.openai_batch import (
    accepted_model_names,
    batch_prompt_encoder,
    format_batch_embedding_prompts,
    format_batch_prompts,
)
from batch_assets.pipeline.openai_batch_output import (
    batch_files,
    jsonl_bytes,
    validate_batch_embeddings,
    validate_batch_outputs,
)
from batch_assets.pipeline.read_prompts import DropFileError, ParseOptions
from batch_assets.pipeline.run_inference import InferenceStats, PartitionInput, run_inference
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.pipeline.validate_labels import validate_labels
from batch_assets.storage.checkpoints import CheckpointStore, clear_checkpoints, model_identity, run_fingerprint
from batch_assets.storage.drop_files import drop_partitions, find_drop_file
from batch_assets.storage.locations import checkpoint_dir, task_storage_dir, write_bytes_atomically
from batch_assets.storage.result_cache import ResultCache
from batch_assets.storage.shards import read_partition_rows

IO_MANAGER_KEY = "parquet_storage"
# The code version Dagster records on each materialization.
CODE_VERSION_TAG = "dagster/code_version"
PREVIEW_ROWS = 5


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


def asset_key(task: str, asset: str) -> dg.AssetKey:
    return dg.AssetKey([task, asset])


def error_code_counts(frame: pl.DataFrame) -> dict[str, int]:
    codes = frame.filter(pl.col("error").is_not_null()).select(
        pl.col("error").str.extract(r"^([a-z_]+):", 1).alias("code")
    )
    return {
        row["code"] or "other": row["count"] for row in codes.group_by("code").len(name="count").sort("code").to_dicts()
    }


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value: object) -> str:
        text = "" if value is None else str(value)
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= 80 else text[:77] + "..."

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def label_counts(labels: pl.DataFrame) -> dict[str, int]:
    counts = (
        labels.filter(pl.col("label").is_not_null()).group_by("label").len(name="count").sort("count", descending=True)
    )
    return {str(row["label"]): int(row["count"]) for row in counts.to_dicts()}


def column_schema(frame: pl.DataFrame) -> dg.TableSchema:
    """`dagster/column_schema`: the catalog shows an asset's columns and their types."""
    return dg.TableSchema(columns=[dg.TableColumn(name, str(dtype)) for name, dtype in frame.schema.items()])


def materialized_code_version(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str) -> str | None:
    """The code version the partition's latest materialization recorded (None: none recorded)."""
    record = latest_materialization(instance, key, partition)
    materialization = record.asset_materialization if record else None
    return materialization.tags.get(CODE_VERSION_TAG) if materialization and materialization.tags else None


class MadeWithOlderCodeVersion(dg.AutomationCondition):
    """True for the partitions whose latest materialization recorded another code version than the
    asset's current one. `code_version_changed` sees only a change between two evaluations, never
    one made before the first (the option turned on in the same edit as the prompt)."""

    @property
    def name(self) -> str:
        return "made_with_older_code_version"

    @property
    def requires_cursor(self) -> bool:
        return False

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        current = context.asset_graph.get(context.key).code_version
        instance = context.asset_graph_view.instance
        # One lookup per partition: evaluated on the first tick only (see stale_partitions_condition).
        outdated = {
            partition
            for partition in context.candidate_subset.expensively_compute_partition_keys()
            if materialized_code_version(instance, context.key, partition) not in (None, current)
        }
        if not outdated or context.partitions_def is None:
            return dg.AutomationResult(context, context.get_empty_subset())
        subset = context.asset_graph_view.get_subset_from_partition_keys(context.key, context.partitions_def, outdated)
        return dg.AutomationResult(context, subset)


def stale_partitions_condition() -> dg.AutomationCondition:
    """Re-materialize partitions made before a task edit (`automation: {rematerialize_stale: true}`).

    True for every materialized partition on the tick the asset's code version changes; on the
    condition's first evaluation (the option just turned on, perhaps with an edit) for the
    partitions made with another code version; or when an upstream partition was updated by a run
    that did not include this asset. Then held until the partition is requested or updated, so a
    partition whose run fails is not requested again before the next change. New partitions are
    left to the drops sensor (`~missing`).
    """
    on_first_evaluation = dg.AutomationCondition.initial_evaluation() & MadeWithOlderCodeVersion()
    changed = (
        dg.AutomationCondition.code_version_changed() | on_first_evaluation | dg.AutomationCondition.any_deps_updated()
    )
    # Not since_last_handled(): it also resets on the first evaluation, which would drop exactly
    # the partitions found outdated then.
    handled = dg.AutomationCondition.newly_requested() | dg.AutomationCondition.newly_updated()
    return (
        changed.since(handled)
        & ~dg.AutomationCondition.missing()
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    ).with_label("rematerialize_stale")


def build_automation_sensor(task: TaskSpec) -> list[dg.AutomationConditionSensorDefinition]:
    """The sensor that evaluates a task's stale-partition condition (running whenever the daemon is).
    It runs in the code server: the condition's own Python part cannot be evaluated by the daemon."""
    if not task.automation.rematerialize_stale:
        return []
    return [
        dg.AutomationConditionSensorDefinition(
            f"{task.name}_automation_sensor",
            target=dg.AssetSelection.groups(task.name),
            default_status=dg.DefaultSensorStatus.RUNNING,
            use_user_code_server=True,
            description=f"Re-materializes `{task.name}` partitions made with an earlier version of the task.",
        )
    ]


def accuracy_metadata(labels: pl.DataFrame, task: TaskSpec) -> dict:
    """Accuracy against the task's `checks.gold_field`, when the partition carries one."""
    if not task.checks.gold_field:
        return {}
    report = accuracy_report(labels, task.checks.gold_field, task.checks.gold_json_field)
    if report is None:
        note = f"no row has a value in the gold column {task.checks.gold_field!r}: accuracy not measured"
        return {"accuracy_note": note}
    return {
        "accuracy": round(report.accuracy, 4),
        "rows_with_gold": report.rows_with_gold,
        "correct_rows": report.correct,
        "per_label": report.per_label_metadata(),
        "confusion": dg.MetadataValue.md(report.confusion_markdown()),
    }


# Engine-neutral: resources can route a task to an engine other than its YAML's `engine.kind`.
NO_CONFIDENCE_REASONS = (
    "their results were reused from checkpoints or the result cache stored before confidence was measured "
    "(materialize inference_outputs with `use_result_cache: false` to measure it), the endpoint returned no "
    "log-probabilities (or `logprobs=False` on the `llm_endpoint` resource), or structured outputs are off"
)


def confidence_metadata(labels: pl.DataFrame, task: TaskSpec) -> dict:
    """The labels' confidence: its median and the share under the task's `checks.min_confidence`."""
    report = confidence_report(labels, task.checks.min_confidence)
    if report is None:
        return {}
    metadata: dict = {"min_confidence": task.checks.min_confidence, **report.metadata()}
    if report.unmeasured_rows:
        metadata["confidence_note"] = (
            f"{report.unmeasured_rows} of {report.labelled_rows} labels have no confidence: {NO_CONFIDENCE_REASONS}"
        )
    return metadata


def inference_fingerprint(task: TaskSpec, settings: EngineSettings) -> str:
    """Checkpoints and cached results are reused only by a run that would produce the same outputs;
    the prompt text itself is part of each request's key. An embedding depends on the model and the
    text alone: a similarity task's choices and descriptions, or sampling, do not change it."""
    model = {
        **settings.identity(),
        "model_files": model_identity(settings.model),
        "max_model_len": settings.max_model_len,
    }
    if task.output.pooling:
        return run_fingerprint({**model, "output": "embedding"})
    parts = {
        **model,
        "structured_outputs": settings.structured_outputs,
        "sampling": task.sampling.model_dump(),
        "output": task.output.decision(),
    }
    # The rendered prompt (each request's key) holds the examples already; named here too, so no
    # answer given without them is reused with them whatever an engine makes of the text (an
    # endpoint is sent messages, not that text). Absent without examples: existing caches stay valid.
    if task.prompt is not None and task.prompt.examples:
        parts["prompt_examples"] = [list(turns) for turns in PromptFormat.of(task).examples]
    return run_fingerprint(parts)


def inference_metadata(
    task: TaskSpec,
    settings: EngineSettings,
    session: EngineSession,
    frame: pl.DataFrame,
    stats: InferenceStats,
    fingerprint: str,
) -> dict:
    return {
        "rows": stats.rows,
        "rows_inferred": stats.rows_inferred,
        "rows_from_checkpoint": stats.rows_from_checkpoint,
        "rows_from_cache": stats.rows_from_cache,
        "rows_added_to_cache": stats.rows_cached,
        "rows_deduplicated": stats.rows_deduplicated,
        "error_rows": stats.error_rows,
        "errors_by_code": error_code_counts(frame),
        "prompt_tokens": int(frame["num_prompt_tokens"].sum() or 0),
        "generated_tokens": int(frame["num_generated_tokens"].sum() or 0),
        "engine_seconds": round(stats.engine_seconds, 3),
        "engine_start_seconds": round(session.start_seconds, 3),
        "inference_seconds": round(stats.inference_seconds, 3),
        "generated_tokens_per_second": round(stats.generated_tokens_per_second, 2),
        "rows_per_second": round(stats.rows_per_second, 2),
        **embedding_inference_metadata(frame),
        "model": settings.model,
        "engine_settings": settings.metadata(),
        "sampling_params": task.sampling.model_dump(),
        "output_constraint": task.output.kind,
        **session.metadata,
        "checkpoint_fingerprint": fingerprint,
        **actual_cost_metadata(
            int(frame["num_prompt_tokens"].sum() or 0), int(frame["num_generated_tokens"].sum() or 0), task.engine.price
        ),
        "dagster/row_count": frame.height,
        "dagster/column_schema": column_schema(frame),
    }


def embedding_inference_metadata(frame: pl.DataFrame) -> dict:
    """Embedding and similarity tasks: the vectors' dimension and how many rows were cut to fit."""
    if "embedding" not in frame.columns:
        return {}
    dtype = frame.schema["embedding"]
    metadata: dict = {"dimension": dtype.size if isinstance(dtype, pl.Array) else None}
    if "truncated" in frame.columns:
        metadata["truncated_rows"] = int(frame["truncated"].sum() or 0)
    return metadata


def embed_with_choices(
    task: TaskSpec, parts: list[PartitionInput], tokenizer, max_model_len: int, run: Callable
) -> list[tuple[pl.DataFrame, InferenceStats]]:
    """Run the partitions of an embedding or similarity task and turn their results into
    inference_outputs. A similarity task's choices go into the same stream as one more partition, so
    their embeddings are computed once per run (or come from the result cache) by the same model."""
    if task.output.method != "similarity":
        return [(embedding_outputs(frame), stats) for frame, stats in run(parts)]
    texts = choice_texts(task.output)
    choices_part = PartitionInput(
        choices_frame(texts, tokenizer), embedding_encoder(tokenizer, max_model_len, True), label="choices"
    )
    *results, (choice_results, _) = run([*parts, choices_part])
    vectors = choice_vectors(choice_results, task.output.choices or [], texts)
    return [(similarity_outputs(frame, vectors, task.output.choices or []), stats) for frame, stats in results]


def inference_summary(task: TaskSpec, engine_name: str) -> str:
    """What `inference_outputs` holds, by the kind of task (the start of its description)."""
    source = "vLLM's pooling runner" if task.engine.kind == "vllm" else f"{engine_name} (/v1/embeddings)"
    if task.output.method == "similarity":
        return (
            f"Embeddings of each `{task.name}` row from {source}, and its label by cosine "
            "similarity to each choice's embedding."
        )
    if task.output.kind == "embedding":
        return f"Embeddings of each `{task.name}` row from {source}."
    return (
        f"Model outputs for each `{task.name}` prompt from {engine_name}, constrained by the task's structured outputs."
    )


def build_task_assets(task: TaskSpec) -> list[dg.AssetsDefinition]:
    name = task.name
    partitions = drop_partitions(name)
    # Shared keyword arguments of the four assets (`Any`: dg.asset's overloads type each one).
    common: dict[str, Any] = {
        "key_prefix": [name],
        "group_name": name,
        "partitions_def": partitions,
        "io_manager_key": IO_MANAGER_KEY,
        "kinds": {"parquet"},
        "backfill_policy": dg.BackfillPolicy.multi_run(task.runs.max_partitions_per_run),
    }
    parse_options = ParseOptions(
        text_fields=tuple(task.input.text_fields), txt_field=task.input.txt_field, format=task.input.format
    )
    # OpenAI Batch API files: each line brings its own messages and sampling (pipeline/openai_batch.py).
    batch_format = task.input.format == "openai_batch"
    # Embedding and similarity tasks: texts to an embedding model, vectors back (pipeline/embeddings.py).
    pooling = task.output.pooling
    # The task's engine kind names its resource (in-process vLLM or an endpoint), pool and display name.
    kind = engine_kind(task)
    versions = code_versions(task)
    automation = stale_partitions_condition() if task.automation.rematerialize_stale else None
    prompt_format = None if task.prompt is None else PromptFormat.of(task)

    @dg.asset(
        name="raw_prompts",
        description=(
            f"Records of one `{name}` drop file, one row each, in input order with a stable `row_id`. "
            "Reads .jsonl, .csv (header row), .parquet and .txt (one prompt a line), also gzip-compressed "
            "(.jsonl.gz, .csv.gz, .txt.gz). A record that cannot be read becomes a row with an `error` naming "
            "the file and line; none is dropped."
        ),
        **common,
    )
    def raw_prompts(context: dg.AssetExecutionContext) -> dict[str, pl.DataFrame]:
        frames: dict[str, pl.DataFrame] = {}
        unreadable: dict[str, str] = {}
        for partition_key in context.partition_keys:
            try:
                frames[partition_key] = read_partition(context, partition_key)
            except DropFileError as exc:
                # Read every file of the range first, so one failure names every bad file in it.
                unreadable[partition_key] = str(exc)
                context.log.error(str(exc))
        if unreadable:
            raise dg.Failure(
                description=f"{len(unreadable)} of {len(context.partition_keys)} drop file(s) cannot be read: "
                + "; ".join(unreadable.values()),
                metadata={FAILED_PARTITIONS_METADATA: sorted(unreadable)},
                allow_retries=False,
            )
        return frames

    def read_partition(context: dg.AssetExecutionContext, partition_key: str) -> pl.DataFrame:
        drop = find_drop_file(name, partition_key)
        frame = read_partition_rows(name, drop, partition_key, parse_options, task.input.shard_rows)
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
            },
        )
        return frame

    @dg.asset(
        name="formatted_prompts",
        description=(
            f"The text the embedding model embeds for each `{name}` row: the task's template over its "
            "fields (no chat template), with `num_prompt_tokens`. Rows with empty text or too long for "
            "the model get an `error` (or, with `input.truncate`, are cut: `truncated`)."
            if pooling
            else f"The exact prompt the model sees for each `{name}` row: the task's system prompt and "
            "template rendered with the model's chat template, with `num_prompt_tokens`. Rows with "
            "empty text or too long for the model's context get an `error` and skip the engine."
        ),
        ins={"raw_prompts": dg.AssetIn(key=asset_key(name, "raw_prompts"))},
        required_resource_keys={kind.resource_key},
        code_version=versions["formatted_prompts"],
        automation_condition=automation,
        **common,
    )
    def formatted_prompts(
        context: dg.AssetExecutionContext, raw_prompts: dict[str, pl.DataFrame]
    ) -> dict[str, pl.DataFrame]:
        llm_engine = engine_for(context.resources, task)
        settings = llm_engine.settings(task)
        tokenizer = llm_engine.tokenizer(task)

        def format_partition(raw: pl.DataFrame, partition_key: str) -> pl.DataFrame:
            if batch_format and pooling:  # `/v1/embeddings` lines
                return format_batch_embedding_prompts(
                    raw,
                    tokenizer,
                    max_model_len=settings.max_model_len,
                    truncate=task.input.truncate,
                    source_file=partition_key,
                    accepted_models=accepted_model_names(task.model) if task.input.require_model_match else None,
                )
            if batch_format:
                return format_batch_prompts(
                    raw,
                    tokenizer,
                    sampling_defaults=task.sampling,
                    max_model_len=settings.max_model_len,
                    source_file=partition_key,
                    accepted_models=accepted_model_names(task.model) if task.input.require_model_match else None,
                    chat_only=llm_engine.sends_chat_messages,
                )
            assert prompt_format is not None  # a records task always has a prompt section (TaskSpec)
            if pooling:
                return format_embedding_prompts(
                    raw,
                    prompt_format.template,
                    prompt_format.text_fields,
                    tokenizer,
                    max_model_len=settings.max_model_len,
                    truncate=task.input.truncate,
                    source_file=partition_key,
                )
            return format_prompts(
                raw,
                prompt_format,
                tokenizer,
                max_model_len=settings.max_model_len,
                max_tokens=task.sampling.max_tokens,
                source_file=partition_key,
            )

        frames: dict[str, pl.DataFrame] = {}
        for partition_key, raw in raw_prompts.items():
            started = time.monotonic()
            frame = frames[partition_key] = format_partition(raw, partition_key)
            errors = error_code_counts(frame)
            context.add_asset_metadata(
                partition_key=partition_key,
                metadata={
                    "rows": frame.height,
                    "error_rows": sum(errors.values()),
                    "errors_by_code": errors,
                    "prompt_tokens": int(frame["num_prompt_tokens"].sum() or 0),
                    # polars types Series.max() as any literal; an Int64 column gives an int or None
                    "max_prompt_tokens": int(cast("int | None", frame["num_prompt_tokens"].max()) or 0),
                    "seconds": round(time.monotonic() - started, 3),
                    **estimate_cost(frame, task).metadata(),
                    "dagster/row_count": frame.height,
                    "dagster/column_schema": column_schema(frame),
                },
            )
        return frames

    @dg.asset(
        name="inference_outputs",
        description=(
            inference_summary(task, kind.display_name)
            + " Results are checkpointed in chunks, so a re-run after a crash infers "
            "only the rows not done yet. With deterministic decoding, identical prompts are inferred once "
            "and results are reused from the task's result cache across partitions and re-runs."
        ),
        ins={"formatted_prompts": dg.AssetIn(key=asset_key(name, "formatted_prompts"))},
        pool=kind.pool,
        required_resource_keys={kind.resource_key},
        retry_policy=dg.RetryPolicy(max_retries=1, delay=5),
        code_version=versions["inference_outputs"],
        automation_condition=automation,
        **common,
    )
    def inference_outputs(
        context: dg.AssetExecutionContext, config: InferenceConfig, formatted_prompts: dict[str, pl.DataFrame]
    ) -> dict[str, pl.DataFrame]:
        engine = engine_for(context.resources, task)
        settings = engine.settings(task)
        fingerprint = inference_fingerprint(task, settings)
        tokenizer = engine.tokenizer(task)
        parts = []
        for partition_key, frame in formatted_prompts.items():
            checkpoints = CheckpointStore(checkpoint_dir(name, partition_key), fingerprint)
            if stale := checkpoints.discard_other_fingerprints():
                context.log.info(
                    f"{partition_key}: removed checkpoints made with other model/sampling settings: {stale}"
                )
            if pooling:
                encode = embedding_encoder(tokenizer, settings.max_model_len, task.input.truncate)
            else:
                encode = (batch_prompt_encoder if batch_format else prompt_encoder)(engine, task, tokenizer, frame)
            parts.append(PartitionInput(frame, encode, checkpoints, label=partition_key))
        try:
            # One session and one stream for every partition of the run; the engine starts with the
            # first request that needs it: not for cached, empty or all-error files.
            with engine.session(task, context.log.info) as session:

                def run(partitions: list[PartitionInput]) -> list[tuple[pl.DataFrame, InferenceStats]]:
                    return run_inference(
                        partitions,
                        session=session,
                        max_model_len=settings.max_model_len,
                        # An embedding generates nothing: the whole context is the text's.
                        max_tokens=0 if pooling else task.sampling.max_tokens,
                        batch_size=task.engine.batch_size,
                        # Batch lines carry their own sampling; their request keys tell deterministic ones
                        # apart. An embedding is deterministic.
                        deduplicate=task.sampling.deterministic or batch_format or pooling,
                        cache=(
                            ResultCache(task_storage_dir(name), fingerprint, instance=context.instance)
                            if config.use_result_cache
                            else None
                        ),
                        log=context.log.info,
                    )

                results = (
                    embed_with_choices(task, parts, tokenizer, settings.max_model_len, run) if pooling else run(parts)
                )
        except EngineStartError as exc:
            # Settings that do not fit will not fit five seconds later either: fail now, with the
            # hint of what to change, instead of retrying a start-up that can take minutes.
            raise dg.Failure(description=str(exc), allow_retries=False) from exc
        outputs: dict[str, pl.DataFrame] = {}
        for partition_key, (frame, stats) in zip(formatted_prompts, results, strict=True):
            metadata = inference_metadata(task, settings, session, frame, stats, fingerprint)
            context.add_asset_metadata(metadata, partition_key=partition_key)
            outputs[partition_key] = frame
        return outputs

    @dg.asset(
        name="validated_labels",
        description=(
            f"The `{name}` result table: every input column, `embedding` (fixed-size float32, unit length), "
            "`num_prompt_tokens` and `error` (null when the row is fine). Exactly one row per input record, "
            "in input order."
            if task.output.kind == "embedding"
            else f"The `{name}` result table: every input column, `label` (parsed and checked against the "
            "task's output constraint; choices and regex tasks also give its `confidence`, 0-1), the "
            "generated text, token counts and `error` (null when the row is fine). Exactly one row per "
            "input record, in input order."
        ),
        ins={"inference_outputs": dg.AssetIn(key=asset_key(name, "inference_outputs"))},
        code_version=versions["validated_labels"],
        automation_condition=automation,
        **common,
    )
    def validated_labels(
        context: dg.AssetExecutionContext, inference_outputs: dict[str, pl.DataFrame]
    ) -> dict[str, pl.DataFrame]:
        return {key: validate_partition(context, key, frame) for key, frame in inference_outputs.items()}

    def validate_partition(
        context: dg.AssetExecutionContext, partition_key: str, inference_outputs: pl.DataFrame
    ) -> pl.DataFrame:
        # inference_outputs is stored by now, so its checkpoints have served their purpose.
        clear_checkpoints(checkpoint_dir(name, partition_key))
        embeddings = task.output.kind == "embedding"
        if batch_format:
            labels = (validate_batch_embeddings if embeddings else validate_batch_outputs)(inference_outputs)
        elif embeddings:
            labels = validate_embeddings(inference_outputs)
        else:
            labels = validate_labels(inference_outputs, task.output)
        counts = label_counts(labels) if task.output.kind in ("choices", "regex") else {}
        errors = error_code_counts(labels)
        shown = [c for c in ("similarity", "confidence") if c in labels.columns]
        if batch_format:
            preview_columns = ["custom_id", "input" if embeddings else "label", "error"]
        elif embeddings:
            preview_columns = [*task.input.text_fields, "num_prompt_tokens", "error"]
        else:
            preview_columns = [*task.input.text_fields, "label", *shown, "error"]
        metadata: dict = write_batch_files(labels, partition_key) if batch_format else {}
        if embeddings:
            metadata |= embedding_report(labels).metadata()
            metadata["prompt_tokens"] = int(labels["num_prompt_tokens"].sum() or 0)
        else:
            metadata["labelled_rows"] = int(labels["label"].is_not_null().sum())
        metadata |= {
            "rows": labels.height,
            "error_rows": sum(errors.values()),
            "errors_by_code": errors,
            "preview": dg.MetadataValue.md(markdown_table(labels.head(PREVIEW_ROWS).to_dicts(), preview_columns)),
            "dagster/row_count": labels.height,
            "dagster/column_schema": column_schema(labels),
            **accuracy_metadata(labels, task),
            **confidence_metadata(labels, task),
        }
        if counts:
            metadata["label_counts"] = counts
            metadata["label_distribution"] = dg.MetadataValue.md(
                markdown_table(
                    [
                        {"label": k, "rows": v, "share": f"{100 * v / max(labels.height, 1):.1f}%"}
                        for k, v in counts.items()
                    ],
                    ["label", "rows", "share"],
                )
            )
        context.add_asset_metadata(metadata, partition_key=partition_key)
        return labels

    def write_batch_files(labels: pl.DataFrame, partition_key: str) -> dict:
        """The partition's OpenAI batch output and error files, each written atomically."""
        outputs, failed = batch_files(labels, model=task.model, partition_key=partition_key, created=int(time.time()))
        metadata: dict = {"batch_output_lines": len(outputs), "batch_error_lines": len(failed)}
        for folder, records in (("batch_output", outputs), ("batch_errors", failed)):
            path = task_storage_dir(name) / folder / f"{partition_key}.jsonl"
            write_bytes_atomically(path, jsonl_bytes(records))
            metadata[f"{folder}_file"] = dg.MetadataValue.path(str(path))
        return metadata

    return [raw_prompts, formatted_prompts, inference_outputs, validated_labels]
