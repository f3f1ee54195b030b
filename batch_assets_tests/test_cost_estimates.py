"""Issue 60: what a run costs before (`batch-assets estimate`) and after (the summary line, the
metadata), what the engine itself saw (vLLM's stat loggers), and the progress the UI shows.

One run on the session's warm tiny-model engine; the estimate around it starts none."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from batch_assets_tests.support import free_port, open_instance, passed, python_env, summary_lines

# The slow tier: the tiny model's tokenizer and engine.
pytestmark = pytest.mark.slow

# A system prompt of several KV-cache blocks shared by every row: vLLM's prefix cache serves it to
# every request after the first engine step (more prompt tokens than one step takes).
SYSTEM = " ".join(f"Rule {i}: read the item with care and answer with one of the labels." for i in range(45))
TASK = (
    "input: {text_fields: [text]}\n"
    f"prompt: {{system: '{SYSTEM}', template: 'Item: {{text}}'}}\n"
    "engine: {max_model_len: 1024, price: {input_per_million_tokens: 3.0, output_per_million_tokens: 15.0, "
    "per_gpu_hour: 2.5}}\n"
    "sampling: {temperature: 0, max_tokens: 4}\noutput: {kind: choices, choices: [a, b]}\n"
)
ROWS = 24


def _values(instance: dg.DagsterInstance, asset: str) -> dict:
    records_filter = dg.AssetRecordsFilter(asset_key=dg.AssetKey(["priced", asset]))
    [record] = instance.fetch_materializations(records_filter, limit=1).records
    return {name: entry.value for name, entry in record.asset_materialization.metadata.items()}


def _estimate(stdout: str) -> dict[str, float]:
    """The figures of one file's `estimate` lines, by name."""
    found = {
        "rows": r": (\d+) rows", "refused": r"rows, (\d+) refused", "prompt_tokens": r"prompt tokens: ([\d,]+)",
        "max_generated": r"generated tokens: at most ([\d,]+)", "max_cost": r"cost: at most \$([\d.]+)",
        "cache_rows": r"result cache: answers ([\d,]+) rows",
    }  # fmt: skip
    values = {}
    for name, pattern in found.items():
        match = re.search(pattern, stdout)
        assert match, f"{name} not in {stdout}"
        values[name] = float(match[1].replace(",", ""))
    return values


def test_estimate_matches_the_run_which_costs_no_more_and_reports_the_engine(workdir, cli_in_process) -> None:
    tmp_path, _ = workdir
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "priced.yaml").write_text(TASK)
    items = tmp_path / "items.jsonl"
    lines = [f'{{"text": "item number {i}"}}' for i in range(ROWS)] + ['{"text": ""}', '{"other": 1}', "not json"]
    items.write_text("\n".join(lines) + "\n")
    env = {"BATCH_ASSETS_TASKS_DIR": str(tasks)}

    before = cli_in_process(["estimate", "priced", str(items)], **env)
    assert before.returncode == 0, before.stdout + before.stderr
    estimate = _estimate(before.stdout)
    assert (estimate["rows"], estimate["refused"]) == (ROWS + 3, 3)
    assert "empty_text=1" in before.stdout and "missing_field=1" in before.stdout, before.stdout
    assert estimate["max_generated"] == ROWS * 4 and estimate["cache_rows"] == 0
    assert "no earlier partition" in before.stdout  # nothing measured yet: no expected figures
    assert not (tmp_path / "data" / "drops" / "priced").exists()  # nothing copied, nothing registered

    run = cli_in_process(["run", "priced", str(items)], **env)
    [line] = summary_lines(run.stdout)
    assert passed(line, "priced/items.jsonl"), run.stdout[-3000:]
    with open_instance(tmp_path / "home") as instance:
        formatted, inferred = _values(instance, "formatted_prompts"), _values(instance, "inference_outputs")
        [done] = instance.get_runs(limit=1)
        progress = [e.message for e in instance.all_logs(done.run_id) if "requests (" in (e.message or "")]
    # The estimate counted what the run sent, row for row, and formatted_prompts recorded the same.
    assert inferred["prompt_tokens"] == estimate["prompt_tokens"] == formatted["estimated_prompt_tokens"]
    assert formatted["estimated_rows_to_infer"] == ROWS and formatted["error_rows"] == 3
    # The summary line gives tokens in and out and the dollars; never more than the worst case.
    assert f"tokens {inferred['prompt_tokens']:,} in, {inferred['generated_tokens']:,} out" in line, line
    assert f"${inferred['cost_usd']:,.6f}" in line and "of GPU time" in line, line
    assert 0 < inferred["cost_usd"] <= estimate["max_cost"] == formatted["estimated_max_cost_usd"]
    # One device (a CPU), one partition: its engine seconds, at $2.50 an hour.
    assert inferred["gpu_hours"] == pytest.approx(inferred["engine_seconds"] / 3600, abs=1e-6)
    assert inferred["gpu_cost_usd"] == pytest.approx(inferred["gpu_hours"] * 2.5, abs=1e-6)
    # vLLM's own figures, in range; the shared system prompt is served from the prefix cache.
    assert 0 < inferred["prefix_cache_hit_rate"] <= 1, inferred
    assert inferred["preemptions"] >= 0 and 0 < inferred["kv_cache_usage_peak"] <= 1
    assert 0 < inferred["ttft_p50_s"] <= inferred["ttft_p95_s"] < 600
    assert 0 <= inferred["queue_time_p50_s"] <= inferred["queue_time_p95_s"] < 600
    assert inferred["engine_prompt_tokens_per_second"] > 0 and inferred["engine_generation_tokens_per_second"] > 0
    # The progress reached the run's event log (what the UI shows) while it ran, at a bounded rate.
    assert progress and progress[-1].startswith(f"inferred {ROWS}/{ROWS} requests (100%)"), progress
    assert len(progress) <= 11 and all("rows/s" in message for message in progress)

    after = cli_in_process(["estimate", "priced", str(items)], **env)
    again = _estimate(after.stdout)
    # Now the cache answers every row, and the earlier partition gives the expected figures.
    assert again["cache_rows"] == ROWS and "0 requests to send" in after.stdout
    assert f"expected {inferred['generated_tokens']:,} (from 1 earlier partition" in after.stdout, after.stdout


ESTIMATE_SCRIPT = """
import sys
from batch_assets.cli import main
codes = [main(["estimate", task, sys.argv[1]]) for task in ("local", "remote")]
print("codes", codes, "vllm imported:", "vllm" in sys.modules)
"""


def test_estimate_starts_no_engine_and_sends_no_request(workdir, tiny_model_path: str) -> None:
    """The in-process engine's task is estimated without importing vLLM; the endpoint's, whose model
    the server would be asked for, without a request (its URL is a closed port)."""
    tmp_path, env = workdir
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local.yaml").write_text(TASK)
    port = free_port()  # nothing listens there
    (tasks / "remote.yaml").write_text(
        TASK.replace(
            "engine: {",
            f"engine: {{kind: openai, base_url: 'http://127.0.0.1:{port}/v1', tokenizer: '{tiny_model_path}', ",
        )
    )
    items = tmp_path / "items.jsonl"
    items.write_text("".join(f'{{"text": "item {i}"}}\n' for i in range(5)))
    result = subprocess.run(
        [sys.executable, "-c", ESTIMATE_SCRIPT, str(items)],
        env=python_env({**env, "BATCH_ASSETS_TASKS_DIR": str(tasks)}),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "codes [0, 0] vllm imported: False" in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("prompt tokens: ") == 2 and "cost: at most $" in result.stdout
    assert not Path(tmp_path / "data" / "drops").exists()
