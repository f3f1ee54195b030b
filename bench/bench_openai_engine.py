"""Rows/s through an OpenAI-compatible endpoint (`vllm serve`) vs the in-process engine, same prompts.

    .venv/bin/python bench/bench_openai_engine.py                      # embedded SmolLM2, 512 rows
    .venv/bin/python bench/bench_openai_engine.py --rows 256 --runs 3 --concurrency 16 64

The `sentiment` task (structured choices) on its sample posts, repeated with a number appended so
every prompt is distinct (no deduplication). Both engines get the same settings (model,
max_model_len, KV cache, max_num_seqs, eager mode) and token-identical prompts. Both are started
and warmed up first; then timed runs alternate between them (never side by side), so a change in
machine load hits both alike. Timed: one `generate` call over all rows, i.e. steady-state
throughput without engine start-up. Prints rows/s per run and the median; `--json` writes them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

KV_CACHE_BYTES = 1 << 30
MAX_NUM_SEQS = 256


def prompts_and_task(rows: int, model: str):
    from batch_assets.engines.openai_engine import OpenAIEngine
    from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts, prompt_encoders
    from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
    from batch_assets.pipeline.task_spec import load_task_specs

    task = {t.name: t for t in load_task_specs()}["sentiment"]
    sample = REPO_ROOT / "batch_assets" / "samples" / "sentiment" / "posts-sample.jsonl"
    posts = [json.loads(line)["text"] for line in sample.read_text().splitlines() if line.strip()]
    texts = [f"{posts[i % len(posts)]} (#{i})" for i in range(rows)]
    raw = read_prompts(
        "".join(json.dumps({"text": t}) + "\n" for t in texts).encode(), "bench.jsonl", ParseOptions(("text",), "text")
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    fmt = PromptFormat.of(task)
    formatted = format_prompts(
        raw, fmt, tokenizer, max_model_len=1024, max_tokens=task.sampling.max_tokens, source_file="bench"
    )
    assert formatted["error"].null_count() == formatted.height
    # Token ids carrying chat messages: the in-process engine reads the ids, the endpoint the messages.
    encode = prompt_encoders(OpenAIEngine(), fmt, tokenizer)(formatted)
    return task, encode(formatted["prompt"].to_list())


def timed(generate, prompts) -> float:
    started = time.perf_counter()
    outputs = generate(prompts)
    seconds = time.perf_counter() - started
    assert len(outputs) == len(prompts) and all(o.error is None for o in outputs)
    return len(prompts) / seconds


def start_server(model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--enforce-eager",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--max-num-seqs", str(MAX_NUM_SEQS), "--seed", "0",
        "--disable-log-stats", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/models", timeout=2):
                return process, base_url
        except OSError as exc:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_server(process)
                raise SystemExit(
                    f"vllm serve failed to start:\n{log_path.read_text(errors='replace')[-3000:]}"
                ) from exc
            time.sleep(1)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="model path, id or embedded:…")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[64], help="endpoint requests in flight (several: a sweep)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from batch_assets.engines.embedded_model import resolve_model

    model = resolve_model(args.model)
    task, prompts = prompts_and_task(args.rows, model)
    load = os.getloadavg()[0]

    from batch_assets.engines.openai_engine import OpenAIEngine
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE

    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_openai_engine_server.log"
    process, base_url = start_server(model, log_path)
    local_engine = VLLMEngine(
        model=model,
        max_model_len=1024,
        kv_cache_memory_gib=KV_CACHE_BYTES / (1 << 30),
        vllm_args={"max_num_seqs": MAX_NUM_SEQS, "enforce_eager": True},
    )

    def in_process(batch):
        with local_engine.session(task, local_engine.settings(task)) as session:
            return [g for _, g in sorted(session.stream(batch), key=lambda item: item[0])]

    engines = {"in_process": in_process}
    for concurrency in args.concurrency:
        endpoint = OpenAIEngine(base_url=base_url, model=model, concurrency=concurrency, local_tokenizer=model)
        engines[f"endpoint_c{concurrency}"] = functools.partial(lambda e, batch: e.generate(task, batch), endpoint)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for generate in engines.values():
            generate(prompts[:32])  # warm-up: engine start, compiled grammars, first requests
        # Interleaved, so that a change in machine load hits every engine alike.
        for _ in range(args.runs):
            for name, generate in engines.items():
                rates[name].append(timed(generate, prompts))
    finally:
        PROCESS_ENGINE.shutdown()
        stop_server(process)
    local = rates.pop("in_process")
    remote = {int(name.removeprefix("endpoint_c")): values for name, values in rates.items()}

    report = {
        "model": args.model,
        "rows": args.rows,
        "runs": args.runs,
        "cpus": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "in_process_rows_per_s": [round(r, 1) for r in local],
        "in_process_median": round(statistics.median(local), 1),
        "endpoint": {
            str(c): {"rows_per_s": [round(r, 1) for r in rates], "median": round(statistics.median(rates), 1)}
            for c, rates in remote.items()
        },
    }
    print(f"{args.rows} sentiment prompts, {args.model}, median of {args.runs} runs (load average {load:.1f} at start)")
    print(
        f"  in-process vLLM               {report['in_process_median']:8.1f} rows/s   {report['in_process_rows_per_s']}"
    )
    for concurrency, values in report["endpoint"].items():
        print(f"  endpoint, {concurrency:>3} in flight      {values['median']:8.1f} rows/s   {values['rows_per_s']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
