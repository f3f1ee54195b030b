"""The pipeline's own ceiling: `batch-assets run`'s work with an engine that costs nothing, beside the plain floor.

    .venv/bin/python bench/bench_pipeline_ceiling.py                       # 20,000 and 100,000 rows, 3 runs each
    .venv/bin/python bench/bench_pipeline_ceiling.py --rows 2000 --runs 1  # a quick look
    .venv/bin/python bench/bench_pipeline_ceiling.py --profile py-spy      # every thread (pip install -e '.[bench]')

A pipeline run is a new process, as `batch-assets run industry FILE` is, with a new data folder and
a copy of a Dagster home whose storages exist (as a user's does after the first run): it builds
the definitions with the zero-cost engine (bench/zero_cost_engine.py) as the `llm_engine` resource
and runs the file through `app/runner.run_partitions`, the function behind `batch-assets run`.
The file is `bench/generate_customers.py`'s, every `Company` distinct. Reported, medians of
`--runs` (runs of each size alternate with the plain floor's, so a busy machine slows both alike):

- step rows/s: rows / the `inference_outputs` step's duration (Dagster's step start to success:
  planning, result cache lookup, tokenization, the stream, checkpoints, cache writes, the join);
- stream rows/s: rows / the step's `inference_seconds` (first request to last result);
- whole rows/s: rows / the process's wall time, from its start to its exit;
- fixed cost: the wall time of a 100-row run (imports, definitions, instance, the tokenizer's load,
  Dagster's run and step overhead), and the intercept of wall time against rows between the two sizes;
- the plain floor, a new process too: read the CSV (polars), tokenize only what differs (the chat
  template's prefix and suffix once, each row's own text with `tokenizers`), write the ids and the
  answer to parquet; no Dagster, no checkpoints, no cache.

Then one more pipeline run at the first size under a profiler: `cprofile` (the main thread, where the
in-process executor runs every step; own time and batch_assets functions' cumulative time) or
`py-spy` (every thread). Everything printed also goes to `--out` (default bench/results/pipeline_ceiling.txt).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TASK = "industry"
FIXED_COST_ROWS = 100
T0_ENV = "BENCH_CEILING_T0"  # the parent's clock when it started the child process


# --- the child processes -------------------------------------------------------------------------


def child_pipeline(csv_path: Path, profile_to: Path | None) -> None:
    """One `batch-assets run`'s work with the zero-cost engine; prints a JSON line of its own timings."""
    started = float(os.environ[T0_ENV])
    sys.path.insert(0, str(HERE))
    from zero_cost_engine import ZeroCostEngine

    from batch_assets.app.runner import run_partitions
    from batch_assets.lib.task_definitions import build_definitions
    from batch_assets.runtime.process_exit import exit_without_teardown

    imported = time.time()
    profiler = cProfile.Profile() if profile_to else None
    if profiler:
        profiler.enable()
    outcomes = run_partitions(TASK, [csv_path], definitions=build_definitions(engine=ZeroCostEngine()))
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile_to)
    done = time.time()
    ok = all(outcome.ok for outcome in outcomes)
    print(json.dumps({"ok": ok, "imports_s": imported - started, "run_s": done - imported}), flush=True)
    sys.exit(exit_without_teardown(0 if ok else 1))


def child_plain(csv_path: Path, out_path: Path, model: str) -> None:
    """The plain floor: read, tokenize only what differs, write parquet. Prints a JSON line."""
    import jinja2
    import numpy as np
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from batch_assets.pipeline.task_spec import load_task_spec

    started = float(os.environ[T0_ENV])
    work_started = time.time()
    task = load_task_spec(REPO / "batch_assets" / "tasks" / f"{TASK}.yaml")
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    template = jinja2.Template((Path(model) / "chat_template.jinja").read_text(encoding="utf-8"))
    sentinel = "\x00ROW\x00"
    user = task.prompt.template.replace("{Company}", sentinel)
    messages = [{"role": "system", "content": task.prompt.system}, {"role": "user", "content": user}]
    before, _, after = template.render(messages=messages, add_generation_prompt=True).partition(sentinel)
    prefix = tokenizer.encode(before, add_special_tokens=False).ids
    suffix = tokenizer.encode(after, add_special_tokens=False).ids
    frame = pl.read_csv(csv_path, infer_schema=False)
    encodings = tokenizer.encode_batch_fast(frame["Company"].to_list(), add_special_tokens=False)
    own = [encoding.ids for encoding in encodings]
    lengths = np.fromiter((len(ids) for ids in own), dtype=np.int64, count=len(own)) + len(prefix) + len(suffix)
    flat = np.concatenate([np.concatenate([prefix, ids, suffix]) for ids in own]).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.Table.from_arrays(
        [
            pa.array(np.arange(frame.height, dtype=np.int64)),
            frame["Company"].to_arrow(),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
            pa.array(lengths),
            pa.array(np.full(frame.height, task.output.choices[0], dtype=object), type=pa.string()),
        ],
        names=["row_id", "Company", "prompt_token_ids", "num_prompt_tokens", "label"],
    )
    pq.write_table(table, out_path)
    done = time.time()
    print(json.dumps({"ok": True, "imports_s": work_started - started, "run_s": done - work_started}), flush=True)


# --- the parent ----------------------------------------------------------------------------------


def spawn(args: list[str], env: dict[str, str], cwd: Path) -> tuple[dict, float]:
    """A child of this script; (its JSON line, wall seconds measured here)."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        env={**env, T0_ENV: repr(started)},
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    wall = time.time() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{args[0]} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(lines[-1]), wall


def fresh_env(work: Path) -> dict[str, str]:
    """A copy of the template home (`make_template_home`) and a new data folder."""
    home = work / "home"
    shutil.copytree(work.parent / TEMPLATE_HOME, home)
    return {**os.environ, "DAGSTER_HOME": str(home), "BATCH_ASSETS_DATA": str(work / "data")}


TEMPLATE_HOME = "template-home"


def make_template_home(folder: Path) -> None:
    """A Dagster home with its storages made, as a user's is after the first run (making them is a
    one-time cost of a new home, not a run's)."""
    home = folder / TEMPLATE_HOME
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    prepare = "from batch_assets.runtime.instance import prepare_instance; prepare_instance()"
    subprocess.run([sys.executable, "-c", prepare], env={**os.environ, "DAGSTER_HOME": str(home)}, check=True)


def step_seconds(home: Path) -> dict[str, float]:
    """Each step's seconds of the (one) run in `home`, by step key."""
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        run = instance.get_runs(limit=1)[0]
        return {
            stats.step_key: stats.end_time - stats.start_time
            for stats in instance.get_run_step_stats(run.run_id)
            if stats.start_time and stats.end_time
        }


def inference_metadata(home: Path) -> dict:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        record = instance.fetch_materializations(dg.AssetKey([TASK, "inference_outputs"]), limit=1).records[0]
        return {key: value.value for key, value in record.asset_materialization.metadata.items()}


def pipeline_run(csv_path: Path, work: Path, rows: int, profile_to: Path | None = None) -> dict:
    env = fresh_env(work)
    args = ["--child-pipeline", str(csv_path)] + (["--profile-to", str(profile_to)] if profile_to else [])
    child, wall = spawn(args, env, work)
    steps = step_seconds(work / "home")
    step = next(seconds for key, seconds in steps.items() if key.endswith("inference_outputs"))
    metadata = inference_metadata(work / "home")
    if metadata["rows"] != rows:
        raise SystemExit(f"the inference step saw {metadata['rows']} rows, not {rows}")
    return {
        "wall_s": wall,
        "whole_rows_per_s": rows / wall,
        "step_s": step,
        "step_rows_per_s": rows / step,
        "stream_rows_per_s": rows / metadata["inference_seconds"],
        "imports_s": child["imports_s"],
        **step_groups(steps),
    }


ASSETS = ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")


def step_groups(steps: dict[str, float]) -> dict[str, float]:
    """Seconds of each asset's step, and of all the checks' steps together."""
    names = {key: key.rsplit("__", 1)[-1] for key in steps}
    groups = {f"step {asset} s": sum(s for k, s in steps.items() if names[k] == asset) for asset in ASSETS}
    return {**groups, "step checks s": sum(s for k, s in steps.items() if names[k] not in ASSETS)}


def plain_run(csv_path: Path, work: Path, rows: int, model: str) -> dict:
    work.mkdir(parents=True)
    child, wall = spawn(["--child-plain", str(csv_path), str(work / "plain.parquet"), model], dict(os.environ), work)
    return {"wall_s": wall, "whole_rows_per_s": rows / wall, "work_rows_per_s": rows / child["run_s"]}


def task_model() -> str:
    """The folder of the model the industry task runs (its tokenizer is what the plain floor uses)."""
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.pipeline.task_spec import load_task_spec

    return VLLMEngine().settings(load_task_spec(REPO / "batch_assets" / "tasks" / f"{TASK}.yaml"), gpus=0).model


class Report:
    """Prints and keeps every line, for the raw output file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def summarize(say: Report, rows: int, pipes: list[dict], plains: list[dict]) -> None:
    def med(results: list[dict], key: str) -> float:
        return statistics.median(result[key] for result in results)

    say(f"\n{rows:,} distinct rows, medians of {len(pipes)}:")
    say(
        f"  pipeline (zero-cost engine): inference step {med(pipes, 'step_rows_per_s'):8,.0f} rows/s "
        f"({med(pipes, 'step_s'):.2f} s; stream alone {med(pipes, 'stream_rows_per_s'):,.0f} rows/s)   "
        f"whole process {med(pipes, 'whole_rows_per_s'):7,.0f} rows/s ({med(pipes, 'wall_s'):.1f} s wall, "
        f"{med(pipes, 'imports_s'):.1f} s of it imports)"
    )
    other_steps = [key for key in pipes[0] if key.startswith("step ")]
    say("  steps (s): " + ", ".join(f"{key[5:-2]} {med(pipes, key):.2f} s" for key in other_steps))
    say(
        f"  plain floor (read, tokenize what differs, write parquet): work {med(plains, 'work_rows_per_s'):8,.0f} "
        f"rows/s   whole process {med(plains, 'whole_rows_per_s'):7,.0f} rows/s ({med(plains, 'wall_s'):.1f} s wall)"
    )
    ratio = med(pipes, "whole_rows_per_s") / med(plains, "whole_rows_per_s")
    say(f"  pipeline / plain floor: whole process {ratio:.3f}")


def show_cprofile(say: Report, path: Path, top: int) -> None:
    for title, key, only_ours in (
        ("own time (tottime)", "tottime", False),
        ("batch_assets functions, cumulative time", "cumulative", True),
    ):
        buffer = io.StringIO()
        stats = pstats.Stats(str(path), stream=buffer)
        stats.sort_stats(key).print_stats(*(["batch_assets/"] if only_ours else []), top)
        say(f"\ncProfile, main thread, {title}:")
        body = buffer.getvalue().splitlines()
        start = next((i for i, line in enumerate(body) if line.lstrip().startswith("ncalls")), 0)
        for line in body[start : start + top + 1]:
            say("  " + line.rstrip())


def show_py_spy(say: Report, csv_path: Path, work: Path, top: int) -> None:
    env = fresh_env(work)
    output = work / "py-spy.txt"
    spy = [str(Path(sys.executable).parent / "py-spy"), "record", "--rate", "200", "--format", "raw"]
    command = [*spy, "--output", str(output), "--", sys.executable, str(Path(__file__).resolve())]
    subprocess.run(
        [*command, "--child-pipeline", str(csv_path)],
        env={**env, T0_ENV: repr(time.time())},
        cwd=work,
        capture_output=True,
        check=True,
    )
    own: dict[str, int] = {}
    total = 0
    for line in output.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        own[stack.split(";")[-1]] = own.get(stack.split(";")[-1], 0) + int(count)
        total += int(count)
    say(f"\npy-spy: {total} samples of the whole process (all threads, 200/s); own samples:")
    for frame, samples in sorted(own.items(), key=lambda item: -item[1])[:top]:
        say(f"  {100 * samples / total:5.1f} %  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", choices=["cprofile", "py-spy", "none"], default="cprofile")
    parser.add_argument("--top", type=int, default=25, help="profile lines shown")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pipeline_ceiling.txt")
    args = parser.parse_args()
    say = Report()
    say(f"bench/bench_pipeline_ceiling.py --rows {' '.join(map(str, args.rows))} --runs {args.runs}")
    say(f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    model = task_model()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_template_home(folder)
        csvs = {}
        for rows in {FIXED_COST_ROWS, *args.rows}:
            csvs[rows] = folder / f"customers-{rows}.csv"
            generate = [sys.executable, str(HERE / "generate_customers.py"), str(rows), str(csvs[rows])]
            subprocess.run(generate, check=True)
        results: dict[int, tuple[list[dict], list[dict]]] = {rows: ([], []) for rows in args.rows}
        fixed: list[float] = []
        for index in range(args.runs):
            fixed.append(pipeline_run(csvs[FIXED_COST_ROWS], folder / f"fixed-{index}", FIXED_COST_ROWS)["wall_s"])
            say(f"run {index + 1}: {FIXED_COST_ROWS}-row pipeline run (the fixed cost) {fixed[-1]:.1f} s")
            for rows in args.rows:
                pipe = pipeline_run(csvs[rows], folder / f"pipe-{rows}-{index}", rows)
                plain = plain_run(csvs[rows], folder / f"plain-{rows}-{index}", rows, model)
                results[rows][0].append(pipe)
                results[rows][1].append(plain)
                say(f"run {index + 1}, {rows} rows: pipeline {json.dumps({k: round(v, 2) for k, v in pipe.items()})}")
                say(f"run {index + 1}, {rows} rows: plain    {json.dumps({k: round(v, 2) for k, v in plain.items()})}")
        for rows, (pipes, plains) in results.items():
            summarize(say, rows, pipes, plains)
        say(f"\nfixed cost per run: {statistics.median(fixed):.1f} s (wall of a {FIXED_COST_ROWS}-row run, median)")
        if len(args.rows) >= 2:
            small, large = sorted(args.rows)[0], sorted(args.rows)[-1]
            wall_small = statistics.median(r["wall_s"] for r in results[small][0])
            wall_large = statistics.median(r["wall_s"] for r in results[large][0])
            per_row = (wall_large - wall_small) / (large - small)
            say(
                f"  intercept of wall against rows ({small:,} → {large:,}): {wall_small - per_row * small:.1f} s; "
                f"{per_row * 1e6:.0f} µs per extra row ({1 / per_row:,.0f} rows/s at the margin)"
            )
        if args.profile != "none":
            rows = args.rows[0]
            work = folder / "profile"
            say(f"\nprofile: one more pipeline run of {rows:,} rows ({args.profile})")
            if args.profile == "cprofile":
                pipeline_run(csvs[rows], work, rows, profile_to=folder / "run.prof")
                show_cprofile(say, folder / "run.prof", args.top)
            else:
                show_py_spy(say, csvs[rows], work, args.top)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(say.lines) + "\n", encoding="utf-8")
    print(f"\nraw output: {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-pipeline":
        profile = sys.argv[sys.argv.index("--profile-to") + 1] if "--profile-to" in sys.argv else None
        child_pipeline(Path(sys.argv[2]), Path(profile) if profile else None)
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-plain":
        child_plain(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    else:
        main()
