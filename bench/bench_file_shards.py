"""A big drop file split into shards: the planning pass, and raw → formatted of one shard, against the
whole file as one partition.

    .venv/bin/python bench/bench_file_shards.py --rows 5000000 --shard-rows 1000000 250000 --whole

A customers-style CSV of `--rows` rows is dropped into a drop zone. Then, each in a fresh subprocess
(so its peak RSS is its own):
- `plan`: the one streaming pass the sensor (or `batch-assets run`) makes over a new file version
  to find its shards (`storage/shards.py`), for the largest `--shard-rows`;
- `shard`: for each `--shard-rows`, the last shard of the file (the farthest to seek to) read as
  raw_prompts reads a partition (`read_partition_rows`) and formatted with token counts as
  formatted_prompts does (`format_prompts`, the embedded model's tokenizer);
- `whole` (with `--whole`): the same for the file as one partition (what every file was before
  `input.max_rows_per_partition`).
Prints seconds, rows/s and peak RSS of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

STEP = r"""
import json, resource, sys, time
step, max_rows = sys.argv[1], int(sys.argv[2])
from batch_assets.pipeline.inputs.read_prompts import ParseOptions
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets.storage.drop_files import list_drop_files
from batch_assets.storage.shards import file_partition_keys, read_partition_rows, shard_plan
task = {t.name: t for t in load_task_specs()}["industry"]
[drop], _ = list_drop_files("industry")
started = time.perf_counter()
if step == "plan":
    plan = shard_plan("industry", drop, max_rows)
    rows = sum(shard.rows for shard in plan.shards)
    extra = {"shards": len(plan.shards)}
else:
    from transformers import AutoTokenizer
    from batch_assets.engines.embedded_model import ensure_embedded_model
    from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    fmt = PromptFormat(task.prompt.system, task.prompt.template, None, tuple(task.input.text_fields))
    key = drop.partition_key if step == "whole" else file_partition_keys("industry", drop, max_rows)[-1]
    started = time.perf_counter()
    raw = read_partition_rows("industry", drop, key, ParseOptions(("Company",), "Company"), max_rows)
    formatted = format_prompts(raw, fmt, tokenizer, max_model_len=1024, max_tokens=16, source_file=key)
    rows = formatted.height
    extra = {"partition": key, "first_row_id": int(raw["row_id"][0])}
seconds = time.perf_counter() - started
print(json.dumps({"step": step, "max_rows": max_rows, "rows": rows, "seconds": seconds,
                  "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), **extra}))
"""


def run_step(step: str, max_rows: int, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STEP, step, str(max_rows)], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--shard-rows", type=int, nargs="+", default=[1_000_000, 250_000])
    parser.add_argument("--whole", action="store_true", help="also the whole file as one partition")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        zone = data / "drops" / "industry"
        zone.mkdir(parents=True)
        csv_path = zone / "customers.csv"
        subprocess.run([sys.executable, str(HERE / "generate_customers.py"), str(args.rows), str(csv_path)], check=True)
        env = {**os.environ, "BATCH_ASSETS_DATA": str(data)}
        size = csv_path.stat().st_size
        print(f"file: {args.rows:,} rows, {size / (1 << 20):.0f} MiB")
        steps = [("plan", max(args.shard_rows))] + [("shard", rows) for rows in args.shard_rows]
        steps += [("whole", args.rows)] if args.whole else []
        for step, max_rows in steps:
            result = run_step(step, max_rows, env)
            rate = result["rows"] / result["seconds"]
            detail = {k: v for k, v in result.items() if k not in ("step", "rows", "seconds", "max_rss_gib")}
            print(
                f"{step:6s} max_rows {max_rows:>9,}: {result['rows']:>9,} rows in {result['seconds']:7.2f} s "
                f"({rate:10,.0f} rows/s), peak RSS {result['max_rss_gib']:.2f} GiB  {json.dumps(detail)}"
            )


if __name__ == "__main__":
    main()
