"""What batch_assets relies on in Dagster's and vLLM's internals (batch_assets/runtime/): only there,
and still shaped as relied on. A Dagster or vLLM upgrade that changes one fails here, by name."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import dagster as dg

PACKAGE = Path(__file__).resolve().parent.parent / "batch_assets"
FENCE = PACKAGE / "runtime"
# vLLM's public surface as used here: what `vllm` exports, and the documented home of
# SamplingParams' option types.
PUBLIC_VLLM_MODULES = {"vllm", "vllm.sampling_params"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def is_private(module: str) -> bool:
    if module == "dagster" or module.startswith("dagster."):
        return module.startswith("dagster._")
    if module == "vllm" or module.startswith("vllm."):
        return module not in PUBLIC_VLLM_MODULES
    return False


def test_private_dagster_and_vllm_imports_live_only_in_the_runtime_package() -> None:
    outside = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if FENCE not in path.parents
        for line, module in imported_modules(path)
        if is_private(module)
    ]
    assert not outside, "private imports outside batch_assets/runtime/: " + "; ".join(outside)
    inside = {module for path in FENCE.glob("*.py") for _, module in imported_modules(path) if is_private(module)}
    # Each documented in its *_private.py module and checked below; a new one must be added to both.
    assert inside == {
        "dagster._core.definitions.asset_checks.asset_check_evaluation",
        "dagster._core.execution.plan",
        "dagster._core.storage.event_log",
        "dagster._utils.error",
        "vllm.exceptions",
        "vllm.lora.request",
        "vllm.usage.usage_lib",
        "vllm.v1.engine.exceptions",
        "vllm.v1.metrics.loggers",
    }


def test_dagster_internals_keep_the_shapes_relied_on() -> None:
    from batch_assets.runtime.dagster_private import (
        AssetCheckEvaluationTargetMaterializationData,
        instance_concurrency_context,
        sql_event_log_storage,
        sqlite_event_log_storages,
    )

    assert dg.__version__.startswith("1.13."), "re-check runtime/dagster_private.py for this Dagster version"
    from batch_assets.runtime.dagster_private import SerializableErrorInfo

    assert {"message", "cause", "context", "cls_name"} <= set(SerializableErrorInfo._fields)
    backoff = inspect.signature(instance_concurrency_context._calculate_timeout_interval)
    assert list(backoff.parameters) == ["sleep_interval", "pending_claim_count"]
    context_class = instance_concurrency_context.InstanceConcurrencyContext
    assert callable(context_class.interval_to_next_pending_claim_check)
    with dg.instance_for_test() as instance:
        run = instance.create_run_for_job(job_def=dg.define_asset_job("j").resolve(asset_graph=_graph()))
        with context_class(instance, run) as context:
            assert isinstance(context._pending_claims, set) and isinstance(context._pending_timeouts, dict)
        assert isinstance(instance.event_log_storage, sql_event_log_storage())
        # pool_waits.serialize_pool_claims: the slot methods it wraps, and the folder of the database.
        storage = instance.event_log_storage
        assert isinstance(storage, sqlite_event_log_storages()) and os.path.isdir(storage._base_dir)
    for storage_class in sqlite_event_log_storages():
        for name in ("claim_concurrency_slot", "free_concurrency_slot_for_step", "free_concurrency_slots_for_run"):
            assert callable(getattr(storage_class, name))
    assign = sql_event_log_storage().assign_pending_steps
    assert list(inspect.signature(assign).parameters) == ["self", "concurrency_keys"]
    target = AssetCheckEvaluationTargetMaterializationData(run_id="r", storage_id=7, timestamp=1.5)
    assert (target.run_id, target.storage_id, target.timestamp) == ("r", 7, 1.5)


def test_vllm_internals_keep_the_shapes_relied_on() -> None:
    import vllm
    from vllm.v1.engine.async_llm import AsyncLLM

    from batch_assets.runtime.vllm_private import EngineGenerateError, LoRARequest, UsageContext, VLLMClientError

    assert vllm.__version__.startswith("0.32."), "re-check runtime/vllm_private.py for this vLLM version"
    assert vllm.AsyncLLMEngine is AsyncLLM  # the public name the engine is created by
    assert "usage_context" in inspect.signature(AsyncLLM.from_engine_args).parameters
    assert isinstance(UsageContext.LLM_CLASS, UsageContext)
    assert issubclass(EngineGenerateError, Exception) and issubclass(VLLMClientError, Exception)
    assert isinstance(inspect.getattr_static(AsyncLLM, "errored"), property)
    # engine.lora: each request's adapter, by name, number and folder, passed to `generate`.
    assert list(inspect.signature(LoRARequest).parameters)[:3] == ["lora_name", "lora_int_id", "lora_path"]
    assert "lora_request" in inspect.signature(AsyncLLM.generate).parameters


def test_vllm_stat_logger_fields_keep_the_shapes_relied_on() -> None:
    """runtime/vllm_stats.py: the factory `stat_loggers=` takes, and the fields of the stats `record` reads."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    from batch_assets.engines.engine_figures import EngineFigures
    from batch_assets.runtime.vllm_stats import stat_logger_factory

    assert "stat_loggers" in inspect.signature(AsyncLLM.from_engine_args).parameters
    assert list(inspect.signature(StatLoggerBase.record).parameters)[1:3] == ["scheduler_stats", "iteration_stats"]
    scheduler = SchedulerStats()
    scheduler.kv_cache_usage = 0.25
    scheduler.prefix_cache_stats.queries, scheduler.prefix_cache_stats.hits = 100, 60
    iteration = IterationStats()
    iteration.num_generation_tokens, iteration.num_preempted_reqs = 7, 1
    iteration.prompt_token_stats.total = 100
    iteration.time_to_first_tokens_iter = [0.5, 1.5]
    finished = {name: getattr(FinishedRequestStats, name, None) for name in ("queued_time", "num_prompt_tokens")}
    assert None not in finished.values(), finished
    figures = EngineFigures()
    mark = figures.mark()
    logger = stat_logger_factory(figures)(None, 0)
    assert isinstance(logger, StatLoggerBase)
    logger.record(scheduler, iteration)
    seen = figures.since(mark)
    assert (seen["prefix_cache_hit_rate"], seen["preemptions"], seen["kv_cache_usage_peak"]) == (0.6, 1, 0.25)
    assert 0.5 <= seen["ttft_p50_s"] <= 0.52 and 1.5 <= seen["ttft_p95_s"] <= 1.54


def _graph():
    @dg.asset
    def a() -> None: ...

    return dg.Definitions(assets=[a]).resolve_asset_graph()
