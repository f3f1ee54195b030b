"""`engine.kind: batch_api` against an independent real Batch API server on loopback.

The server is OGX 1.5.0 (formerly Llama Stack): its reference batches provider and local files
provider in front of a `vllm serve` of the tiny model (`vllm_server`, shared with
test_openai_engine.py). OGX needs Python >= 3.12, so it runs from a virtual environment of its own,
built once under `.venv/ogx-<version>` (or BATCH_ASSETS_OGX_VENV) by the `ogx_venv` fixture.
`batch_server` is parameterized by server kind: OGX, and this project's own `batch-assets serve`
(its own DAGSTER_HOME and data folder, the tiny model, its batches run by `batch-assets run`); one
more server that speaks OpenAI's Files and Batches API is one more entry in `SERVERS`.

One server session, one test that checks several things: a `batch-assets run` killed with SIGKILL
while its batch is in flight, then run again: the same batch collected, no second batch created
(counted on the server), every row once and labelled end to end through the batch (valid labels,
the batch id in the partition's metadata, the kept records gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.runtime.instance import exclusive_file_lock
from batch_assets_tests.support import REPO_ROOT, SERVER_KEY, Server, free_port
from batch_assets_tests.support.ogx import python_312, run_or_skip
from batch_assets_tests.support.processes import VENV_CLI as CLI
from batch_assets_tests.support.processes import group_alive, running_server

pytestmark = pytest.mark.slow

OGX_VERSION = "1.5.0"
# OGX's distribution config: the three APIs a batch needs, state in one folder, vLLM as inference.
OGX_CONFIG = """\
version: 2
distro_name: batch-assets-test
apis: [batches, files, inference]
providers:
  inference:
  - provider_id: vllm
    provider_type: "remote::vllm"
    config: {base_url: "${env.VLLM_URL}", api_token: "${env.VLLM_API_TOKEN}"}
  files:
  - provider_id: local
    provider_type: "inline::localfs"
    config: {storage_dir: "${env.OGX_STATE}/files", metadata_store: {table_name: files_metadata, backend: sql_default}}
  batches:
  - provider_id: reference
    provider_type: "inline::reference"
    config: {sqlstore: {table_name: batches, backend: sql_default}}
storage:
  backends:
    kv_default: {type: kv_sqlite, db_path: "${env.OGX_STATE}/kvstore.db"}
    sql_default: {type: sql_sqlite, db_path: "${env.OGX_STATE}/sql_store.db"}
  stores:
    metadata: {namespace: registry, backend: kv_default}
    inference: {table_name: inference_store, backend: sql_default}
registered_resources: {models: []}
"""


@dataclass(frozen=True)
class BatchServer:
    base_url: str
    model: str  # the name the server knows the tiny model by
    # Whether it returns `logprobs` (a label's confidence); a task sent to one that does not sets
    # `output.confidence: false`.
    logprobs: bool = True
    # Whether the test checks that every label got its confidence back: `batch-assets serve`'s
    # answers carry the lines' `logprobs` (OGX's reference provider's are not asserted here).
    confidence_checked: bool = False

    def batch_ids(self) -> list[str]:
        """Every batch the server holds (counted on the server, not by the engine)."""
        import openai

        with openai.OpenAI(base_url=self.base_url, api_key="unused") as client:
            return [batch.id for batch in client.batches.list(limit=100)]


@pytest.fixture(scope="session")
def ogx_venv() -> Path:
    """OGX in a virtual environment of its own (it needs Python >= 3.12), built once per version;
    skipped, naming the command, where it cannot be built (no Python >= 3.12, no package index)."""
    venv = Path(os.environ.get("BATCH_ASSETS_OGX_VENV", REPO_ROOT / ".venv" / f"ogx-{OGX_VERSION}"))
    marker = venv / ".installed"
    if marker.exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Another pytest process (an xdist worker, a second checkout sharing .venv) may be building it.
    with exclusive_file_lock(venv.with_name(venv.name + ".lock")):
        if not marker.exists():
            python = python_312()
            if python is None:
                pytest.skip("OGX needs Python >= 3.12: none found (set BATCH_ASSETS_OGX_PYTHON)")
            shutil.rmtree(venv, ignore_errors=True)
            run_or_skip([python, "-m", "venv", str(venv)], "creating OGX's virtual environment")
            run_or_skip([*_installer(venv), f"ogx=={OGX_VERSION}"], f"installing ogx=={OGX_VERSION}")
            marker.write_text(OGX_VERSION)
    return venv


def _installer(venv: Path) -> list[str]:
    """`uv pip install` where a uv is at hand (scripts/setup.sh puts one in .venv), several times
    faster than pip on a clean machine; pip otherwise."""
    uv = REPO_ROOT / ".venv" / "bin" / "uv"
    found = str(uv) if uv.exists() else shutil.which("uv")
    if found:
        return [found, "pip", "install", "-q", "--python", str(venv / "bin" / "python")]
    return [str(venv / "bin" / "pip"), "install", "-q"]


@contextlib.contextmanager
def ogx_server(venv: Path, vllm: Server, folder: Path) -> Iterator[BatchServer]:
    port = free_port()
    config = folder / "ogx.yaml"
    config.write_text(OGX_CONFIG)
    env = {**os.environ, "VLLM_URL": vllm.base_url, "VLLM_API_TOKEN": SERVER_KEY, "OGX_STATE": str(folder)}
    log = folder / "ogx.log"
    with log.open("wb") as out:
        command = [str(venv / "bin" / "ogx"), "run", str(config), "--port", str(port), "--insecure"]
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = BatchServer(f"http://127.0.0.1:{port}/v1", f"vllm/{vllm.model}")
    try:
        deadline = time.monotonic() + 180
        while not _serves(server):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ogx did not come up (exit code {process.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _serves(server: BatchServer) -> bool:
    try:
        with urllib.request.urlopen(f"{server.base_url}/models", timeout=5) as response:
            return server.model in {m["id"] for m in json.load(response)["data"]}
    except OSError:
        return False


@contextlib.contextmanager
def serve_server(model: str, folder: Path) -> Iterator[BatchServer]:
    """`batch-assets serve` on the tiny model, with a DAGSTER_HOME and data folder of its own."""
    env = {
        **os.environ,
        "BATCH_ASSETS_MODEL": model,
        "BATCH_ASSETS_DATA": str(folder / "data"),
        "DAGSTER_HOME": str(folder / "home"),
    }
    port = free_port()
    with running_server(env, port, folder / "serve.log"):
        yield BatchServer(f"http://127.0.0.1:{port}/v1", model, confidence_checked=True)


SERVERS = ("ogx", "serve")


@pytest.fixture(scope="session", params=SERVERS)
def batch_server(
    request: pytest.FixtureRequest, tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BatchServer]:
    if request.param == "ogx":
        venv = request.getfixturevalue("ogx_venv")
        vllm = request.getfixturevalue("vllm_server")  # only OGX needs it: serve runs its own engine
        with ogx_server(venv, vllm, tmp_path_factory.mktemp("ogx")) as server:
            yield server
    else:
        with serve_server(tiny_model_path, tmp_path_factory.mktemp("serve")) as server:
            yield server


def batch_task_file(folder: Path, server: BatchServer, tokenizer: str, poll_seconds: float) -> Path:
    """The shipped sentiment task on the batch API, as a user would write it."""
    text = (REPO_ROOT / "batch_assets" / "tasks" / "sentiment.yaml").read_text(encoding="utf-8")
    engine = (
        f"engine:\n  kind: batch_api\n  base_url: {server.base_url}\n  model: {server.model}\n"
        f"  tokenizer: {tokenizer}\n  poll_seconds: {poll_seconds}\n"
    )
    text = text.replace("engine:\n", engine, 1)
    if not server.logprobs:
        text = text.replace("output:\n", "output:\n  confidence: false\n", 1)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sentiment.yaml").write_text(text, encoding="utf-8")
    return folder / "sentiment.yaml"


def test_kill_9_while_the_batch_is_in_flight_then_rerun_collects_the_same_batch(
    tmp_path: Path, data_dir: Path, tiny_model_path: str, batch_server: BatchServer
) -> None:
    tasks = batch_task_file(tmp_path / "tasks", batch_server, tiny_model_path, 4).parent
    env = {**os.environ, "BATCH_ASSETS_TASKS_DIR": str(tasks)}
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    rows = [{"id": f"p-{i}", "text": f"post {i}: the parcel came after {i % 7} days"} for i in range(40)]
    (inputs / "posts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    records = data_dir / "storage" / "sentiment" / "_batch_api"
    before = set(batch_server.batch_ids())
    log = tmp_path / "cli.log"

    # 1. Killed with SIGKILL (its whole process group) once its batch id is kept: it is then
    #    waiting `poll_seconds` between status checks.
    child = _run_cli(env, inputs, log)
    deadline = time.monotonic() + 300
    while not (kept := [json.loads(p.read_text()) for p in records.glob("*/*.json")]) or not kept[0].get("batch_id"):
        assert child.poll() is None, f"the run ended before it could be killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert group_alive(child.pid) == [] or _gone(child.pid)
    batch_id = kept[0]["batch_id"]
    assert set(batch_server.batch_ids()) - before == {batch_id}
    assert not (data_dir / "storage" / "sentiment" / "validated_labels" / "posts.jsonl.parquet").exists()

    # 2. The re-run collects that batch: no second one on the server, every row once.
    rerun = _run_cli(env, inputs, log)
    assert rerun.wait(timeout=300) == 0, log.read_text()[-5000:]
    assert set(batch_server.batch_ids()) - before == {batch_id}
    outputs = dg.DagsterInstance.get().fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "inference_outputs"])), limit=10
    )
    assert [r.asset_materialization.metadata["batch_ids"].value for r in outputs.records] == [batch_id]
    labels = pl.read_parquet(data_dir / "storage" / "sentiment" / "validated_labels" / "posts.jsonl.parquet")
    assert labels["id"].to_list() == [row["id"] for row in rows]
    assert labels["error"].null_count() == 40 and labels["label"].is_in(["positive", "negative", "neutral"]).all()
    if batch_server.confidence_checked:  # the labels' confidence, from the log-probabilities the batch returned
        assert labels["confidence"].is_between(0.0, 1.0).all() and labels["confidence"].null_count() == 0
    assert not list(records.glob("*/*.json"))


def _run_cli(env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(CLI), "run", "sentiment", "posts.jsonl"],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _gone(pgid: int) -> bool:
    for _ in range(100):
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return False
