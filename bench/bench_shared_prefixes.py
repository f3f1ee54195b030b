"""Shared prefixes: plain vLLM in input order vs `batch-assets run` on documents with several questions each.

    .venv/bin/python bench/bench_shared_prefixes.py --documents 100 --questions 5 --kv-gib 0.5 --runs 3

A JSONL file of `--documents` invented documents of about `--doc-tokens` tokens, each asked
`--questions` questions, rows shuffled (as an export would list them), run by the `document_qa` task.
Both sides get the same engine settings, with `engine.kv_cache_memory_gib: --kv-gib` chosen so the
documents do not all fit in vLLM's KV cache (the script prints how many do): (a)
bench/plain_vllm_script.py, one `LLM.chat` in input order, and (b) `batch-assets run document_qa`,
which sends deterministic requests in shared-prefix order. Each side is a new process in a fresh
DAGSTER_HOME and data folder (no result cache), wall time measured from outside; pairs alternate.
Prints medians and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
TASK = "document_qa"

SUBJECTS = ["The committee", "The harbor office", "A local farmer", "The night train", "The museum", "Our neighbour"]
VERBS = ["reported", "repaired", "painted", "measured", "sold", "described", "moved", "opened", "counted"]
OBJECTS = ["the old bridge", "forty crates of apples", "a blue fishing boat", "the school roof", "three clocks"]
TAILS = ["before the storm", "on a Tuesday", "for the winter fair", "after a long delay", "without telling anyone"]
QUESTIONS = ["Who is mentioned first?", "What was repaired?", "When did it happen?", "What was sold?", "Why?"]


def document(rng: random.Random, tokens: int, count_tokens) -> str:
    sentences: list[str] = []
    while count_tokens(" ".join(sentences)) < tokens:
        sentences.append(
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}, "
            f"number {rng.randrange(10_000)}."
        )
    return " ".join(sentences)


def write_rows(path: Path, documents: int, questions: int, doc_tokens: int) -> float:
    """The shuffled file; returns the mean document length in tokens."""
    from transformers import AutoTokenizer

    from batch_assets.engines.embedded_model import ensure_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(0)
    texts = [f"Document {i}. " + document(rng, doc_tokens, count) for i in range(documents)]
    rows = [{"document": text, "question": QUESTIONS[q % len(QUESTIONS)]} for text in texts for q in range(questions)]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return statistics.mean(count(text) for text in texts)


def tasks_with_kv_cache(folder: Path, kv_gib: float) -> Path:
    import yaml

    from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR

    shutil.copytree(BUNDLED_TASKS_DIR, folder)
    path = folder / f"{TASK}.yaml"
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    spec["engine"]["kv_cache_memory_gib"] = kv_gib
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return folder


def kv_tokens(kv_gib: float, tasks_dir: Path) -> int:
    """Tokens the KV cache holds: bytes / (2 × layers × KV heads × head dim × bytes per value)."""
    from transformers import AutoConfig

    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.pipeline.task_spec import load_task_specs

    os.environ["BATCH_ASSETS_TASKS_DIR"] = str(tasks_dir)
    task = {t.name: t for t in load_task_specs()}[TASK]
    settings = VLLMEngine().settings(task)
    config = AutoConfig.from_pretrained(settings.model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = str(settings.vllm_args.get("dtype"))
    if dtype == "auto":  # the model's own dtype
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "bfloat16"))
    value_bytes = 4 if dtype.removeprefix("torch.") in ("float32", "float") else 2
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * value_bytes
    return int(kv_gib * (1 << 30) // per_token)


def plain(rows: Path, work: Path, env: dict[str, str]) -> dict:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(HERE / "plain_vllm_script.py"), str(rows), str(work / "plain.parquet"), "--task", TASK],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"plain script failed:\n{(out.stdout + out.stderr)[-4000:]}")
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    return {"wall": time.perf_counter() - started, "engine": result["chat_seconds"]}


def pipeline(rows: Path, work: Path, env: dict[str, str]) -> dict:
    env = {**env, "DAGSTER_HOME": str(work / "home"), "BATCH_ASSETS_DATA": str(work / "data")}
    started = time.perf_counter()
    done = subprocess.run(
        [str(VENV_BIN / "batch-assets"), "run", TASK, str(rows)], env=env, cwd=work, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"batch-assets run failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    wall = time.perf_counter() - started
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(work / "home"))) as instance:
        record = instance.fetch_materializations(dg.AssetKey([TASK, "inference_outputs"]), limit=1).records[0]
        metadata = {key: value.value for key, value in record.asset_materialization.metadata.items()}
    return {"wall": wall, "engine": metadata["engine_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=800)
    parser.add_argument("--kv-gib", type=float, default=0.5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "questions.jsonl"
        mean_tokens = write_rows(rows, args.documents, args.questions, args.doc_tokens)
        tasks_dir = tasks_with_kv_cache(Path(tmp) / "tasks", args.kv_gib)
        capacity = kv_tokens(args.kv_gib, tasks_dir)
        print(
            f"{args.documents} documents of {mean_tokens:.0f} tokens on average x {args.questions} questions, "
            "shuffled; "
            f"KV cache {args.kv_gib} GiB holds ~{capacity} tokens, ~{capacity / mean_tokens:.0f} documents",
            flush=True,
        )
        env = {**os.environ, "BATCH_ASSETS_TASKS_DIR": str(tasks_dir)}
        plains, pipes = [], []
        for index in range(args.runs):
            for kind, bucket in (("plain", plains), ("pipeline", pipes)):
                work = Path(tmp) / f"{kind}-{index}"
                work.mkdir()
                bucket.append(plain(rows, work, env) if kind == "plain" else pipeline(rows, work, env))
                print(
                    f"run {index + 1} {kind}: {json.dumps({k: round(v, 1) for k, v in bucket[-1].items()})}", flush=True
                )

    def med(results: list[dict], key: str) -> float:
        return statistics.median(result[key] for result in results)

    n = args.documents * args.questions
    print(f"\n{n} rows, medians of {args.runs}:")
    for name, results in (("plain vLLM, input order", plains), ("batch-assets run", pipes)):
        print(
            f"  {name:24}: wall {med(results, 'wall'):6.1f} s, engine {med(results, 'engine'):6.1f} s "
            f"({n / med(results, 'engine'):.1f} rows/s)"
        )
    print(
        f"  pipeline / plain        : wall {med(pipes, 'wall') / med(plains, 'wall'):.3f}, "
        f"engine {med(pipes, 'engine') / med(plains, 'engine'):.3f}"
    )


if __name__ == "__main__":
    main()
