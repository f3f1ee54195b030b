"""A `batch_api` task over `batch-assets serve` vs the same task on the in-process engine, whole processes.

    .venv/bin/python bench/bench_batch_api.py --rows 3000 [--model PATH]

The shipped `sentiment` task (with its confidence: `batch-assets serve` answers `logprobs`)
on N posts, each side in a fresh DAGSTER_HOME and data folder (no result cache):
(a) `batch-assets run sentiment posts.jsonl` on the in-process vLLM engine; (b) a fresh
`batch-assets serve` on the same model, then the same task with `engine.kind: batch_api` pointed at
it (`poll_seconds` 1): upload, batch, poll, download, match. (b) is timed from the server's launch to
the run's end (`serve_wall_s`); the run alone is `batch_api_run_s`. Prints both, the ratio (b)/(a)
and how many labels differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import launched_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "batch_assets.cli"]


def task_dir(work: Path, engine: str) -> Path:
    text = (REPO / "batch_assets" / "tasks" / "sentiment.yaml").read_text(encoding="utf-8")
    text = text.replace("engine:\n", engine, 1)
    folder = work / "tasks"
    folder.mkdir(parents=True)
    (folder / "sentiment.yaml").write_text(text, encoding="utf-8")
    return folder


def run_task(work: Path, posts: Path, env: dict[str, str]) -> tuple[float, pl.DataFrame]:
    env = {**env, "BATCH_ASSETS_DATA": str(work / "data"), "DAGSTER_HOME": str(work / "home")}
    started = time.perf_counter()
    with (work / "run.log").open("w") as log:
        code = subprocess.run(
            [*CLI, "run", "sentiment", posts.name], cwd=posts.parent, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    wall = time.perf_counter() - started
    if code.returncode:
        sys.exit(f"batch-assets run failed:\n{(work / 'run.log').read_text()[-3000:]}")
    return wall, pl.read_parquet(work / "data" / "storage" / "sentiment" / "validated_labels" / f"{posts.name}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--model", help="model path (default: the embedded model)")
    args = parser.parse_args()
    if args.model is None:
        from batch_assets.engines.embedded_model import ensure_embedded_model

        args.model = str(ensure_embedded_model())
    with tempfile.TemporaryDirectory(prefix="bench-batch-api-") as tmp:
        root = Path(tmp)
        posts = root / "posts.jsonl"
        posts.write_text(
            "".join(json.dumps({"id": f"p{i}", "text": f"post {i}: the parcel came after {i % 9} days"}) + "\n"
                    for i in range(args.rows)),
            encoding="utf-8",
        )  # fmt: skip
        base = {k: v for k, v in os.environ.items() if k != "BATCH_ASSETS_MODEL"}
        local = root / "in-process"
        tasks = task_dir(local, "engine:\n")
        local_wall, local_labels = run_task(local, posts, {**base, "BATCH_ASSETS_TASKS_DIR": str(tasks),
                                                           "BATCH_ASSETS_MODEL": args.model})  # fmt: skip
        remote = root / "over-serve"
        remote.mkdir()
        serve_env = {**base, "BATCH_ASSETS_MODEL": args.model, "DAGSTER_HOME": str(remote / "serve-home"),
                     "BATCH_ASSETS_DATA": str(remote / "serve-data")}  # fmt: skip
        started = time.perf_counter()
        with launched_server(serve_env, remote) as (_, base_url):
            engine = (
                f"engine:\n  kind: batch_api\n  base_url: {base_url}\n  model: {args.model}\n"
                f"  tokenizer: {args.model}\n  poll_seconds: 1\n"
            )
            tasks = task_dir(remote, engine)
            run_wall, remote_labels = run_task(remote, posts, {**base, "BATCH_ASSETS_TASKS_DIR": str(tasks)})
            serve_wall = time.perf_counter() - started
    differing = sum(a != b for a, b in zip(local_labels["label"], remote_labels["label"], strict=True))
    print(json.dumps({
        "rows": args.rows,
        "in_process_wall_s": round(local_wall, 1),
        "serve_wall_s": round(serve_wall, 1),
        "batch_api_run_s": round(run_wall, 1),
        "ratio": round(serve_wall / local_wall, 3),
        "errors": [local_labels["error"].drop_nulls().len(), remote_labels["error"].drop_nulls().len()],
        "labels_differing": differing,
    }))  # fmt: skip


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
