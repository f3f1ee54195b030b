"""The Dagster UI in a real browser: the asset graph, a partition launched by clicking, its checks.

Starts `batch-assets ui` (`dg dev`: webserver + daemon, as `make ui` does) on a free loopback port with a fresh
DAGSTER_HOME holding the repo's dagster.yaml, the tiny test model and one sentiment drop registered
as a partition; then drives Debian's Chromium with Playwright like a user would. Screenshots go to
`.screenshots/` (ignored by git) for a human to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import REPO_ROOT, SAMPLES, free_port, stop_process_group

# The slow tier (`make test-fast` leaves it out): a browser, the UI server and the engine.
pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO_ROOT / ".screenshots"
ASSETS = ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
CHECKS = {
    "inference_outputs": ["outputs_satisfy_constraint"],
    "validated_labels": ["labels_are_valid", "one_row_per_record", "error_share_below_threshold"],
}
SAMPLE = SAMPLES / "sentiment" / "posts-sample.jsonl"
# Engine start-up plus inference on a shared 2-core machine; generous because other tests may run.
RUN_TIMEOUT_MS = 600_000
# How long a page may take to show what is asserted. Playwright's 5 s default is too short for a graph
# whose nodes load their live data on a 2-core machine under two test workers (CI saw it fail).
UI_TIMEOUT_MS = 60_000

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not CHROMIUM.exists():
    pytest.skip(
        f"{CHROMIUM} not found: install Debian's chromium (scripts/install_system_deps.sh does it as root)",
        allow_module_level=True,
    )


def graphql(base_url: str, query: str) -> dict:
    request = urllib.request.Request(
        f"{base_url}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def wait_for_location(base_url: str, server: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    """Until the webserver answers and the `batch_assets` code location has loaded."""
    query = "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"batch-assets ui exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            entries = graphql(base_url, query)["data"]["workspaceOrError"]["locationEntries"]
            if {"name": "batch_assets", "loadStatus": "LOADED"} in entries:
                return
        except (OSError, KeyError, TypeError, ValueError):
            pass
        time.sleep(1)
    pytest.fail(f"the UI did not load the code location in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def ui(
    tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, dg.DagsterInstance, str]]:
    """`batch-assets ui` with one sentiment drop registered as a partition: (base URL, instance, partition key)."""
    home, data = tmp_path / "dagster_home", tmp_path / "data"
    home.mkdir()
    shutil.copyfile(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    # A busy 2-core machine (`make test` runs two test workers) can take longer than Dagster's default
    # 180 s to start the code server.
    with (home / "dagster.yaml").open("a") as config:
        config.write("\ncode_servers:\n  local_startup_timeout: 600\n")
    drop = data / "drops" / "sentiment" / SAMPLE.name
    drop.parent.mkdir(parents=True)
    shutil.copyfile(SAMPLE, drop)
    key = partition_key_for(SAMPLE.name)

    instance = dg.DagsterInstance.from_config(str(home))
    instance.add_dynamic_partitions(partitions_def_name("sentiment"), [key])

    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_DATA": str(data),
        "BATCH_ASSETS_MODEL": tiny_model_path,
    }
    env.pop("BATCH_ASSETS_TASKS_DIR", None)
    log = tmp_path / "dagster-dev.log"
    cli = Path(sys.executable).with_name("batch-assets")
    server = subprocess.Popen(
        [str(cli), "ui", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO_ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_location(base_url, server, log)
        # A fresh instance greets the first visitor with a "Join the Dagster community" dialog,
        # which may pop up over whatever the test is clicking: mark it as seen.
        graphql(base_url, "mutation { setNuxSeen }")
        yield base_url, instance, key
    finally:
        stop_process_group(server)
        instance.dispose()


@pytest.fixture
def page(ui) -> Iterator[sync_api.Page]:
    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(UI_TIMEOUT_MS)
        sync_api.expect.set_options(timeout=UI_TIMEOUT_MS)
        try:
            yield page
        finally:
            sync_api.expect.set_options(timeout=None)
            browser.close()


def run_failure_summary(instance: dg.DagsterInstance, run_id: str) -> str:
    errors = [
        event.dagster_event.step_failure_data.error.to_string()
        for event in instance.all_logs(run_id)
        if event.dagster_event and event.dagster_event.is_step_failure
    ]
    return "\n".join(errors) or "no step failure recorded"


def test_materialize_a_partition_from_the_ui(ui, page: sync_api.Page) -> None:
    base_url, instance, key = ui
    expect = sync_api.expect

    # The asset graph of every task shows its four assets.
    for task in load_task_specs():
        page.goto(f"{base_url}/locations/batch_assets/asset-groups/{task.name}")
        for asset in ASSETS:
            expect(page.get_by_text(asset, exact=True).first).to_be_visible()
        page.screenshot(path=SCREENSHOTS / f"asset-graph-{task.name}.png")

    # Launch the sentiment partition the way a user does: Materialize all → pick the partition.
    page.goto(f"{base_url}/locations/batch_assets/asset-groups/sentiment")
    expect(page.get_by_text("validated_labels", exact=True).first).to_be_visible()
    page.get_by_role("button", name="Materialize all").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_text(key, exact=True).filter(visible=True).first.click()
    page.keyboard.press("Escape")  # close the partition picker, keep the dialog
    expect(page.get_by_placeholder("Filter partitions")).to_be_hidden()
    expect(dialog.get_by_text("1 partition", exact=True)).to_be_visible()
    page.screenshot(path=SCREENSHOTS / "launch-dialog.png")
    dialog.get_by_role("button", name="Launch 1 run").click()

    # The "Run started" toast links to the run.
    run_link = page.locator("a[href^='/runs/']").filter(has_text="View").first
    expect(run_link).to_be_visible()
    run_id = run_link.get_attribute("href").rsplit("/", 1)[-1]
    page.goto(f"{base_url}/runs/{run_id}")
    status = page.get_by_text(re.compile(r"^(Success|Failure|Canceled)$")).first
    expect(status).to_be_visible(timeout=RUN_TIMEOUT_MS)
    page.screenshot(path=SCREENSHOTS / "run.png")
    assert status.inner_text() == "Success", run_failure_summary(instance, run_id)

    run = instance.get_run_by_id(run_id)
    assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
    assert run.tags.get("dagster/partition") == key

    # The checks of both checked assets show as succeeded for this partition.
    for asset, checks in CHECKS.items():
        page.goto(f"{base_url}/assets/sentiment/{asset}?view=checks")
        for check in checks:
            expect(page.locator(f'div[title="{check}"] + span')).to_have_text("Succeeded")
        page.screenshot(path=SCREENSHOTS / f"checks-{asset}.png")

    # The partition's metadata: label distribution and a preview of input → label rows.
    page.goto(f"{base_url}/assets/sentiment/validated_labels?view=partitions&partition={key}")
    for field in ("label_distribution", "preview", "error_rows"):
        expect(page.get_by_text(field, exact=True).first).to_be_visible()
    expect(page.get_by_text("Materialized", exact=True).first).to_be_visible()
    page.screenshot(path=SCREENSHOTS / "partition-metadata.png", full_page=True)
    page.goto(f"{base_url}/assets/sentiment/inference_outputs?view=partitions&partition={key}")
    for field in ("generated_tokens_per_second", "engine_seconds", "sampling_params", "model"):
        expect(page.get_by_text(field, exact=True).first).to_be_visible()
    page.screenshot(path=SCREENSHOTS / "partition-metadata-inference.png", full_page=True)

    # What the UI showed is what the instance recorded.
    check_keys = [
        dg.AssetCheckKey(dg.AssetKey(["sentiment", asset]), name) for asset, names in CHECKS.items() for name in names
    ]
    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(check_keys)
    assert {check_key.name: (record.run_id, record.status.value) for check_key, record in latest.items()} == {
        check_key.name: (run_id, "SUCCEEDED") for check_key in check_keys
    }
