"""The baseline users write by hand: read the file, one `LLM.chat` call in input order, write parquet.

    .venv/bin/python bench/plain_vllm_script.py CUSTOMERS.csv OUT.parquet [--task industry] [--base-too]

Same engine settings, prompts and structured outputs as the task (`industry` unless --task; tasks
from BATCH_ASSETS_TASKS_DIR when set; embedded model unless BATCH_ASSETS_MODEL is set). Reads CSV or
JSONL; the task's template is filled with each row's fields. Prints one JSON line with timings.
A task with `engine.lora` sends its adapter with every request as vLLM's `LoRARequest` (the one the
pipeline sends); `--base-too` also writes the same engine's answers without it (`base_label`).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    started = time.perf_counter()
    import polars as pl
    from vllm import LLM

    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_requests import sampling_params_for
    from batch_assets.pipeline.task_spec import load_task_specs

    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--task", default="industry")
    parser.add_argument(
        "--logprobs", action="store_true", help="ask for the sampled token's log-probability (as a confidence does)"
    )
    parser.add_argument("--base-too", action="store_true", help="also answer without the task's adapter")
    args = parser.parse_args()
    task = {t.name: t for t in load_task_specs()}[args.task]
    settings = VLLMEngine().settings(task)
    frame = (
        pl.read_ndjson(args.source) if args.source.endswith(".jsonl") else pl.read_csv(args.source, infer_schema=False)
    )
    fields = task.input.text_fields
    messages = [
        [
            {"role": "system", "content": task.prompt.system},
            {"role": "user", "content": task.prompt.template.format(**{field: row[field] for field in fields})},
        ]
        for row in frame.select(fields).iter_rows(named=True)
    ]
    # The same engine arguments batch_assets passes (on a CPU: no chunked prefill, a fixed KV cache).
    engine_args = settings.engine_args()
    engine_args.pop("disable_log_stats", None)  # LLM's own default is the same
    llm = LLM(**engine_args)
    engine_ready = time.perf_counter()
    params = sampling_params_for(task.sampling, task.output, logprobs=args.logprobs)
    outputs = llm.chat(messages, params, use_tqdm=False, lora_request=settings.lora_request())
    chat_seconds = time.perf_counter() - engine_ready
    texts = [o.outputs[0].text for o in outputs]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    frame = frame.with_columns(pl.Series("label", texts))
    if args.base_too:
        base = llm.chat(messages, params, use_tqdm=False)
        frame = frame.with_columns(pl.Series("base_label", [o.outputs[0].text for o in base]))
    frame.write_parquet(args.target)
    total = time.perf_counter() - started
    print(
        json.dumps(
            {
                "rows": frame.height,
                "chat_seconds": chat_seconds,
                "generated_tokens": generated,
                "engine_start_seconds": engine_ready - started,
                "wall_seconds": total,
            }
        ),
        flush=True,
    )
    del llm


if __name__ == "__main__":
    main()
