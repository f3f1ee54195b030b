"""Tokenization of the `industry` task per N rows: as before (counted in formatted_prompts, the whole
prompt tokenized again at inference by transformers) and now (once, the template's fixed ids spliced
around each message's own, read back at inference); and what loading the tokenizer costs a fresh
process with transformers and with the `tokenizers` library alone.

    .venv/bin/python bench/bench_tokenize.py --rows 100000

Distinct company names (bench/generate_customers.py). "before" replays the earlier code path here
(count_tokens over the messages, then `tokenizer(prompts)` and `Prompt(tuple(ids))` per engine
chunk); "after" is format_prompts and the task's encoder as the pipeline runs them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
CHUNK = 1024  # prompts per engine request batch, as run_inference asks for them

LOAD = {
    "transformers": "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({folder!r})",
    "tokenizers": "from batch_assets.engines.tokenizers import load_tokenizer; load_tokenizer({folder!r})",
}


def load_seconds(folder: str) -> dict[str, float]:
    """Seconds a fresh interpreter takes to import and load the tokenizer each way."""
    seconds = {}
    for name, code in LOAD.items():
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", code.format(folder=folder)], check=True)
        seconds[name] = round(time.monotonic() - started, 2)
    return seconds


def before(raw, fmt, tokenizer) -> float:
    """The earlier path: counts in formatted_prompts, then every whole prompt tokenized again."""
    from batch_assets.pipeline.engine_contract import Prompt
    from batch_assets.pipeline.format_prompts import count_tokens, prompt_affixes, user_message_expr

    started = time.monotonic()
    prefix, suffix = prompt_affixes(fmt, tokenizer) or ("", "")
    messages = raw.select(user_message_expr(fmt.template).alias("m"))["m"].to_list()
    count_tokens(tokenizer, [prefix, suffix])
    count_tokens(tokenizer, messages)
    prompts = sorted(prefix + message + suffix for message in messages)
    for start in range(0, len(prompts), CHUNK):
        ids = tokenizer(prompts[start : start + CHUNK], add_special_tokens=False)["input_ids"]
        [Prompt(tuple(row)) for row in ids]
    return time.monotonic() - started


def after(raw, fmt, tokenizer) -> tuple[float, list[str]]:
    """Now: ids made once in format_prompts, read back by the encoder the engine is fed from."""
    from batch_assets.pipeline.format_prompts import format_prompts, prompt_encoders

    notes: list[str] = []
    started = time.monotonic()
    formatted = format_prompts(
        raw, fmt, tokenizer, max_model_len=2048, max_tokens=8, source_file="bench.csv", log=notes.append
    )
    encode = prompt_encoders(SimpleNamespace(sends_chat_messages=False), fmt, tokenizer)(formatted)
    prompts = sorted(formatted["prompt"].drop_nulls().to_list())
    for start in range(0, len(prompts), CHUNK):
        encode(prompts[start : start + CHUNK])
    return time.monotonic() - started, notes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from batch_assets.engines.embedded_model import ensure_embedded_model
    from batch_assets.engines.tokenizers import load_tokenizer
    from batch_assets.pipeline.format_prompts import PromptFormat
    from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
    from batch_assets.pipeline.task_spec import load_task_specs

    folder = str(ensure_embedded_model())
    task = {t.name: t for t in load_task_specs()}["industry"]
    with tempfile.TemporaryDirectory() as work:
        csv = Path(work) / "customers.csv"
        subprocess.run([sys.executable, str(HERE / "generate_customers.py"), str(args.rows), str(csv)], check=True)
        options = ParseOptions(text_fields=tuple(task.input.text_fields), format=task.input.format)
        raw = read_prompts(csv.read_bytes(), csv.name, options)
    fmt = PromptFormat.of(task)
    old_seconds = before(raw, fmt, AutoTokenizer.from_pretrained(folder))
    new_seconds, notes = after(raw, fmt, load_tokenizer(folder))
    per_100k = 100_000 / args.rows
    print(f"rows: {args.rows}; {notes[0]}")
    print(f"tokenization before: {old_seconds:.2f} s ({old_seconds * per_100k:.2f} s per 100k rows)")
    print(f"tokenization after:  {new_seconds:.2f} s ({new_seconds * per_100k:.2f} s per 100k rows)")
    print(f"tokenizer load in a fresh process (import included): {load_seconds(folder)}")


if __name__ == "__main__":
    main()
