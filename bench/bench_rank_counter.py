"""vLLM's log-probability rank counter, eager vs compiled, and what compiling it costs.

    .venv/bin/python bench/bench_rank_counter.py [--vocab 49152] [--threads 2]

The labels' `confidence` makes vLLM's sampler count, for every sequence of every step, the
vocabulary entries at least as likely as the sampled token (`batched_count_greater_than`,
`vllm/v1/sample/ops/logprobs.py`, wrapped in `torch.compile`). On a CPU in eager mode the pipeline
decides per engine start whether dynamo is on (`engine_process_environment`): this measures both
sides of that choice in fresh processes, each with its own `TORCHDYNAMO_DISABLE`: the milliseconds
per call at several batch sizes (median of 30 calls after 3 warm-up calls), and the first calls'
seconds at each size (the compile and its recompile for dynamic shapes), with the compile cache in
/tmp as an earlier engine left it and with an empty one (a fresh container).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BATCHES = (16, 64, 256)

_CHILD = """
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
vocab = int(sys.argv[2])
from vllm.v1.sample.ops.logprobs import batched_count_greater_than as count
first = 0.0  # the first call at each batch size: the compile, and its recompile for dynamic shapes
per_call = {}
for batch in (16, 64, 256):
    x = torch.randn(batch, vocab)
    values = x[:, :1].clone()
    started = time.perf_counter()
    count(x, values)
    first += time.perf_counter() - started
    for _ in range(2):
        count(x, values)
    times = []
    for _ in range(30):
        started = time.perf_counter()
        count(x, values)
        times.append(time.perf_counter() - started)
    per_call[batch] = 1000 * statistics.median(times)
print(json.dumps({"first_call_s": first, "ms_per_call": per_call}))
"""


def measure(threads: int, vocab: int, environment: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(threads), str(vocab)],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: the embedded SmolLM2's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine worker's)")
    args = parser.parse_args()
    eager = measure(args.threads, args.vocab, {"TORCHDYNAMO_DISABLE": "1"})
    warm = measure(args.threads, args.vocab, {"TORCHDYNAMO_DISABLE": "0"})
    with tempfile.TemporaryDirectory() as empty:
        cold = measure(args.threads, args.vocab, {"TORCHDYNAMO_DISABLE": "0", "TORCHINDUCTOR_CACHE_DIR": empty})
    print(f"vocabulary {args.vocab}, {args.threads} torch threads; ms per call (median of 30):")
    print(f"  {'batch':>6} {'eager':>9} {'compiled':>9}")
    for batch in BATCHES:
        key = str(batch)
        print(f"  {batch:>6} {eager['ms_per_call'][key]:9.2f} {warm['ms_per_call'][key]:9.2f}")
    print(
        f"first calls: eager {eager['first_call_s']:.2f} s, compiled with the compile cache of an earlier run "
        f"{warm['first_call_s']:.2f} s, with an empty cache {cold['first_call_s']:.2f} s"
    )
    saved = (eager["ms_per_call"]["256"] - warm["ms_per_call"]["256"]) / 256
    print(
        f"compiled saves {saved:.3f} ms per sequence-step at 256 sequences a step: the warm compile is repaid after "
        f"{warm['first_call_s'] * 1000 / saved:,.0f} generated tokens, the cold one after "
        f"{cold['first_call_s'] * 1000 / saved:,.0f}"
    )


if __name__ == "__main__":
    main()
