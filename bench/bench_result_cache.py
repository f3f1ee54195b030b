"""Result cache lookups and adds of one partition against caches of different sizes.

    .venv/bin/python bench/bench_result_cache.py --sizes 100000 10000000 --partition 100000 --runs 3

For each cache size, a cache of that many entries (one fingerprint; keys are SHA-1 hex like real
request keys, texts of ~20 characters) is built once through `ResultCache.add`. Then, in a fresh
subprocess each (so its peak memory is the lookup's own, and nothing is warm in Python), a
partition of `--partition` keys, half of them cached, is looked up, and its other half added. Prints
seconds and the peak RSS growth of the lookup and of the add, medians over --runs; the ratios of
the largest cache to the smallest say whether the cost grows with the cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP = r"""
import hashlib, json, resource, sys, time
import polars as pl
from upath import UPath
from batch_assets.storage.result_cache import ResultCache

task_dir, size, partition, run = UPath(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def key(i):
    return hashlib.sha1(str(i).encode()).hexdigest()
# Half the partition is cached (keys spread over the whole cache), half is new (unique to this run).
cached = [key(i * (size // (partition // 2))) for i in range(partition // 2)]
new = [key(f"new-{run}-{i}") for i in range(partition - len(cached))]
keys = pl.Series(cached + new)
cache = ResultCache(task_dir, "fp")
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
found = cache.lookup(keys)
lookup_seconds = time.perf_counter() - started
lookup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert found.height == len(cached), (found.height, len(cached))
results = pl.DataFrame({"request_key": new, "generated_text": "a new answer", "finish_reason": "stop",
    "num_prompt_tokens": 40, "num_generated_tokens": 3, "error": None, "cumulative_logprob": -0.1})
started = time.perf_counter()
cache.add(results)
add_seconds = time.perf_counter() - started
add_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"lookup_s": lookup_seconds, "lookup_rss_mib": (lookup_rss - baseline) / 1024,
                  "add_s": add_seconds, "add_rss_mib": (add_rss - lookup_rss) / 1024}))
"""

BUILD = r"""
import hashlib, sys
import polars as pl
from upath import UPath
from batch_assets.storage.result_cache import ResultCache
task_dir, size = UPath(sys.argv[1]), int(sys.argv[2])
cache = ResultCache(task_dir, "fp")
chunk = 500_000
for start in range(0, size, chunk):
    ids = range(start, min(size, start + chunk))
    keys = [hashlib.sha1(str(i).encode()).hexdigest() for i in ids]
    cache.add(pl.DataFrame({"request_key": keys, "generated_text": [f"answer number {i}" for i in ids],
        "finish_reason": "stop", "num_prompt_tokens": 40, "num_generated_tokens": 3, "error": None,
        "cumulative_logprob": -0.1}))
"""


def build(task_dir: Path, size: int) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", BUILD, str(task_dir), str(size)], check=True)
    return time.perf_counter() - started


def step(task_dir: Path, size: int, partition: int, run: int) -> dict[str, float]:
    output = subprocess.run(
        [sys.executable, "-c", STEP, str(task_dir), str(size), str(partition), str(run)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 10_000_000])
    parser.add_argument("--partition", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="folder for the caches (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-result-cache-"))
    rows = []
    for size in args.sizes:
        task_dir = work / f"cache-{size}"
        build_seconds = build(task_dir, size)
        database = task_dir / "_result_cache" / "results.sqlite3"
        runs = [step(task_dir, size, args.partition, run) for run in range(args.runs)]
        median = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        rows.append({"size": size, "build_s": build_seconds, "db_mib": database.stat().st_size / 2**20, **median})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\npartition of {args.partition:,} keys (half cached), medians of {args.runs} fresh processes")
    print(
        "| cache entries | lookup s | lookup peak RSS growth MiB | add s | add peak RSS growth MiB | cache file MiB |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['size']:,} | {row['lookup_s']:.2f} | {row['lookup_rss_mib']:.0f} | {row['add_s']:.2f} | "
            f"{row['add_rss_mib']:.0f} | {row['db_mib']:.0f} |"
        )
    first, last = rows[0], rows[-1]
    print(
        f"\n{last['size']:,} vs {first['size']:,} entries: lookup time x{last['lookup_s'] / first['lookup_s']:.2f}, "
        f"add time x{last['add_s'] / first['add_s']:.2f}"
    )


if __name__ == "__main__":
    main()
