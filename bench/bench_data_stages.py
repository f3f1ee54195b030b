"""Data stages around the engine: raw → formatted (with token counts) and outputs → validated labels.

    .venv/bin/python bench/bench_data_stages.py --rows 1000000 --runs 3
    .venv/bin/python bench/bench_data_stages.py --rows 2000000 --runs 1 --memory

The inference stage is replaced by a precomputed output table (benchmark only): every valid row
gets one of the industry choices. Each stage runs in a fresh subprocess so its peak memory (max RSS)
is its own. Prints rows/s per stage and peak RSS; medians over --runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

STAGE = r"""
import json, resource, sys, time
from pathlib import Path
import polars as pl
stage, csv_path, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
from batch_assets.pipeline.task_spec import load_task_specs
task = {t.name: t for t in load_task_specs()}["industry"]
if stage == "raw_to_formatted":
    from transformers import AutoTokenizer
    from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts
    from batch_assets.engines.embedded_model import ensure_embedded_model
    from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    fmt = PromptFormat(task.prompt.system, task.prompt.template, None, tuple(task.input.text_fields))
    started = time.perf_counter()
    raw = read_prompts(csv_path.read_bytes(), csv_path.name, ParseOptions(("Company",), "Company"))
    formatted = format_prompts(raw, fmt, tokenizer, max_model_len=1024, max_tokens=16, source_file=csv_path.name)
    seconds = time.perf_counter() - started
    rows = formatted.height
    choices = task.output.choices
    # Stand-in for inference_outputs (benchmark only): a valid choice per valid row.
    outputs = formatted.with_columns(
        generated_text=pl.when(pl.col("error").is_null()).then(pl.lit(choices[0])),
        finish_reason=pl.when(pl.col("error").is_null()).then(pl.lit("stop")),
        num_generated_tokens=pl.when(pl.col("error").is_null()).then(pl.lit(2, dtype=pl.Int64)),
    )
    outputs.write_parquet(work / "outputs.parquet")
else:
    from batch_assets.pipeline.validate_labels import validate_labels
    outputs = pl.read_parquet(work / "outputs.parquet")
    started = time.perf_counter()
    labels = validate_labels(outputs, task.output)
    seconds = time.perf_counter() - started
    rows = labels.height
print(json.dumps({"stage": stage, "rows": rows, "seconds": seconds,
                  "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)}))
"""


def run_stage(stage: str, csv_path: Path, work: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STAGE, stage, str(csv_path), str(work)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat-share", type=float, default=0.3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        csv_path = work / f"customers-{args.rows}.csv"
        subprocess.run(
            [
                sys.executable,
                str(HERE / "generate_customers.py"),
                str(args.rows),
                str(csv_path),
                "--repeat-share",
                str(args.repeat_share),
            ],
            check=True,
        )
        results: dict[str, list[dict]] = {"raw_to_formatted": [], "outputs_to_validated": []}
        for _ in range(args.runs):
            for stage in results:
                results[stage].append(run_stage(stage, csv_path, work))
        print(f"rows: {args.rows:,}  repeat share: {args.repeat_share}  runs: {args.runs}")
        for stage, runs in results.items():
            rate = statistics.median(r["rows"] / r["seconds"] for r in runs)
            rss = max(r["max_rss_gib"] for r in runs)
            seconds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
            print(f"{stage:22s} median {rate:12,.0f} rows/s   peak RSS {rss:.2f} GiB   (seconds: {seconds})")


if __name__ == "__main__":
    main()
