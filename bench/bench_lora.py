"""Rows per second with a LoRA adapter vs without, through `batch-assets run`, on the tests' tiny model.

    flock -x /work/heavy.lock .venv/bin/python bench/bench_lora.py --rows 5000 --pairs 3

Two tasks that differ only in `engine.lora`: `with_lora` (a rank-8 tiny adapter from
batch_assets_tests/tiny_model.py, engine `max_lora_rank` 16) and `base`. Each pair runs both, in
turn (which goes first alternates), as new `batch-assets run` processes in fresh DAGSTER_HOME and data
folders (no cache). Rows/s is the inference asset's rows over its `inference_seconds` (tokenization,
engine calls, checkpoint writes; not the engine start, reported beside it). Free text, 8 tokens,
temperature 0. The ratio is taken pair by pair; medians of pairs are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE.parent))


def task_yaml(name: str, model: str, adapter: Path | None) -> str:
    lora = f"  lora: {{path: {adapter}}}\n" if adapter else ""
    return (
        f"name: {name}\ninput: {{text_fields: [text]}}\n"
        'prompt: {system: Answer in a few words., template: "Post: {text}"}\n'
        f"engine:\n  model: {model}\n  kv_cache_memory_gib: 1.0\n{lora}"
        "output: {kind: text}\nsampling: {max_tokens: 8, temperature: 0.0}\n"
    )


def rows_file(path: Path, rows: int) -> Path:
    words = ["late", "broken", "great", "refund", "thanks", "lost", "cold", "fast", "rude", "fine"]
    with path.open("w") as out:
        for i in range(rows):
            out.write(json.dumps({"id": i, "text": f"order {i}: {words[i % 10]} {words[(i * 7) % 10]} {i % 101}"}))
            out.write("\n")
    return path


def run_task(task: str, source: Path, work: Path, tasks_dir: Path) -> dict:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    work.mkdir(parents=True)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(work / "home"),
        "BATCH_ASSETS_DATA": str(work / "data"),
        "BATCH_ASSETS_TASKS_DIR": str(tasks_dir),
    }
    env.pop("BATCH_ASSETS_MODEL", None)
    started = time.monotonic()
    done = subprocess.run(
        [str(VENV_BIN / "batch-assets"), "run", task, str(source)], env=env, cwd=work, capture_output=True, text=True
    )
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"batch-assets run {task} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(work / "home"))) as instance:
        record = instance.fetch_materializations(dg.AssetKey([task, "inference_outputs"]), limit=1).records[0]
        metadata = {key: value.value for key, value in record.asset_materialization.metadata.items()}
    return {
        "rows_per_s": metadata["rows"] / metadata["inference_seconds"],
        "engine_start_s": metadata.get("engine_start_seconds"),
        "wall_s": wall,
    }


def main() -> None:
    from batch_assets_tests.tiny_model import build_tiny_adapter, built_tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--keep", help="work in this folder and keep it (logs of a failed run)")
    args = parser.parse_args()
    model = str(built_tiny_model())
    with tempfile.TemporaryDirectory() if args.keep is None else contextlib.nullcontext(args.keep) as tmp:
        root = Path(tmp)
        adapter = build_tiny_adapter(root / "adapter", model, seed=1, rank=8)
        tasks = root / "tasks"
        tasks.mkdir()
        (tasks / "with_lora.yaml").write_text(task_yaml("with_lora", model, adapter))
        (tasks / "base.yaml").write_text(task_yaml("base", model, None))
        source = rows_file(root / "posts.jsonl", args.rows)
        pairs = []
        for pair in range(args.pairs):
            order = ["with_lora", "base"] if pair % 2 == 0 else ["base", "with_lora"]
            result = {task: run_task(task, source, root / f"{pair}-{task}", tasks) for task in order}
            result["ratio"] = result["with_lora"]["rows_per_s"] / result["base"]["rows_per_s"]
            print(json.dumps({"pair": pair, **result}), flush=True)
            pairs.append(result)

        def median(task: str, key: str) -> float:
            return statistics.median(p[task][key] for p in pairs if p[task][key] is not None)

        print(
            f"rows {args.rows}, pairs {args.pairs}: rows/s with adapter {median('with_lora', 'rows_per_s'):.0f}, "
            f"without {median('base', 'rows_per_s'):.0f}, ratio (median of pairs) "
            f"{statistics.median(p['ratio'] for p in pairs):.3f}; wall s {median('with_lora', 'wall_s'):.1f} vs "
            f"{median('base', 'wall_s'):.1f}"
        )


if __name__ == "__main__":
    main()
