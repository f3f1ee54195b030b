"""Plain `LLM.embed` vs `batch-assets run embeddings`, whole processes, on the same texts; and the
similarity labelling of those texts (`batch-assets run industry_similarity`).

    .venv/bin/python bench/bench_embeddings.py --rows 20000 --runs 3                    # distinct texts
    .venv/bin/python bench/bench_embeddings.py --rows 20000 --runs 3 --repeat-share 0.3 # 30 % repeats
    .venv/bin/python bench/bench_embeddings.py --rows 200 --runs 1                      # a smoke run

Each run alternates (a) bench/plain_embed_script.py (vLLM's offline `LLM.embed`, vectors written to
parquet) and (b) `batch-assets run embeddings FILE` in a fresh DAGSTER_HOME and data folder (no result
cache from earlier runs), then (c) `batch-assets run industry_similarity` on the same texts as a CSV
(column `Company`) in another fresh folder. All are new processes, wall time measured from outside,
so engine start-up and Dagster's own cost are in. Target: (b) ≥ 0.95 × (a) in rows/s with distinct
texts, and faster than (a) with repeats (a repeated text is embedded once). Medians over the runs.

Texts are generated: short sentences from word lists, distinct by construction; with
`--repeat-share S` that share of rows repeats an earlier row's text (spread through the file).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
SUBJECTS = [
    "The harbor ferry",
    "Our bakery",
    "The city library",
    "My router",
    "The new firmware",
    "This jacket",
    "The quarterly report",
    "A local clinic",
    "The software team",
    "Their law office",
    "The warehouse",
    "A small bank",
    "The property manager",
    "The support desk",
    "This cafe",
]
VERBS = ["opens", "closes", "fails", "improves", "arrives", "changes", "grows", "drops", "returns", "expands"]
OBJECTS = [
    "every morning",
    "after the update",
    "on public holidays",
    "without notice",
    "for the new season",
    "in the old town",
    "before the deadline",
    "during the storm",
    "by twelve percent",
    "at the harbor",
]


def texts(rows: int, repeat_share: float, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    distinct = round(rows * (1 - repeat_share))
    made = [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} (note {i}, ref {rng.randrange(10**6):06d})."
        for i in range(distinct)
    ]
    out = list(made)
    for _ in range(rows - distinct):
        out.insert(rng.randrange(len(out) + 1), rng.choice(made))
    return out


def run_timed(command: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    return done, time.perf_counter() - started


def plain(jsonl: Path, work: Path) -> dict:
    done, wall = run_timed(
        [sys.executable, str(HERE / "plain_embed_script.py"), str(jsonl), str(work / "plain.parquet")]
    )
    if done.returncode != 0:
        raise SystemExit(f"plain script failed:\n{(done.stdout + done.stderr)[-4000:]}")
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    return {"wall": wall, "engine_rows_per_s": result["rows"] / result["embed_seconds"]}


def pipeline(task: str, path: Path, work: Path) -> dict:
    env = {**os.environ, "DAGSTER_HOME": str(work / "home"), "BATCH_ASSETS_DATA": str(work / "data")}
    done, wall = run_timed([str(VENV_BIN / "batch-assets"), "run", task, str(path)], env=env, cwd=work)
    if done.returncode != 0:
        raise SystemExit(
            f"batch-assets run {task} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}"
        )
    metadata = inference_metadata(work / "home", task)
    return {
        "wall": wall,
        "engine_rows_per_s": metadata["rows"] / max(metadata["engine_seconds"], 1e-9),
        "rows_inferred": metadata["rows_inferred"],
        "rows_deduplicated": metadata["rows_deduplicated"],
    }


def inference_metadata(home: Path, task: str) -> dict:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        record = instance.fetch_materializations(dg.AssetKey([task, "inference_outputs"]), limit=1).records[0]
        return {key: value.value for key, value in record.asset_materialization.metadata.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat-share", type=float, default=0.0)
    parser.add_argument("--no-similarity", action="store_true", help="skip the similarity labelling run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = texts(args.rows, args.repeat_share)
        jsonl = Path(tmp) / f"texts-{args.rows}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows), encoding="utf-8")
        companies = Path(tmp) / f"companies-{args.rows}.csv"
        with companies.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["Company"])
            writer.writerows([text] for text in rows)
        results: dict[str, list[dict]] = {"plain LLM.embed": [], "batch-assets embeddings": [], "similarity labels": []}
        for index in range(args.runs):
            steps = [
                ("plain LLM.embed", lambda work: plain(jsonl, work)),
                ("batch-assets embeddings", lambda work: pipeline("embeddings", jsonl, work)),
            ]
            if not args.no_similarity:
                steps.append(("similarity labels", lambda work: pipeline("industry_similarity", companies, work)))
            for name, step in steps:
                work = Path(tmp) / f"{name.replace(' ', '_')}-{index}"
                work.mkdir()
                results[name].append(step(work))
                shown = {k: round(v, 2) for k, v in results[name][-1].items()}
                print(f"run {index + 1} {name}: {json.dumps(shown)}", flush=True)

        def med(name: str, key: str) -> float:
            return statistics.median(r[key] for r in results[name])

        print(f"\nrows {args.rows}, repeat share {args.repeat_share}, {args.runs} runs, medians (whole processes):")
        for name in results:
            if results[name]:
                print(
                    f"  {name:24s}: wall {med(name, 'wall'):7.1f} s  {args.rows / med(name, 'wall'):7.1f} rows/s  "
                    f"(engine phase {med(name, 'engine_rows_per_s'):7.1f} rows/s)"
                )
        ratio = med("plain LLM.embed", "wall") / med("batch-assets embeddings", "wall")
        print(f"  batch-assets / plain rows/s: {ratio:.3f} (target >= 0.95 distinct; > 1 with repeats)")


if __name__ == "__main__":
    main()
