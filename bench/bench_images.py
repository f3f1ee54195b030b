"""Plain vLLM script vs `batch-assets run` on the same pictures, side by side (the `images` task).

    flock -x /work/heavy.lock .venv/bin/python bench/bench_images.py --images 1000 --runs 3

The tiny random-weight vision-language model (batch_assets_tests/tiny_vlm.py: Idefics3, 4 image
tokens a picture) on both sides, the task in examples/tasks/images.yaml. Each pair runs (a)
bench/plain_vlm_script.py on a JSONL file naming PNG and JPEG files next to it (Pillow opens each,
one `LLM.chat` call) and (b) `batch-assets run images` on a parquet file holding the same pictures'
bytes (`batch-assets run` copies the named file into the drop zone; the parquet file carries its
pictures with it), each in a fresh process, DAGSTER_HOME and data folder. Wall seconds from outside
(engine start included on both sides); rows/s = pictures / wall. Medians of the pairs, and the
ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VENV_BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))


def timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[1]} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return wall, done.stdout


def main() -> None:
    import polars as pl

    from batch_assets_tests.tiny_vlm import built_tiny_vlm, write_test_images

    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model = built_tiny_vlm()
    work = Path(tempfile.mkdtemp(prefix="bench-images-"))
    names = write_test_images(work / "photos", args.images)
    source = work / "pictures.jsonl"
    source.write_text("".join(json.dumps({"image": f"photos/{name}"}) + "\n" for name in names))
    parquet = work / "pictures.parquet"
    pl.DataFrame(
        {"image": [(work / "photos" / name).read_bytes() for name in names]}, schema={"image": pl.Binary}
    ).write_parquet(parquet)
    base = {**os.environ, "BATCH_ASSETS_MODEL": str(model), "BATCH_ASSETS_TASKS_DIR": str(REPO / "examples" / "tasks")}
    base["VLLM_LOGGING_LEVEL"] = "WARNING"
    plain_walls, pipeline_walls = [], []
    for run in range(args.runs):
        plain_wall, out = timed(
            [sys.executable, str(HERE / "plain_vlm_script.py"), str(source), str(work / f"plain-{run}.parquet")],
            base,
            work,
        )
        chat = next(json.loads(line) for line in out.splitlines() if line.startswith("{"))["chat_seconds"]
        home, data = work / f"home-{run}", work / f"data-{run}"
        home.mkdir()
        env = {**base, "DAGSTER_HOME": str(home), "BATCH_ASSETS_DATA": str(data)}
        pipeline_wall, _ = timed([str(VENV_BIN / "batch-assets"), "run", "images", str(parquet)], env, work)
        labels = pl.read_parquet(data / "storage" / "images" / "validated_labels" / "pictures.parquet.parquet")
        plain = pl.read_parquet(work / f"plain-{run}.parquet")
        same = labels.sort("row_id")["label"].to_list() == plain["label"].to_list()
        plain_walls.append(plain_wall)
        pipeline_walls.append(pipeline_wall)
        print(
            f"pair {run + 1}: plain {plain_wall:.1f} s (LLM.chat {chat:.1f} s), batch-assets run "
            f"{pipeline_wall:.1f} s, pipeline/plain rows/s {plain_wall / pipeline_wall:.3f}, labels equal: {same}",
            flush=True,
        )
    plain_median, pipeline_median = statistics.median(plain_walls), statistics.median(pipeline_walls)
    print(
        f"{args.images} pictures, medians of {args.runs} pairs: plain {plain_median:.1f} s "
        f"({args.images / plain_median:.1f} rows/s), batch-assets run {pipeline_median:.1f} s "
        f"({args.images / pipeline_median:.1f} rows/s); "
        f"pipeline/plain rows/s ratio {plain_median / pipeline_median:.3f} (median of the pairs' ratios "
        f"{statistics.median(p / q for p, q in zip(plain_walls, pipeline_walls, strict=True)):.3f})"
    )


if __name__ == "__main__":
    main()
