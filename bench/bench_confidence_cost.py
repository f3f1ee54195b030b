"""What the labels' confidence costs in the engine: the same prompts with and without logprobs.

    .venv/bin/python bench/bench_confidence_cost.py --rows 500 --runs 3

One vLLM engine with the `industry` task's settings (as bench/plain_vllm_script.py starts it) and
one `LLM.chat` call per timed run over the same distinct customers, alternating runs whose sampling
asks for the sampled tokens' log-probabilities (what choices and regex tasks send, for `confidence`)
with runs that do not. A first untimed call warms the engine and its prefix cache, so every timed
run sees the same cache. Prints the median rows/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import polars as pl
    from vllm import LLM

    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_lifecycle import engine_process_environment
    from batch_assets.engines.vllm_requests import sampling_params_for
    from batch_assets.pipeline.task_spec import load_task_specs

    task = {t.name: t for t in load_task_specs()}["industry"]
    assert task.prompt is not None and task.output.has_confidence
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "customers.csv"
        subprocess.run([sys.executable, str(HERE / "generate_customers.py"), str(args.rows), str(source)], check=True)
        companies = pl.read_csv(source, infer_schema=False)["Company"].to_list()
    messages = [
        [
            {"role": "system", "content": task.prompt.system},
            {"role": "user", "content": task.prompt.template.format(Company=company)},
        ]
        for company in companies
    ]
    settings = VLLMEngine().settings(task)
    engine_args = settings.engine_args()
    engine_args.pop("disable_log_stats", None)
    # The environment the pipeline starts its engine with (on a CPU: torch.compile off), so the
    # log-probabilities are computed here as they are there.
    os.environ.update(engine_process_environment(settings))
    llm = LLM(**engine_args)
    params = {
        "with logprobs": sampling_params_for(task.sampling, task.output, logprobs=True),
        "without": sampling_params_for(task.sampling, task.output, logprobs=False),
    }
    llm.chat(messages, params["without"], use_tqdm=False)  # warm-up: same prefix cache for every run
    rates: dict[str, list[float]] = {name: [] for name in params}
    for run in range(args.runs):
        for name, sampling in params.items():
            started = time.perf_counter()
            outputs = llm.chat(messages, sampling, use_tqdm=False)
            rates[name].append(len(outputs) / (time.perf_counter() - started))
            print(json.dumps({"run": run, "mode": name, "rows_per_s": round(rates[name][-1], 2)}), flush=True)
    with_lp, without = (statistics.median(rates[name]) for name in params)
    print(
        json.dumps(
            {
                "rows": args.rows,
                "runs": args.runs,
                "rows_per_s_with_logprobs": round(with_lp, 2),
                "rows_per_s_without": round(without, 2),
                "ratio": round(with_lp / without, 3),
            }
        ),
        flush=True,
    )
    del llm


if __name__ == "__main__":
    main()
