"""The zero-cost engine of bench/bench_pipeline_ceiling.py runs a file through `batch-assets run`'s
runner (the benchmark measures the real pipeline, and keeps working)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets_tests.support import REPO_ROOT, load_script

# A Dagster run in this process and the tokenizer's load: tens of seconds, like the other runner tests.
pytestmark = pytest.mark.slow


def test_the_zero_cost_engine_answers_every_distinct_prompt_once_through_the_runner(
    data_dir: Path, tmp_path: Path
) -> None:
    from batch_assets.app.runner import run_partitions
    from batch_assets.lib.task_definitions import build_definitions
    from batch_assets.runtime.instance import open_instance

    zero_cost = load_script(REPO_ROOT / "bench" / "zero_cost_engine.py")
    source = tmp_path / "customers.csv"
    generate = [sys.executable, str(REPO_ROOT / "bench" / "generate_customers.py"), "40", str(source)]
    subprocess.run([*generate, "--repeat-share", "0.25"], check=True)
    companies = pl.read_csv(source)["Company"]
    [outcome] = run_partitions("industry", [source], definitions=build_definitions(engine=zero_cost.ZeroCostEngine()))
    assert outcome.ok, outcome.line()
    [labels_file] = (data_dir / "storage" / "industry" / "validated_labels").glob("customers.csv*.parquet")
    labels = pl.read_parquet(labels_file)
    assert labels["Company"].to_list() == companies.to_list()
    assert set(labels["label"]) == {"Law Firm"} and labels["error"].is_null().all()
    with open_instance() as instance:
        record = instance.fetch_materializations(dg.AssetKey(["industry", "inference_outputs"]), limit=1).records[0]
    metadata = {key: value.value for key, value in record.asset_materialization.metadata.items()}
    assert (metadata["rows"], metadata["rows_deduplicated"]) == (40, 40 - companies.n_unique())
    assert metadata["rows_deduplicated"] > 0
