"""`batch-assets serve` vs vLLM's own run-batch on the same OpenAI batch file and model, whole processes.

    .venv/bin/python bench/bench_serve.py --requests 3000 --runs 2 [--max-tokens 16]

Each run alternates (a) `python -m vllm.entrypoints.openai.run_batch -i FILE -o OUT` with the engine
settings the openai_batch task's engine uses (bench_openai_batch.py's flags) and (b) a fresh
`batch-assets serve` (new DAGSTER_HOME and data folder: no result cache from earlier runs) driven by
the `openai` client: upload, create the batch, poll every 0.5 s, download the output file, stop the
server. (b) is timed from the server's launch to the output file downloaded (`serve_wall_s`; the
upload-to-download part is `upload_to_download_s`). Prints medians, the ratio (b)/(a) (target
<= 1.15) and how many answers differ from run-batch's.

Greedy answers of a CPU engine depend on how requests happen to be batched (floating-point sums in
another order can flip a near-tie between two tokens, and the rest of the answer follows the flip), so
with two runs or more the benchmark also counts how many answers run-batch's own runs disagree on
(`run_batch_vs_itself`), and for every differing answer how many leading words both sides share
(`shared_leading_words`): a flip mid-answer is batching noise, a difference from the first word is not.
`--order-check` runs run-batch once more on the same lines in reverse order and counts the answers
that change with nothing but the order (`run_batch_reversed_vs_run_batch`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_openai_batch import batch_file, run_batch, vllm_flags  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched_server(env: dict[str, str], work: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A fresh `batch-assets serve` (its output in work/serve.log), once it answers; its base URL."""
    port = free_port()
    with (work / "serve.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "batch_assets.cli", "serve", "--port", str(port)],
            env=env,
            cwd=work,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0)
        while True:
            if server.poll() is not None:
                sys.exit(f"batch-assets serve exited:\n{(work / 'serve.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, openai.APIConnectionError):
                client.batches.list(limit=1)
                break
            time.sleep(0.1)
        yield server, base_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)
        server.wait()


def serve_side(source: Path, work: Path) -> tuple[float, float, dict[str, str]]:
    """(launch to output downloaded, upload to output downloaded, answers by custom_id)."""
    env = {**os.environ, "DAGSTER_HOME": str(work / "home"), "BATCH_ASSETS_DATA": str(work / "data")}
    started = time.perf_counter()
    with launched_server(env, work) as (_, base_url):
        client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0)
        uploaded_at = time.perf_counter()
        uploaded = client.files.create(file=source.open("rb"), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.5)
        if batch.status != "completed" or batch.output_file_id is None:
            sys.exit(f"batch {batch.status}: {batch.errors}\n{(work / 'serve.log').read_text()[-3000:]}")
        text = client.files.content(batch.output_file_id).text
        done = time.perf_counter()
    answers = {}
    for line in text.splitlines():
        record = json.loads(line)
        answers[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    return done - started, done - uploaded_at, answers


def leading_words_shared(a: str, b: str) -> int:
    shared = 0
    for left, right in zip(a.split(), b.split(), strict=False):
        if left != right:
            break
        shared += 1
    return shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--order-check", action="store_true", help="also run run-batch on the lines reversed")
    args = parser.parse_args()
    flags = vllm_flags()
    peer_walls, serve_walls, mismatches, shared_words = [], [], [], []
    first_peer: dict[str, str] | None = None
    peer_self: list[int] = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        source = Path(tmp) / "requests.jsonl"
        batch_file(source, args.requests, args.max_tokens, 0.0)
        for attempt in range(args.runs):
            peer_wall, theirs = run_batch(source, Path(tmp), flags)
            work = Path(tmp) / f"serve-{attempt}"
            work.mkdir()
            serve_wall, served_part, ours = serve_side(source, work)
            peer_walls.append(peer_wall)
            serve_walls.append(serve_wall)
            differing = [k for k, v in theirs.items() if ours.get(k) != v]
            mismatches.append(len(differing))
            shared_words += [leading_words_shared(theirs[k], ours.get(k) or "") for k in differing]
            if first_peer is None:
                first_peer = theirs
            else:
                peer_self.append(sum(first_peer.get(k) != v for k, v in theirs.items()))
            row = {
                "run": attempt,
                "run_batch_wall_s": round(peer_wall, 1),
                "serve_wall_s": round(serve_wall, 1),
                "upload_to_download_s": round(served_part, 1),
                "answers_differing": mismatches[-1],
            }
            print(json.dumps(row), flush=True)
        reversed_differing = None
        if args.order_check and first_peer is not None:
            reversed_source = Path(tmp) / "requests-reversed.jsonl"
            reversed_source.write_text("".join(reversed(source.read_text().splitlines(keepends=True))))
            _, reordered = run_batch(reversed_source, Path(tmp), flags)
            reversed_differing = sum(first_peer.get(k) != v for k, v in reordered.items())
    peer, ours = statistics.median(peer_walls), statistics.median(serve_walls)
    summary = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "run_batch_wall_s": round(peer, 1),
        "serve_wall_s": round(ours, 1),
        "ratio": round(ours / peer, 3),
        "answers_differing": mismatches,
        "run_batch_vs_itself": peer_self,
        "run_batch_reversed_vs_run_batch": reversed_differing,
        "shared_leading_words": {
            "none": sum(n == 0 for n in shared_words),
            "one_to_three": sum(1 <= n <= 3 for n in shared_words),
            "more": sum(n > 3 for n in shared_words),
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
