"""vLLM 0.32's stat-logging interface, as the in-process engine reads its figures.

The interface is public: a `StatLoggerBase` subclass (from `vllm.v1.metrics.loggers`, where vLLM's
docs point custom loggers; `vllm` does not export it) passed as `stat_loggers=[factory]` to
`AsyncLLM.from_engine_args`; vLLM calls `factory(vllm_config, engine_index)` and then `record(...)`
in the process that made the engine, after each batch of engine outputs. What `record` is given,
`SchedulerStats` and `IterationStats`, vLLM calls "not stable interfaces": the fields read here are
the ones `test_runtime_private.py` checks:

- `SchedulerStats.kv_cache_usage` (0-1), `.prefix_cache_stats.queries` / `.hits` (tokens this step);
- `IterationStats.num_prompt_tokens`, `.num_generation_tokens`, `.num_preempted_reqs`,
  `.time_to_first_tokens_iter` (seconds, one per request that got its first token), and
  `.finished_requests[i].queued_time` (seconds in the waiting queue).

A figure vLLM stops giving reads as 0, never as a failed run (`getattr` with a default).
"""

from __future__ import annotations

from typing import Any, Protocol

from vllm.v1.metrics.loggers import StatLoggerBase


class FiguresSink(Protocol):
    def scheduler(self, kv_cache_usage: float, prefix_queries: int, prefix_hits: int) -> None: ...

    def iteration(
        self, prompt_tokens: int, generation_tokens: int, preemptions: int, first_token_seconds, queued_seconds
    ) -> None: ...


def stat_logger_factory(sink: FiguresSink):
    """A per-engine stat logger factory for `stat_loggers=`: each engine core's records go to `sink`."""

    class FiguresLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                sink.scheduler(
                    float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0),
                    int(getattr(prefix, "queries", 0) or 0),
                    int(getattr(prefix, "hits", 0) or 0),
                )
            if iteration_stats is not None:
                finished = getattr(iteration_stats, "finished_requests", ()) or ()
                sink.iteration(
                    int(getattr(iteration_stats, "num_prompt_tokens", 0) or 0),
                    int(getattr(iteration_stats, "num_generation_tokens", 0) or 0),
                    int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0),
                    list(getattr(iteration_stats, "time_to_first_tokens_iter", ()) or ()),
                    [float(getattr(request, "queued_time", 0.0) or 0.0) for request in finished],
                )

        def log_engine_initialized(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return FiguresLogger(vllm_config, engine_index)

    return factory
