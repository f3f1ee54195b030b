"""`batch-assets` as a user runs it: a real Dagster home, files on disk. The demo runs the console
script in a process of its own; the other commands go through the command line's `main` in the test's
process (`cli_in_process`), on the session's warm engine."""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets_tests.support import BAD_POSTS, REPO_ROOT, SAMPLES, open_instance, passed, run_cli, summary_lines

# The slow tier (`make test-fast` leaves it out): every test runs `batch-assets`, engine included.
pytestmark = pytest.mark.slow


def test_run_mixed_sentiment_file_gives_one_row_per_record(workdir, cli_in_process) -> None:
    tmp_path, _ = workdir
    posts = tmp_path / "mixed posts.jsonl"
    posts.write_text(BAD_POSTS + "\n", encoding="utf-8")
    result = cli_in_process(["run", "sentiment", str(posts)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = summary_lines(result.stdout)
    assert len(lines) == 1 and "9 rows, 6 error rows" in lines[0], result.stdout
    assert (tmp_path / "home" / "dagster.yaml").exists()
    # The file went into the drop zone and the outputs are where the contract says.
    assert (tmp_path / "data" / "drops" / "sentiment" / "mixed posts.jsonl").exists()
    [output] = (tmp_path / "data" / "storage" / "sentiment" / "validated_labels").glob("mixed_posts.jsonl-*.parquet")
    labels = pl.read_parquet(output)
    assert labels.height == 9 and labels["error"].null_count() == 3
    # Recorded in the instance at DAGSTER_HOME, like a UI-launched run.
    with open_instance(tmp_path / "home") as instance:
        runs = instance.get_runs()
        assert len(runs) == 1 and runs[0].job_name == "sentiment_pipeline" and runs[0].is_success


def test_tasks_lists_every_task_with_its_drop_zone(workdir, cli_in_process) -> None:
    tmp_path, _ = workdir
    result = cli_in_process(["tasks"])
    assert result.returncode == 0
    for task in ("industry", "sentiment", "answers"):
        assert f"drop zone: {tmp_path / 'data' / 'drops' / task}" in result.stdout


def engine_started(instance: dg.DagsterInstance, run_id: str) -> bool:
    return any("started the vLLM engine" in (entry.user_message or "") for entry in instance.all_logs(run_id))


def test_demo_runs_every_sample_and_a_second_demo_reruns_nothing(workdir) -> None:
    tmp_path, env = workdir
    first = run_cli(["demo"], env, tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    lines = summary_lines(first.stdout)
    with_samples = {folder.name for folder in SAMPLES.iterdir() if folder.is_dir()}
    assert {line.split("/")[0] for line in lines} == with_samples
    assert all(passed(line, line.split(": ", 1)[0]) and " run " in line for line in lines), lines
    # The choice samples carry hand-made labels, so their lines show accuracy next to the label counts,
    # and how many labels the model was unsure of (choice tasks have a confidence per label).
    from batch_assets.pipeline.task_spec import load_task_specs

    labelled = {task.name for task in load_task_specs() if task.checks.gold_field}
    assert {"industry", "sentiment", "industry_similarity", "industry_cascade"} <= labelled
    accuracy = {line.split("/")[0]: "hand-labelled rows" in line for line in lines}
    assert accuracy == {task: task in labelled for task in with_samples}, lines
    confidence = {line.split("/")[0]: "of labels with confidence under 0.5" in line for line in lines}
    assert confidence == {task: task in labelled for task in with_samples}, lines
    # Both ways of labelling the industry sample, side by side after the summaries.
    assert "Accuracy on the hand-labelled samples" in first.stdout
    side_by_side = first.stdout.split("Accuracy on the hand-labelled samples")[-1]
    assert "industry_similarity" in side_by_side and "embedding similarity" in side_by_side
    assert "structured outputs" in side_by_side
    embeddings = next(line for line in lines if line.startswith("embeddings/"))
    assert "12 embedded (dimension 384)" in embeddings
    sentiment = next(line for line in lines if line.startswith("sentiment/"))
    assert "(accuracy " in sentiment and "on 36 hand-labelled rows; " in sentiment
    # The caution about the embedded model is for runs on it; this one ran on the tiny test model.
    assert "not a labeler" not in first.stdout
    # One engine start per model: the tiny chat model's serves the five chat tasks (its first run is
    # one with the longest context, 2048 tokens), all-MiniLM's the three embedding tasks.
    with open_instance(tmp_path / "home") as instance:
        started = sorted(run.job_name for run in instance.get_runs() if engine_started(instance, run.run_id))
    assert started == ["document_qa_pipeline", "embeddings_pipeline"], started
    second = run_cli(["demo"], env, tmp_path)
    assert second.returncode == 0
    again = summary_lines(second.stdout)
    assert len(again) == len(lines) and all("UP TO DATE" in line for line in again), again
    assert "starting vLLM engine" not in second.stdout + second.stderr
    with open_instance(tmp_path / "home") as instance:
        assert len(instance.get_runs()) == len(lines)


def test_demo_says_once_that_the_embedded_model_is_not_a_labeler(monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.app.runner import demo_note
    from batch_assets.pipeline.task_spec import load_task_specs

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    note = demo_note(load_task_specs())
    assert "not a labeler" in note and "engine.model" in note and "BATCH_ASSETS_MODEL" in note
    assert "engine.base_url" in note and "checks.gold_field" in note
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "/models/llama-3.1-8b-instruct")
    assert demo_note(load_task_specs()) is None


def test_repo_root_has_the_contract_files() -> None:
    for name in ("workspace.yaml", "dagster.yaml", "Makefile", ".ci/run", "pyproject.toml", "README.md"):
        assert (REPO_ROOT / name).exists(), name


def test_run_over_budget_fails_naming_estimate_and_limit(workdir, cli_in_process) -> None:
    tmp_path, _ = workdir
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "budgeted.yaml").write_text(
        "input: {text_fields: [text]}\nprompt: {template: 'Item: {text}'}\n"
        "engine: {max_model_len: 512, price: {input_per_million_tokens: 3.0, output_per_million_tokens: 15.0}}\n"
        "sampling: {temperature: 0, max_tokens: 4}\noutput: {kind: choices, choices: [a, b]}\n"
        "budget: {max_generated_tokens: 30}\n"
    )
    items = tmp_path / "items.jsonl"
    items.write_text("".join(f'{{"text": "item {i}"}}\n' for i in range(10)))
    result = cli_in_process(["run", "budgeted", str(items)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    assert result.returncode == 1
    [line] = summary_lines(result.stdout)
    assert (
        "FAILED" in line
        and (
            "stopped by within_budget: worst-case generated tokens 40 (10 rows x sampling.max_tokens) "
            "exceed budget.max_generated_tokens 30"
        )
        in line
    )
    assert "starting vLLM engine" not in result.stdout + result.stderr
    assert not (tmp_path / "data" / "storage" / "budgeted" / "inference_outputs").exists()


def test_run_of_several_files_is_one_run_per_range_with_a_line_per_file(workdir, cli_in_process) -> None:
    """Files of one command are grouped like a backfill: ranges of up to `runs.max_partitions_per_run`."""
    tmp_path, _ = workdir
    names = ["a.csv", "b.csv", "c.csv"]
    for index, name in enumerate(names):
        (tmp_path / name).write_text(
            "Name,Company\n" + "".join(f"n{i},Firm {index} {i} LLP\n" for i in range(index + 2))
        )
    result = cli_in_process(["run", "industry", *(str(tmp_path / n) for n in names)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = summary_lines(result.stdout)
    assert [line.split(":")[0] for line in lines] == [f"industry/{n}" for n in names]
    assert all(f"{rows} rows, 0 error rows" in line for line, rows in zip(lines, (2, 3, 4), strict=True)), lines
    assert all(re.search(r", \d+\.\d generated tok/s; tokens \d+ in, \d+ out$", line) for line in lines), lines
    with open_instance(tmp_path / "home") as instance:
        [run] = instance.get_runs()
        assert run.is_success
        assert (run.tags["dagster/asset_partition_range_start"], run.tags["dagster/asset_partition_range_end"]) == (
            "a.csv",
            "c.csv",
        )
        # Each line names that run; each partition has its own materialization from it.
        assert all(run.run_id[:8] in line for line in lines)
        for name in names:
            record = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(["industry", "validated_labels"]), asset_partitions=[name]),
                limit=1,
            ).records[0]
            assert record.run_id == run.run_id

    # The same files again: each is UP TO DATE (materialized from this file and these code versions)
    # and nothing runs (issue 56.7).
    again = cli_in_process(["run", "industry", *(str(tmp_path / n) for n in names)])
    assert again.returncode == 0, again.stdout
    assert [line.split(": ")[:2] for line in summary_lines(again.stdout)] == [
        [f"industry/{n}", "UP TO DATE"] for n in names
    ], again.stdout
    assert all(
        f": {rows} rows, 0 error rows, labels: " in line
        for line, rows in zip(summary_lines(again.stdout), (2, 3, 4), strict=True)
    )
    with open_instance(tmp_path / "home") as instance:
        assert len(instance.get_runs()) == 1
    # --replace runs them again: one more run of the range, every row from the result cache.
    again = cli_in_process(["run", "industry", "--replace", *(str(tmp_path / n) for n in names)])
    assert again.returncode == 0 and len(summary_lines(again.stdout)) == 3
    # Issue 29.9: these lines said "0.0 generated tok/s"; they say where the rows came from.
    tokens = []
    for line, rows in zip(summary_lines(again.stdout), (2, 3, 4), strict=True):
        assert f", nothing inferred: {rows} rows from the result cache; tokens " in line and "tok/s" not in line, line
        used = re.search(r"; tokens ([\d,]+) in, ([\d,]+) out$", line)
        assert used, line
        tokens.append([int(value.replace(",", "")) for value in used.groups()])
    # The closing line totals the files' tokens (issue 60).
    total = f"total of 3 files: tokens {sum(t[0] for t in tokens):,} in, {sum(t[1] for t in tokens):,} out"
    assert total in again.stdout.splitlines(), again.stdout
    with open_instance(tmp_path / "home") as instance:
        assert len(instance.get_runs()) == 2
        for name, rows in zip(names, (2, 3, 4), strict=True):
            metadata = (
                instance.fetch_materializations(
                    dg.AssetRecordsFilter(
                        asset_key=dg.AssetKey(["industry", "inference_outputs"]), asset_partitions=[name]
                    ),
                    limit=1,
                )
                .records[0]
                .asset_materialization.metadata
            )
            assert (metadata["rows_inferred"].value, metadata["rows_from_cache"].value) == (0, rows)


def test_an_unchanged_file_is_up_to_date_until_its_task_changes(workdir, cli_in_process) -> None:
    """Issue 56.7: a file whose partition is materialized from the same file and code versions is
    UP TO DATE and runs nothing; an edit of the task that changes its outputs (its code version) runs
    it again, as editing the file does."""
    tmp_path, _ = workdir
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    bundled = (REPO_ROOT / "batch_assets" / "tasks" / "industry.yaml").read_text()
    (tasks / "industry.yaml").write_text(bundled)
    companies = tmp_path / "companies.csv"
    companies.write_text("Company\nAcme Holdings LLP\nGlobex Hospital\n")
    first = cli_in_process(["run", "industry", str(companies)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    again = cli_in_process(["run", "industry", str(companies)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    [line] = summary_lines(again.stdout)
    assert again.returncode == 0 and line.startswith("industry/companies.csv: UP TO DATE: 2 rows, 0 error rows"), line
    with open_instance(tmp_path / "home") as instance:
        assert len(instance.get_runs()) == 1
    # Another prompt: the partition's outputs are stale, so it runs again.
    (tasks / "industry.yaml").write_text(bundled.replace("What industry is this company in:", "Industry of:"))
    edited = cli_in_process(["run", "industry", str(companies)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    [line] = summary_lines(edited.stdout)
    assert edited.returncode == 0 and passed(line, "industry/companies.csv") and " run " in line, line
    with open_instance(tmp_path / "home") as instance:
        assert len(instance.get_runs()) == 2


def metadata_of(**values: int) -> dict[str, dg.MetadataValue]:
    return {name: dg.MetadataValue.int(value) for name, value in values.items()} | {
        "generated_tokens_per_second": dg.MetadataValue.float(values.get("generated", 0) / 2)
    }


def test_summary_names_the_rate_of_inferred_rows_and_the_source_of_reused_ones() -> None:
    """Issue 29.9: a file whose rows all came from the cache or checkpoints said "0.0 generated tok/s"."""
    from batch_assets.app.run_outcomes import _inference_text

    assert _inference_text(metadata_of(rows_inferred=5, generated=81)) == ", 40.5 generated tok/s"
    # Some rows reused, some inferred: the rate is of the inferred ones.
    assert _inference_text(metadata_of(rows_inferred=1, rows_from_cache=4, generated=8)) == ", 4.0 generated tok/s"
    assert _inference_text(metadata_of(rows_inferred=0, rows_from_cache=7)) == (
        ", nothing inferred: 7 rows from the result cache"
    )
    assert _inference_text(metadata_of(rows_inferred=0, rows_from_cache=2, rows_from_checkpoint=3)) == (
        ", nothing inferred: 2 rows from the result cache and 3 rows from checkpoints"
    )
    # Only error rows: nothing was inferred and nothing reused, so nothing to say.
    assert _inference_text(metadata_of(rows_inferred=0)) == ""


@pytest.mark.parametrize(
    ("message", "line"),
    [
        ("inferred 99/100 requests (99%), 200.0 rows/s", "  t/p: 99/100 requests (99%), 200.0 rows/s, under 1 s left"),
        ("inferred 10/100 requests (10%), 2.0 rows/s", "  t/p: 10/100 requests (10%), 2.0 rows/s, about 45 s left"),
        ("inferred 0/1000 requests (0%), 5.0 rows/s", "  t/p: 0/1000 requests (0%), 5.0 rows/s, about 3 min 20 s left"),
        ("inferred 100/100 requests (100%), 2.0 rows/s", "  t/p: 100/100 requests (100%), 2.0 rows/s"),
    ],
)
def test_progress_line_says_the_time_left_in_plain_words(message: str, line: str, monkeypatch) -> None:
    """Issue 29.9: the last second showed as "about under 1 s left"."""
    import io
    import logging

    from batch_assets.cli import TERMINAL, _ProgressHandler

    out = io.StringIO()  # not a terminal: one line per update
    monkeypatch.setattr(TERMINAL, "stream", out)
    _ProgressHandler("t/p").emit(logging.LogRecord("run", logging.INFO, __file__, 1, message, None, None))
    assert out.getvalue() == line + "\n"


def test_a_file_over_max_rows_per_partition_runs_as_shards_with_one_line_and_one_dataset(
    workdir, cli_in_process
) -> None:
    """Issue 26.2: each shard is a run of its own; the file gets one summary line; its result is one
    glob of shards whose rows carry the whole file's row_id and source_line."""
    tmp_path, _ = workdir
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    bundled = (Path(__file__).parent.parent / "batch_assets" / "tasks" / "industry.yaml").read_text()
    (tasks / "industry.yaml").write_text(bundled.replace("input:\n", "input:\n  max_rows_per_partition: 10\n", 1))
    big = tmp_path / "big.csv"
    big.write_text("Name,Company\n" + "".join(f'n{i},"Firm {i}\nLLP"\n' for i in range(25)))
    result = cli_in_process(["run", "industry", str(big)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    [line] = summary_lines(result.stdout)
    assert passed(line, "industry/big.csv~*") and line.endswith("(3 shards)")
    assert ": 25 rows, 0 error rows, labels: " in line
    labels = pl.read_parquet(str(tmp_path / "data" / "storage" / "industry" / "validated_labels" / "big.csv~*.parquet"))
    labels = labels.sort("row_id")
    assert labels["row_id"].to_list() == list(range(25))
    assert labels["source_line"].to_list() == list(range(2, 52, 2))  # each record spans two lines
    assert labels["Company"][24] == "Firm 24\nLLP" and labels["label"].null_count() == 0
    with open_instance(tmp_path / "home") as instance:
        runs = instance.get_runs()
        assert sorted(run.tags["dagster/partition"] for run in runs) == [f"big.csv~0000{n}" for n in (1, 2, 3)]
        assert all(run.is_success for run in runs)


def test_a_free_text_summary_counts_answers_and_names_the_error_codes(workdir, cli_in_process) -> None:
    """Issue 56.15: a `kind: text` task's answers are not labels: its line says how many there are
    and how long, not a histogram of paragraphs; and its error rows are named by their commonest codes."""
    tmp_path, _ = workdir
    posts = tmp_path / "questions.jsonl"
    posts.write_text(BAD_POSTS + "\n", encoding="utf-8")
    result = cli_in_process(["run", "answers", str(posts)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    [line] = summary_lines(result.stdout)
    [output] = (tmp_path / "data" / "storage" / "answers" / "validated_labels").glob("questions.jsonl*.parquet")
    labels = pl.read_parquet(output)
    answers = labels["label"].drop_nulls()
    assert answers.len() == 3
    lengths = sorted(answers.str.len_chars().to_list())
    codes = labels["error"].drop_nulls().str.extract(r"^([a-z_]+):", 1).value_counts(sort=True, name="n")
    ranked = sorted(zip(codes["error"], codes["n"], strict=True), key=lambda code: (-code[1], code[0]))
    named = ", ".join(f"{code}={count}" for code, count in ranked[:3])
    more = f", {len(ranked) - 3} more codes" if len(ranked) > 3 else ""
    assert f": 9 rows, 6 error rows ({named}{more}), answers: 3, {lengths[0]}-{lengths[-1]} characters " in line, line
    assert f"(median {lengths[1]})" in line and ", labels: " not in line and len(line) < 300, line
