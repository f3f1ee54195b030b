"""How long one tick of `sentiment_drops_sensor` takes with 10,000 files in the drop zone.

    .venv/bin/python bench/bench_sensor_tick.py [--keys 10000] [--repeats 5] [--skip-local]
    .venv/bin/python bench/bench_sensor_tick.py --already-run --keys 5000 --repeats 3

`--already-run`: a local folder whose files were all run before (each partition registered, with
raw_prompts read from its file's version and validated_labels after it) and no cursor (lost, or the
sensor switched on over files `batch-assets run` ran): every file costs the tick a look at what the
instance recorded of it.

S3: moto's standalone S3 server on 127.0.0.1, reached over HTTP by s3fs like any S3 endpoint
(objects are created straight in the server's backend to save time; every listing goes over the
wire, 1,000 keys a page). Local: a temporary folder. Each scenario evaluates the sensor function
the way the daemon's code server does (listing, cursor, partitions lookup, run requests) and
reports the median and range of `--repeats` evaluations. Dagster's default limit for one sensor
evaluation is 60 s (`DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS`).
"""

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def start_moto() -> str:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


def fill_s3(bucket: str, prefix: str, count: int) -> None:
    import boto3
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    boto3.client("s3").create_bucket(Bucket=bucket)
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for index in range(count):
        backend.put_object(
            bucket, f"{prefix}/drops/sentiment/batch-{index // 100:03d}/posts-{index:05d}.jsonl", b'{"text": "x"}\n'
        )


def fill_local(root: Path, count: int) -> None:
    stamp = time.time() - 3600
    for index in range(count):
        path = root / "drops" / "sentiment" / f"batch-{index // 100:03d}" / f"posts-{index:05d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b'{"text": "x"}\n')
        os.utime(path, (stamp, stamp))


def add_one(where: str, data_url: str) -> None:
    from batch_assets.storage.locations import drop_zone, is_local

    path = drop_zone("sentiment") / "late" / f"posts-{time.time_ns()}.jsonl"
    if is_local(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"text": "late"}\n')
    if is_local(path):
        stamp = time.time() - 3600
        os.utime(path.path, (stamp, stamp))


def measure(label: str, repeats: int, setup, action) -> dict:
    seconds = []
    detail = ""
    for _ in range(repeats):
        state = setup()
        started = time.perf_counter()
        detail = action(state)
        seconds.append(time.perf_counter() - started)
    row = {
        "scenario": label,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "detail": detail,
    }
    print(
        f"  {label}: median {row['median_s']:.2f} s (min {row['min_s']:.2f}, max {row['max_s']:.2f}) {detail}",
        flush=True,
    )
    return row


def run_scenarios(where: str, keys: int, repeats: int, data_url: str) -> list[dict]:
    import dagster as dg

    from batch_assets.lib.drops_sensor import build_drops_sensor
    from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
    from batch_assets.pipeline.task_spec import load_task_specs
    from batch_assets.storage.drop_files import list_drop_files

    task = next(task for task in load_task_specs() if task.name == "sentiment")
    job = build_definitions().resolve_job_def(pipeline_job_name("sentiment"))
    shipped = build_drops_sensor(task, job)  # at most 500 runs a tick
    uncapped = build_drops_sensor(task, job, max_runs_per_tick=None)
    rows = []
    print(f"{where}: {keys} files in {data_url}/drops/sentiment", flush=True)

    def evaluate(sensor, instance, cursor):
        return sensor(dg.build_sensor_context(instance=instance, cursor=cursor))

    with dg.instance_for_test() as instance:
        rows.append(
            measure(
                "listing only (list_drop_files)",
                repeats,
                lambda: None,
                lambda _: f"{len(list_drop_files('sentiment')[0])} files",
            )
        )
        rows.append(
            measure(
                "first tick, shipped sensor (all new; requests 500)",
                repeats,
                lambda: None,
                lambda _: f"{len(evaluate(shipped, instance, None).run_requests)} run requests",
            )
        )
        first = {}

        def all_new(_):
            result = evaluate(uncapped, instance, None)
            first["result"] = result
            return f"{len(result.run_requests)} run requests, cursor {len(result.cursor):,} bytes"

        rows.append(measure("first tick, no cap (all new; requests every file)", repeats, lambda: None, all_new))
        cursor = first["result"].cursor
        instance.add_dynamic_partitions(
            first["result"].dynamic_partitions_requests[0].partitions_def_name,
            list(first["result"].dynamic_partitions_requests[0].partition_keys),
        )
        rows.append(
            measure(
                "steady tick (all known, nothing new)",
                repeats,
                lambda: None,
                lambda _: evaluate(shipped, instance, cursor).skip_reason.skip_message[:40],
            )
        )
        current = {"cursor": cursor}

        def one_new(_):
            result = evaluate(shipped, instance, current["cursor"])
            current["cursor"] = result.cursor or current["cursor"]
            return f"{len(result.run_requests)} run request(s)"

        rows.append(measure("one new file among them", repeats, lambda: add_one(where, data_url), one_new))
    for row in rows:
        row["where"] = where
    return rows


def already_run_scenarios(keys: int, repeats: int, folder: str) -> list[dict]:
    import dagster as dg

    from batch_assets.lib.drops_sensor import build_drops_sensor
    from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
    from batch_assets.pipeline.task_spec import load_task_specs
    from batch_assets.storage.drop_files import list_drop_files, partitions_def_name

    task = next(task for task in load_task_specs() if task.name == "sentiment")
    job = build_definitions().resolve_job_def(pipeline_job_name("sentiment"))
    shipped = build_drops_sensor(task, job)
    uncapped = build_drops_sensor(task, job, max_runs_per_tick=None)
    files, _ = list_drop_files("sentiment")
    rows = []
    with dg.instance_for_test() as instance:
        started = time.perf_counter()
        instance.add_dynamic_partitions(partitions_def_name("sentiment"), [drop.partition_key for drop in files])
        for drop in files:
            for asset, metadata in (("raw_prompts", {"source_version": drop.version}), ("validated_labels", {})):
                instance.report_runless_asset_event(
                    dg.AssetMaterialization(
                        asset_key=dg.AssetKey(["sentiment", asset]), partition=drop.partition_key, metadata=metadata
                    )
                )
        print(f"recorded {2 * len(files)} materializations in {time.perf_counter() - started:.1f} s", flush=True)

        def evaluate(sensor) -> str:
            result = sensor(dg.build_sensor_context(instance=instance, cursor=None))
            return f"{len(result.run_requests)} run requests, {len(result.cursor or ''):,} byte cursor"

        for label, sensor in (("shipped sensor (500 files a tick)", shipped), ("no cap (every file)", uncapped)):
            rows.append(
                measure(
                    f"first tick over files already run, {label}",
                    repeats,
                    lambda: None,
                    lambda _, sensor=sensor: evaluate(sensor),
                )
            )
    for row in rows:
        row["where"] = f"local folder, {keys} files already run"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--already-run", action="store_true", help="only the files-already-run scenario")
    args = parser.parse_args()
    if args.already_run:
        with tempfile.TemporaryDirectory() as folder:
            os.environ["BATCH_ASSETS_DATA"] = folder
            fill_local(Path(folder), args.keys)
            print_table(already_run_scenarios(args.keys, args.repeats, folder), args.keys)
        return

    endpoint = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION="us-east-1",
    )
    rows = []
    data_url = "s3://bench-bucket/batch"
    os.environ["BATCH_ASSETS_DATA"] = data_url
    started = time.perf_counter()
    fill_s3("bench-bucket", "batch", args.keys)
    print(f"created {args.keys} objects in {time.perf_counter() - started:.1f} s", flush=True)
    rows += run_scenarios("s3 (moto over HTTP)", args.keys, args.repeats, data_url)

    if not args.skip_local:
        with tempfile.TemporaryDirectory() as folder:
            os.environ["BATCH_ASSETS_DATA"] = folder
            fill_local(Path(folder), args.keys)
            rows += run_scenarios("local folder", args.keys, args.repeats, folder)

    print_table(rows, args.keys)


def print_table(rows: list[dict], keys: int) -> None:
    print()
    print(f"| drop zone | scenario ({keys:,} files) | median s | min–max s | result |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['where']} | {row['scenario']} | {row['median_s']:.2f} | "
            f"{row['min_s']:.2f}–{row['max_s']:.2f} | {row['detail']} |"
        )


if __name__ == "__main__":
    sys.exit(main())
