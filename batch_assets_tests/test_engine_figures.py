"""The engine's own figures (engines/engine_figures.py) and a run's usage line (app/run_outcomes.py):
pure, no engine."""

from __future__ import annotations

from collections import Counter

from batch_assets.app.run_outcomes import PartitionOutcome, Usage, usage_total_line
from batch_assets.engines.engine_figures import BatchTimes, EndpointFigures, EngineFigures, percentile


def test_figures_after_a_mark_leave_out_what_a_warm_engine_did_before() -> None:
    figures = EngineFigures()
    figures.scheduler(0.9, prefix_queries=1000, prefix_hits=0)  # an earlier session's stream
    figures.iteration(1000, 50, 3, [9.0], [8.0])
    mark = figures.mark()
    figures.scheduler(0.30, prefix_queries=400, prefix_hits=300)
    figures.scheduler(0.45, prefix_queries=100, prefix_hits=0)
    figures.iteration(500, 20, 1, [0.1 * i for i in range(1, 21)], [0.01] * 19 + [2.0])
    seen = figures.since(mark)
    assert seen["prefix_cache_hit_rate"] == 0.6 and seen["preemptions"] == 1
    assert seen["kv_cache_usage_peak"] == 0.45
    # Percentiles within 2 %: the 10th of 20 times to first token is 1.0 s, the 19th 1.9 s.
    assert 1.0 <= seen["ttft_p50_s"] <= 1.02 and 1.9 <= seen["ttft_p95_s"] <= 1.94
    assert 0.01 <= seen["queue_time_p50_s"] <= 0.0102 and seen["queue_time_p95_s"] <= 0.0102


def test_no_lookups_read_as_a_zero_hit_rate_and_no_times_as_no_percentiles() -> None:
    figures = EngineFigures()
    seen = figures.since(figures.mark())
    assert seen["prefix_cache_hit_rate"] == 0.0 and seen["preemptions"] == 0
    assert "ttft_p50_s" not in seen and percentile(Counter(), 0.5) is None


def test_endpoint_figures_count_retries_429s_and_latency() -> None:
    figures = EndpointFigures()
    assert figures.metadata() == {}  # nothing sent: nothing to say
    for status in (429, 429, 200, 200, 500, 200):
        figures.attempt()
        figures.response(status)
    for seconds in (0.2, 0.4, 3.0):
        figures.call_done(seconds)
    seen = figures.metadata()
    assert (seen["http_requests"], seen["http_retries"], seen["http_429s"]) == (6, 3, 2)
    assert 0.4 <= seen["latency_p50_s"] <= 0.41 and 3.0 <= seen["latency_p95_s"] <= 3.06


def test_the_closing_line_totals_the_files_tokens_and_dollars() -> None:
    def outcome(key: str, usage: Usage | None, skipped: bool = False) -> PartitionOutcome:
        return PartitionOutcome("t", key, True, None, "", skipped=skipped, usage=usage)

    first, second = Usage(1000, 40, 0.0036, None), Usage(500, 10, 0.00165, 0.25)
    assert first.text() == "tokens 1,000 in, 40 out, $0.003600"
    assert second.text() == "tokens 500 in, 10 out, $0.001650, $0.250000 of GPU time"
    outcomes = [outcome("a", first), outcome("b", second), outcome("c", Usage(9, 9, 9.0), skipped=True)]
    assert usage_total_line(outcomes) == "total of 2 files: tokens 1,500 in, 50 out, $0.005250, $0.250000 of GPU time"
    assert usage_total_line(outcomes[:1]) is None  # one file: its own line says it


def test_batch_times_are_the_providers_own_clock() -> None:
    from types import SimpleNamespace

    times = BatchTimes()
    assert times.metadata() == {}
    times.add(SimpleNamespace(created_at=100, in_progress_at=160, finalizing_at=900, completed_at=960))
    times.add(SimpleNamespace(created_at=130, in_progress_at=140, completed_at=None, failed_at=200))
    times.add(SimpleNamespace(created_at=150))  # a provider that gives no more
    assert times.metadata() == {
        "batch_provider_wait_seconds": 60.0,
        "batch_provider_run_seconds": 800.0,
        "batch_provider_total_seconds": 860.0,
    }


def _estimated(tmp_path, formatted, history, cached=None):
    from types import SimpleNamespace

    from batch_assets.lib.estimates import estimate_partition
    from batch_assets.pipeline.task_formats import task_format
    from batch_assets.pipeline.task_spec import load_task_spec

    path = tmp_path / "priced.yaml"
    path.write_text(
        "input: {text_fields: [text]}\nprompt: {template: '{text}'}\nsampling: {temperature: 0, max_tokens: 5}\n"
        "engine: {price: {input_per_million_tokens: 1.0, output_per_million_tokens: 10.0, per_gpu_hour: 3.6}}\n"
        "output: {kind: choices, choices: [a, b]}\n"
    )
    settings = SimpleNamespace(kind="vllm", on_gpu=True, tensor_parallel_size=2, data_parallel_size=1)
    return estimate_partition(formatted, task_format(load_task_spec(path)), settings, history, cached)


def test_an_estimate_counts_refused_rows_cache_hits_and_expected_figures(tmp_path) -> None:
    import polars as pl

    from batch_assets.lib.estimates import History
    from batch_assets.pipeline.inference_requests import keyed_requests

    formatted = pl.DataFrame(
        {
            "row_id": [0, 1, 2, 3],
            "prompt": ["x", "y", "x", ""],
            "error": [None, None, None, "empty_text: no text"],
            "num_prompt_tokens": [100, 200, 100, 0],
        }
    )
    answered = keyed_requests(formatted, deduplicate=True)["request_key"][1]  # "y"
    estimate = _estimated(tmp_path, formatted, History(2, 3.0, 0.5), lambda keys: {answered})
    assert estimate.refused == {"empty_text": 1} and estimate.worst.rows_to_infer == 3
    assert (estimate.worst.prompt_tokens, estimate.worst.max_generated_tokens) == (400, 15)
    # "y" is cached; the two "x" rows are one request.
    assert (estimate.rows_from_cache, estimate.requests) == (1, 1)
    assert estimate.expected_generated_tokens == 9  # 3 tokens a row, measured
    assert estimate.worst.cost_usd == 0.00055 and estimate.expected_cost_usd == 0.00049
    # One request at 0.5 rows/s on 2 GPUs: 4 GPU-seconds, at $3.60 an hour.
    assert estimate.gpu_hours == 4 / 3600 and estimate.gpu_cost_usd == 0.004
    assert estimate.metadata()["estimated_gpu_cost_usd"] == 0.004


def test_an_estimate_of_only_refused_rows_and_no_history_has_no_expected_figures(tmp_path) -> None:
    import polars as pl

    from batch_assets.lib.estimates import History

    formatted = pl.DataFrame(
        {"row_id": [0], "prompt": [""], "error": ["empty_text: no text"], "num_prompt_tokens": [0]},
        schema_overrides={"error": pl.String},
    )
    estimate = _estimated(tmp_path, formatted, History(), lambda keys: set())
    assert (estimate.worst.rows_to_infer, estimate.rows_from_cache, estimate.requests) == (0, 0, 0)
    assert estimate.expected_generated_tokens is None and estimate.gpu_hours is None
    assert "estimated_cost_usd" not in estimate.metadata() and estimate.metadata()["estimated_max_cost_usd"] == 0.0
