"""The image baseline users write by hand: read the JSONL file, open each image with Pillow, one
`LLM.chat` call with the images as content parts, in input order; write parquet.

    .venv/bin/python bench/plain_vlm_script.py IMAGES.jsonl OUT.parquet --task images

Same engine settings, prompts and structured outputs as the task (tasks from BATCH_ASSETS_TASKS_DIR
when set; the model of BATCH_ASSETS_MODEL when set). Each record's `input.image_fields` are paths
relative to the file; the task's template is filled with its text fields. Prints one JSON line
with timings. The image test's reference answers (batch_assets_tests/test_image_tasks.py) and the
benchmark (bench/bench_images.py) both come from this script.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    started = time.perf_counter()
    import polars as pl
    from PIL import Image
    from vllm import LLM

    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_requests import sampling_params_for
    from batch_assets.pipeline.task_spec import load_task_specs

    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--task", default="images")
    args = parser.parse_args()
    task = {t.name: t for t in load_task_specs()}[args.task]
    settings = VLLMEngine().settings(task)
    frame = pl.read_ndjson(args.source, infer_schema_length=None)
    folder = Path(args.source).parent

    def image(path: str) -> Image.Image:
        with Image.open(folder / path) as opened:
            return opened.convert("RGB")

    messages = []
    for row in frame.iter_rows(named=True):
        text = task.prompt.template.format(**{field: row[field] for field in task.input.text_fields})
        parts = [{"type": "image_pil", "image_pil": image(row[field])} for field in task.input.image_fields]
        system = [{"role": "system", "content": task.prompt.system}] if task.prompt.system else []
        messages.append([*system, {"role": "user", "content": [*parts, {"type": "text", "text": text}]}])
    # The same engine arguments batch_assets passes (on a CPU: no chunked prefill, a fixed KV cache).
    engine_args = settings.engine_args()
    engine_args.pop("disable_log_stats", None)  # LLM's own default is the same
    llm = LLM(**engine_args)
    engine_ready = time.perf_counter()
    outputs = llm.chat(messages, sampling_params_for(task.sampling, task.output), use_tqdm=False)
    chat_seconds = time.perf_counter() - engine_ready
    texts = [o.outputs[0].text for o in outputs]
    frame.with_columns(pl.Series("label", texts)).write_parquet(args.target)
    print(
        json.dumps(
            {
                "rows": frame.height,
                "chat_seconds": chat_seconds,
                "engine_start_seconds": engine_ready - started,
                "wall_seconds": time.perf_counter() - started,
            }
        ),
        flush=True,
    )
    del llm


if __name__ == "__main__":
    main()
