"""The baseline users write by hand: read the file, one `LLM.chat` call, write parquet.

    .venv/bin/python bench/plain_vllm_script.py CUSTOMERS.csv OUT.parquet

Same engine settings and structured outputs as the `industry` task (embedded model unless
BATCH_ASSETS_MODEL is set). Prints one JSON line with timings.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    started = time.perf_counter()
    import polars as pl
    from vllm import LLM

    from batch_assets.engines.vllm_engine import VLLMEngine, sampling_params_for
    from batch_assets.pipeline.task_spec import load_task_specs

    source, target = sys.argv[1], sys.argv[2]
    task = {t.name: t for t in load_task_specs()}["industry"]
    settings = VLLMEngine().settings(task)
    frame = pl.read_csv(source, infer_schema=False)
    messages = [
        [{"role": "system", "content": task.prompt.system}, {"role": "user", "content": task.prompt.template.format(Company=c)}]
        for c in frame["Company"].to_list()
    ]
    # The same engine arguments batch_assets passes (on a CPU: no chunked prefill, a fixed KV cache).
    engine_args = settings.engine_args()
    engine_args.pop("disable_log_stats", None)  # LLM's own default is the same
    llm = LLM(**engine_args)
    engine_ready = time.perf_counter()
    outputs = llm.chat(messages, sampling_params_for(task.sampling, task.output), use_tqdm=False)
    chat_seconds = time.perf_counter() - engine_ready
    texts = [o.outputs[0].text for o in outputs]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    frame.with_columns(pl.Series("label", texts)).write_parquet(target)
    total = time.perf_counter() - started
    print(json.dumps({"rows": frame.height, "chat_seconds": chat_seconds, "generated_tokens": generated,
                      "engine_start_seconds": engine_ready - started, "wall_seconds": total}), flush=True)
    del llm


if __name__ == "__main__":
    main()
