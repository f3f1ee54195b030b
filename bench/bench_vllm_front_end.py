"""vLLM's front end in the run's process: the tiny model at data_parallel_size 1 and 2, the pipeline's engine path.

    .venv/bin/python bench/bench_vllm_front_end.py --rows 2000 --dp 1 2

For each data-parallel size, in a new process: the industry task's prompts (distinct company names,
tokenized as the pipeline does) through `VLLMEngine(data_parallel_size=N)`'s session (vLLM's
`AsyncLLM` in this process, its engine cores in their own), the tests' tiny model
(batch_assets_tests/tiny_model.py) so the model costs little and the front end shows. Reported:
rows/s from first request to last result, and the CPU seconds of the front-end process (this
process: tokenizing, vLLM's input and output processing, detokenizing) against the engine cores'
(its child processes). A front end near one core's worth of CPU per second of wall time is the
bottleneck that more engine cores cannot lift. A data-parallel size vLLM refuses here is printed
with vLLM's error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def child(rows: int, dp: int) -> None:
    import psutil

    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_lifecycle import shutdown_engines
    from batch_assets.pipeline.engine_contract import Prompt
    from batch_assets.pipeline.task_spec import load_task_spec
    from batch_assets_tests.tiny_model import built_tiny_model

    task = load_task_spec(REPO / "batch_assets" / "tasks" / "industry.yaml")
    engine = VLLMEngine(model=str(built_tiny_model()), data_parallel_size=str(dp))
    settings = engine.settings(task, gpus=0)
    tokenizer = engine.tokenizer(settings)
    names = [f"Company {i} Holdings" for i in range(rows)]
    system = {"role": "system", "content": task.prompt.system}
    messages = [[system, {"role": "user", "content": task.prompt.template.format(Company=n)}] for n in names]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]  # as the pipeline encodes
    prompts = [Prompt(tuple(i)) for i in ids]
    me = psutil.Process()
    try:
        with engine.session(task, settings) as session:
            session.start()
            warm = list(session.stream(prompts[:32]))  # compiles, caches: not measured
            assert len(warm) == 32
            cores = me.children(recursive=True)
            before = (me.cpu_times(), [c.cpu_times() for c in cores])
            started = time.perf_counter()
            done = sum(1 for _ in session.stream(prompts))
            seconds = time.perf_counter() - started
            after = (me.cpu_times(), [c.cpu_times() for c in cores])
    finally:
        shutdown_engines()
    front = (after[0].user + after[0].system) - (before[0].user + before[0].system)
    engine_cpu = sum(a.user + a.system - (b.user + b.system) for a, b in zip(after[1], before[1], strict=True))
    print(
        json.dumps(
            {
                "dp": dp,
                "rows": done,
                "seconds": seconds,
                "rows_per_s": done / seconds,
                "front_end_cpu_per_s": front / seconds,
                "engine_cores_cpu_per_s": engine_cpu / seconds,
                "engine_processes": len(cores),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "vllm_front_end.txt")
    args = parser.parse_args()
    lines = []
    for dp in args.dp:
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(args.rows), str(dp)], capture_output=True, text=True, cwd=REPO
        )
        results = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 0 and results:
            line = f"data_parallel_size {dp}: {results[-1]}"
        else:
            errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
            line = f"data_parallel_size {dp}: failed (exit {done.returncode}): " + " | ".join(errors[-3:])
        print(line, flush=True)
        lines.append(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(REPO))
        child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
