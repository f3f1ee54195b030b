"""No import cycles in batch_assets: not between modules, not between packages.

The graph is read from the source (ast), so it sees every import: at module level, inside
functions and under `if TYPE_CHECKING:`. An import deferred into a function still ties two
modules together (it only moves the failure from import time to call time), and deferring is how
the cycles this test was written for were hidden. Imports by name in strings (`importlib`,
`type:` in a component's defs.yaml) are not seen.

A package is a folder of modules (`batch_assets.pipeline`, ...); the modules at the top
(`cli.py`, `definitions.py`) form the package `batch_assets`. A package cycle is a module of
package A importing one of B while some module of B imports one of A, even when no module cycle
results: packages are layers (the pure core under storage and the engines, Dagster on top).

The layers as a table (`ALLOWED_IMPORTS`): which package may import which, some only by named
modules; an arrow the table does not hold fails the fast tier, naming the import and the rule. The
rules of docs/layout.md are this table, written there by `BATCH_ASSETS_UPDATE_LAYOUT=1 .venv/bin/python
-m pytest batch_assets_tests/test_import_graph.py` and checked against it.

And what loading the code location imports: none of the modules only some runs need.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from batch_assets_tests.support import REPO_ROOT

ROOT_PACKAGE = "batch_assets"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str  # path:line of the import statement


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name → file of every module of the package (a package by its `__init__.py`)."""
    modules = {}
    for path in sorted((root / ROOT_PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def package_of(module: str, modules: dict[str, Path]) -> str:
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, modules: dict[str, Path], root: Path) -> Iterator[Import]:
    """Every import of a batch_assets module by `module`, wherever in the file it is."""
    path = modules[module]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package_of(module, modules).split(".")
                base = ".".join([*anchor[: len(anchor) - node.level + 1], *([base] if base else [])])
            # `from package import name`: the submodule when `name` is one, else the package itself.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where only a.b is ours, or a name in it
                target = target.rpartition(".")[0]
            if target and target != module:
                yield Import(module, target, f"{path.relative_to(root)}:{node.lineno}")


def import_graph(root: Path) -> list[Import]:
    modules = module_names(root)
    return [found for module in modules for found in imports_of(module, modules, root)]


def cycles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """One cycle (a closed list of nodes) per strongly connected component with more than one node:
    mending it may reveal another in the same component, which the next run names."""
    successors: dict[str, list[str]] = {}
    for source, target in sorted(edges):
        successors.setdefault(source, []).append(target)
        successors.setdefault(target, [])
    # Tarjan's algorithm, iteratively (no recursion limit to worry about).
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in successors:
        if start in index:
            continue
        work = [(start, iter(successors[start]))]
        index[start] = lowlink[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = lowlink[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(successors[child])))
            elif child in on_stack:
                lowlink[node] = min(lowlink[node], index[child])
    return [_shortest_cycle(component[0], set(component), successors) for component in components]


def _shortest_cycle(start: str, component: set[str], successors: dict[str, list[str]]) -> list[str]:
    """The shortest way from `start` back to itself inside its component (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in successors[node]:
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in component and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def describe(cycle: list[str], edges: dict[tuple[str, str], str]) -> str:
    steps = [f"{a} -> {b} ({edges[a, b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return "\n    ".join(steps)


def module_edges(graph: list[Import]) -> dict[tuple[str, str], str]:
    edges: dict[tuple[str, str], str] = {}
    for found in graph:
        edges.setdefault((found.importer, found.imported), found.where)
    return edges


def package_edges(graph: list[Import], modules: dict[str, Path]) -> dict[tuple[str, str], str]:
    """Package A → package B, each named by the first module import that makes it."""
    edges: dict[tuple[str, str], str] = {}
    for found in graph:
        source, target = package_of(found.importer, modules), package_of(found.imported, modules)
        if source != target:
            edges.setdefault((source, target), f"{found.importer} -> {found.imported}, {found.where}")
    return edges


def test_the_graph_sees_module_level_function_level_and_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / ROOT_PACKAGE
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text("from . import b\n")
    (package / "core" / "b.py").write_text("def f():\n    from batch_assets.top import thing\n")
    (package / "top.py").write_text("import batch_assets.core.a\nthing = 1\n")
    edges = module_edges(import_graph(tmp_path))
    assert set(edges) == {
        ("batch_assets.core.a", "batch_assets.core.b"),
        ("batch_assets.core.b", "batch_assets.top"),
        ("batch_assets.top", "batch_assets.core.a"),
    }
    assert cycles(edges) == [["batch_assets.core.a", "batch_assets.core.b", "batch_assets.top", "batch_assets.core.a"]]
    packages = package_edges(import_graph(tmp_path), module_names(tmp_path))
    assert cycles(packages) == [["batch_assets", "batch_assets.core", "batch_assets"]]


def test_no_import_cycle_between_modules() -> None:
    edges = module_edges(import_graph(REPO_ROOT))
    found = cycles(edges)
    assert not found, "import cycles between modules:\n  " + "\n  ".join(describe(c, edges) for c in found)


def test_no_import_cycle_between_packages() -> None:
    graph = import_graph(REPO_ROOT)
    edges = package_edges(graph, module_names(REPO_ROOT))
    found = cycles(edges)
    assert not found, "import cycles between packages:\n  " + "\n  ".join(describe(c, edges) for c in found)


# ---------------------------------------------------------------------------------------------------
# The layers. A package here is a folder under batch_assets/ with its subfolders (`pipeline` holds
# `pipeline/task_spec/`); `batch_assets` is the modules at the top (cli.py, cli_parser.py,
# definitions.py, __init__.py). A package imports its own modules freely. A subfolder with a rule of
# its own (`pipeline.cascade`: a kind of task) is a layer inside its folder's: it imports what its
# rule names, its folder's other modules import it only where their rule names it, and a layer that
# may import the folder may import it too.


@dataclass(frozen=True)
class Rule:
    why: str  # what the package is, in the layer's terms
    may_import: dict[str, tuple[str, ...]] = field(default_factory=dict)  # package -> its modules, () = any
    no_dagster: bool = False  # nor any `dagster` module


ANY: tuple[str, ...] = ()
ALLOWED_IMPORTS: dict[str, Rule] = {
    "pipeline": Rule(
        "the pure core: task files, inputs, the formats contract and registry, the engine contract, inference",
        no_dagster=True,
    ),
    # The kinds of task: each imports the core, none is imported by it (the registry names them).
    "pipeline.embeddings": Rule("the embedding and similarity kinds", {"pipeline": ANY}, no_dagster=True),
    "pipeline.cascade": Rule(
        "the cascade kind: rows embedded as the embedding kinds'",
        {"pipeline": ANY, "pipeline.embeddings": ANY},
        no_dagster=True,
    ),
    "pipeline.openai_batch": Rule(
        "the OpenAI batch kinds: its embedding lines as the embedding kinds'",
        {"pipeline": ANY, "pipeline.embeddings": ANY},
        no_dagster=True,
    ),
    "runtime": Rule("Dagster's and vLLM's runtime beyond their public API, and the workarounds on it"),
    "engines": Rule(
        "the engines behind the contract, each a Dagster resource",
        {"pipeline": ANY, "runtime": ("vllm_private", "vllm_stats", "interrupts")},
    ),
    "storage": Rule(
        "locations, drop files, parquet, checkpoints, the result cache",
        {"pipeline": ANY, "runtime": ("instance",)},  # instance: its file lock guards the cache's creation
    ),
    "lib": Rule(
        "the Dagster factories: assets, checks, sensors, jobs, automation, the components",
        {"pipeline": ANY, "engines": ANY, "storage": ANY, "runtime": ANY},
    ),
    "app": Rule(
        "the command line's services: `run`, `demo`, `estimate`, `tasks`, `drop`, `cache`, the project",
        {"pipeline": ANY, "engines": ANY, "storage": ANY, "runtime": ANY, "lib": ANY},
    ),
    "doctor": Rule(
        "`batch-assets doctor`'s checks",
        {
            "pipeline": ANY,
            "engines": ANY,
            "storage": ANY,
            "runtime": ANY,
            "lib": ("task_definitions", "ray_runs"),  # the GPUs per node, Ray's engine resource
            "app": ("projects", "error_causes"),  # whose tasks are checked; a check's own failure, in one line
        },
    ),
    "serve": Rule(
        "`batch-assets serve`: its batches run as `batch-assets run` commands, not through lib/",
        {"pipeline": ANY, "storage": ANY, "runtime": ANY},
    ),
    "batch_assets": Rule(
        "the command line and the code location, on top",
        dict.fromkeys(("pipeline", "runtime", "engines", "storage", "lib", "app", "doctor", "serve"), ANY),
    ),
}


def layer_of(module: str) -> str:
    """`batch_assets.pipeline.task_spec.spec` -> `pipeline`, `batch_assets.pipeline.cascade.run` ->
    `pipeline.cascade` (a subfolder with a rule of its own); a top module -> `batch_assets`."""
    parts = module.split(".")
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in ALLOWED_IMPORTS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED_IMPORTS) else ROOT_PACKAGE


def folder_of(layer: str) -> str:
    """`pipeline.cascade` -> `pipeline/cascade/`, as the docs and messages name it."""
    return layer.replace(".", "/") + "/"


def allowed_modules(rule: Rule, source: str, target: str) -> tuple[str, tuple[str, ...]] | None:
    """The layer of `rule`'s that `target` falls under, and its modules allowed (() = any); None: none.
    A layer of a folder falls under the folder's rule for a layer outside it."""
    if target in rule.may_import:
        return target, rule.may_import[target]
    folder = target.partition(".")[0]
    if folder != target and folder != source.partition(".")[0] and folder in rule.may_import:
        return folder, rule.may_import[folder]
    return None


def forbidden_imports(graph: list[Import], rules: dict[str, Rule]) -> list[str]:
    """Each import between layers that `rules` does not allow, with where it is and the rule."""
    found = []
    for imported in graph:
        source, target = layer_of(imported.importer), layer_of(imported.imported)
        if source == target:
            continue
        rule = rules[source]
        under = allowed_modules(rule, source, target)
        # The module right under the layer allowed: `formats` of `batch_assets.pipeline.formats`.
        parts = imported.imported.split(".")
        module = parts[1 + len(under[0].split("."))] if under and len(parts) > 1 + len(under[0].split(".")) else ""
        if under is None or (under[1] and module not in under[1]):
            may = ", ".join(
                f"{name}" + (f" ({', '.join(mods)})" if mods else "") for name, mods in rule.may_import.items()
            )
            found.append(
                f"{imported.where}: {imported.importer} -> {imported.imported}: "
                f"{folder_of(source)} may import {may or 'nothing of ours'}"
            )
    return found


def dagster_imports(root: Path, layer: str) -> list[str]:
    """Where a module of `layer` imports Dagster (any `dagster` module, at any level of the file)."""
    found = []
    for module, path in module_names(root).items():
        if layer_of(module) != layer:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(name.split(".")[0].startswith("dagster") for name in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def rules_table(rules: dict[str, Rule]) -> str:
    """The rules as docs/layout.md shows them."""
    lines = ["| package | is | may import |", "|---|---|---|"]
    for name, rule in rules.items():
        folder = "top modules" if name == ROOT_PACKAGE else f"`{folder_of(name)}`"
        allowed = [
            f"`{folder_of(target)}`" + (f" ({', '.join(mods)})" if mods else "")
            for target, mods in rule.may_import.items()
        ]
        may = ", ".join(allowed) or "nothing of ours"
        lines.append(f"| {folder} | {rule.why} | {may}{'; not Dagster' if rule.no_dagster else ''} |")
    return "\n".join(lines)


LAYOUT = REPO_ROOT / "docs" / "layout.md"
TABLE = re.compile(r"(<!-- import rules: .*? -->\n)(.*?)(\n\n)", re.S)


def write_tree(root: Path, files: dict[str, str]) -> None:
    """`files` (path under batch_assets/ -> source) as packages under `root`, each folder with its `__init__.py`."""
    package = root / ROOT_PACKAGE
    for name, source in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == root:
                break
            (folder / "__init__.py").touch()
        path.write_text(source)


def test_the_rules_catch_an_arrow_they_do_not_allow_and_name_it(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pipeline/core.py": "import dagster\nfrom batch_assets.storage import files\n",
            "storage/files.py": "from batch_assets.runtime import instance, other\n",
            "runtime/instance.py": "",
            "runtime/other.py": "",
        },
    )
    found = forbidden_imports(import_graph(tmp_path), ALLOWED_IMPORTS)
    assert found == [
        "batch_assets/pipeline/core.py:2: batch_assets.pipeline.core -> batch_assets.storage.files: "
        "pipeline/ may import nothing of ours",
        "batch_assets/storage/files.py:1: batch_assets.storage.files -> batch_assets.runtime.other: "
        "storage/ may import pipeline, runtime (instance)",
    ]
    assert dagster_imports(tmp_path, "pipeline") == ["batch_assets/pipeline/core.py:1"]


def test_the_core_imports_no_kind_and_a_kind_only_what_its_rule_names(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pipeline/formats.py": "from batch_assets.pipeline.cascade import run\n",
            "pipeline/cascade/run.py": (
                "from batch_assets.pipeline import formats\nfrom batch_assets.pipeline.openai_batch import lines\n"
            ),
            "pipeline/openai_batch/lines.py": "",
            "lib/assets.py": "from batch_assets.pipeline.cascade import run\n",
        },
    )
    found = forbidden_imports(import_graph(tmp_path), ALLOWED_IMPORTS)
    assert found == [
        "batch_assets/pipeline/cascade/run.py:2: batch_assets.pipeline.cascade.run -> "
        "batch_assets.pipeline.openai_batch.lines: pipeline/cascade/ may import pipeline, pipeline.embeddings",
        "batch_assets/pipeline/formats.py:1: batch_assets.pipeline.formats -> batch_assets.pipeline.cascade.run: "
        "pipeline/ may import nothing of ours",
    ]


def test_every_import_between_packages_is_one_the_rules_allow() -> None:
    assert set(ALLOWED_IMPORTS) == {layer_of(module) for module in module_names(REPO_ROOT)}, "a package with no rule"
    found = forbidden_imports(import_graph(REPO_ROOT), ALLOWED_IMPORTS)
    assert not found, "imports the rules (ALLOWED_IMPORTS) do not allow:\n  " + "\n  ".join(found)
    for layer, rule in ALLOWED_IMPORTS.items():
        if rule.no_dagster:
            assert not dagster_imports(REPO_ROOT, layer), f"{layer}/ imports Dagster"


def test_docs_layout_states_the_rules_of_the_table() -> None:
    text = LAYOUT.read_text()
    match = TABLE.search(text)
    assert match, "docs/layout.md has no `<!-- import rules: ... -->` table"
    if os.environ.get("BATCH_ASSETS_UPDATE_LAYOUT") == "1":
        LAYOUT.write_text(text[: match.start(2)] + rules_table(ALLOWED_IMPORTS) + text[match.end(2) :])
        return
    assert match.group(2) == rules_table(ALLOWED_IMPORTS), "docs/layout.md's rules differ: BATCH_ASSETS_UPDATE_LAYOUT=1"


# Loaded by the runs that use them only (pipeline/extras.py): each takes seconds to import, and the
# core install has none of them. SQLAlchemy and Alembic come with Dagster, but its event log and our
# result cache import them only where a run or an instance needs them.
HEAVY_MODULES = ("torch", "vllm", "transformers", "sklearn", "scipy", "sqlalchemy", "alembic")
LOADS = """
import json, sys
import batch_assets.definitions
from batch_assets import cli
code = cli.main(["tasks"])
print(json.dumps({"code": code, "imported": sorted({name.partition(".")[0] for name in sys.modules} & set(HEAVY))}))
"""


def test_the_code_location_and_a_command_import_no_engine_cascade_or_sql_module(tmp_path: Path) -> None:
    """Before, `import batch_assets.definitions` imported scikit-learn and scipy (the cascade, through
    engines/kinds.py) and SQLAlchemy with Alembic: seconds of every code-location load and command."""
    env = {
        **{name: value for name, value in os.environ.items() if name != "BATCH_ASSETS_TASKS_DIR"},
        "PYTHONPATH": str(REPO_ROOT),
        "DAGSTER_HOME": str(tmp_path / "home"),
        "BATCH_ASSETS_DATA": str(tmp_path / "data"),
    }
    script = f"HEAVY = {HEAVY_MODULES!r}\n{LOADS}"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"code": 0, "imported": []}
