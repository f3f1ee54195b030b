"""Size limits that keep the code base readable (issue 27, items 4 and 5): the command line stays
the command line, and a function fits on a screen or two. And a test file reads alone (issue 61 item 5):
what test modules share is in batch_assets_tests/support/ or conftest.py, not in another test module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batch_assets"
MAX_CLI_LINES = 300
MAX_FUNCTION_LINES = 80
TESTS = Path(__file__).resolve().parent

# Functions over the limit that are still to be split, by their owners' pending work; remove an
# entry when its function is split, so that it cannot grow back. Empty since the task formats
# (issue 27 item 2) split the asset and check factories, the drops sensor and the batch formatting.
KNOWN_LONG_FUNCTIONS: set[str] = set()


def function_lengths() -> dict[str, int]:
    """`<path under batch_assets>:<function>` (nested ones as `outer.inner`) -> its lines, decorators left out."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                lengths[f"{where}:{name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, where, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, where, f"{prefix}{child.name}.")
            else:
                visit(child, where, prefix)

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text(), filename=str(path)), path.relative_to(PACKAGE).as_posix(), "")
    return lengths


def test_cli_is_the_command_line_only() -> None:
    lines = len((PACKAGE / "cli.py").read_text().splitlines())
    assert lines < MAX_CLI_LINES, f"batch_assets/cli.py has {lines} lines; the work of a command belongs elsewhere"


def test_no_function_is_over_the_limit() -> None:
    lengths = function_lengths()
    too_long = {name: lines for name, lines in lengths.items() if lines > MAX_FUNCTION_LINES}
    offenders = sorted(
        f"{name} ({lines} lines)" for name, lines in too_long.items() if name not in KNOWN_LONG_FUNCTIONS
    )
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(offenders)}"
    # An allowed function that was split, moved or renamed leaves the list, so the list stays true.
    stale = sorted(KNOWN_LONG_FUNCTIONS - set(too_long))
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines (remove from KNOWN_LONG_FUNCTIONS): {stale}"


def imported_test_modules(path: Path) -> set[str]:
    """The test modules (`test_*`) of batch_assets_tests that `path` imports, at its top or in a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            # `from batch_assets_tests import test_x` and `from . import test_x` name the module in `names`.
            modules = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {module for module in modules if module.rpartition(".")[2].startswith("test_")}
    return found


def test_no_test_module_imports_another() -> None:
    importing = {
        path.relative_to(TESTS).as_posix(): sorted(modules)
        for path in sorted(TESTS.rglob("*.py"))
        if (modules := imported_test_modules(path))
    }
    assert not importing, (
        f"test files importing test modules (move what they share to batch_assets_tests/support/): {importing}"
    )
