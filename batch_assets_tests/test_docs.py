"""The docs: the site builds with warnings as errors, links resolve, samples run, the layout matches.

README.md is the newcomer's page; mkdocs.yml builds the reference from docs/. A ```python block in
a page runs here when the line before it is `<!-- runnable -->`; one that needs a GPU, an endpoint
or a cluster says so with `<!-- not runnable: REASON -->` and is reported as skipped by page, so no
sample is left out silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from batch_assets_tests.support import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
SAMPLE = re.compile(r"^<!-- (runnable|not runnable: ([^>]+)) -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
BARE_SAMPLE = re.compile(r"(?<!-->\n)^```python$", re.MULTILINE)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _text(path: Path) -> str:
    """A page as mkdocs renders it: `--8<--` snippet lines replaced by the repo file they name."""
    return SNIPPET.sub(lambda m: (REPO_ROOT / m[1]).read_text(encoding="utf-8"), path.read_text(encoding="utf-8"))


def _anchors(path: Path) -> set[str]:
    headings = HEADING.findall(FENCE.sub("", _text(path)))
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in headings}


def _links(path: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", _text(path))) if not re.match(r"[a-z]+:", target)]


def test_mkdocs_builds_strict(tmp_path):
    """Broken links and anchors, pages missing from the nav or a missing snippet fail the build."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "tasks" / "index.html").is_file()


@pytest.mark.parametrize("page", [REPO_ROOT / "README.md", *PAGES], ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_resolve(page):
    """Every relative link names an existing file and, after `#`, a heading of that file."""
    broken = []
    for target in _links(page):
        path_part, _, anchor = target.partition("#")
        target_path = (page.parent / path_part).resolve() if path_part else page
        if not target_path.exists():
            broken.append(f"{target}: no file {target_path}")
        elif anchor and target_path.suffix == ".md" and anchor not in _anchors(target_path):
            broken.append(f"{target}: no heading '{anchor}' in {target_path.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_python_sample_is_marked():
    """A ```python block without a marker would be neither run nor reported."""
    unmarked = [
        f"{page.name} line {_line(page.read_text(), m.start())}"
        for page in PAGES
        for m in BARE_SAMPLE.finditer(page.read_text())
    ]
    assert not unmarked, f"mark these samples `<!-- runnable -->` or `<!-- not runnable: why -->`: {unmarked}"


SAMPLES = [
    pytest.param(marker, reason, code, id=f"{page.name}:{_line(page.read_text(), m.start())}")
    for page in PAGES
    for m in SAMPLE.finditer(page.read_text())
    for marker, reason, code in [m.groups()]
]


# A fresh interpreter importing Dagster per sample: several seconds each.
@pytest.mark.slow
@pytest.mark.parametrize(("marker", "reason", "code"), SAMPLES)
def test_python_sample_runs(marker, reason, code, tmp_path):
    """Each runnable sample in a fresh process, with its own data folder and Dagster home."""
    if marker != "runnable":
        pytest.skip(f"not runnable: {reason}")
    env = {**os.environ, "BATCH_ASSETS_DATA": str(tmp_path / "data"), "DAGSTER_HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _layout_block() -> str:
    block = re.search(r"^```\n(.*?)^```$", (DOCS / "layout.md").read_text(), re.MULTILINE | re.DOTALL)
    assert block, "docs/layout.md has no layout block"
    return block[1]


def _layout_paths() -> list[str]:
    """Paths the layout block names: its first column (nested by indent) and each package's modules."""
    paths: list[str] = []
    top = package = ""
    for line in _layout_block().splitlines():
        indent, name, description = re.match(r"( *)(\S*)\s*(.*)", line).groups()  # type: ignore[union-attr]
        if len(indent) > 2:  # the description of the entry above goes on
            description = name + " " + description
        elif indent:
            paths.append(top + name)
            package = top + name if name.endswith("/") else ""
        else:
            paths.append(name)
            top = package = name if name.endswith("/") else ""
        paths += _modules(package, description) if package else []
    return paths


def _modules(package: str, description: str) -> list[str]:
    """Module names in a package's description (in it or a package of it): snake_case words;
    `name(_suffix)` means both.

    Words in backticks (functions, commands) are not module names.
    """
    names = []
    for word, suffix in re.findall(
        r"\b([a-z0-9]+(?:_[a-z0-9]+)+(?:\.[a-z]+)?)(?:\((_[a-z0-9_]+)\))?", re.sub(r"`[^`\n]*`", "", description)
    ):
        names += [package + "**/" + word, *([package + "**/" + word + suffix] if suffix else [])]
    return names


def test_layout_names_only_paths_that_exist():
    missing = []
    for name in _layout_paths():
        pattern = re.sub(r"<[^>]+>", "*", name.rstrip("/"))
        if not any(REPO_ROOT.glob(pattern)) and not any(REPO_ROOT.glob(pattern + ".py")):
            missing.append(name)
    assert not missing, f"docs/layout.md names paths that do not exist: {missing}"


def test_layout_names_every_package_and_module():
    """The other way round: a module added to batch_assets/ (or a top-level folder) is named there."""
    block = re.sub(r"`[^`\n]*`", "", _layout_block())
    block = re.sub(r"(\w+)\((_\w+)\)", r"\1 \1\2", block)  # openai_batch(_output) names both
    names = [p.name for p in (REPO_ROOT / "batch_assets").iterdir() if not p.name.startswith(("_", "."))]
    names += [p.stem for p in (REPO_ROOT / "batch_assets").glob("*/*.py") if p.stem != "__init__"]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    names += sorted({path.split("/")[0] + "/" for path in tracked.splitlines() if "/" in path and path[0] != "."})
    unnamed = sorted(
        {
            name
            for name in names
            if not re.search(rf"(?<![\w/]){re.escape(name)}" + ("" if name.endswith("/") else r"(?!\w)"), block)
        }
    )
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"


def test_benchmarks_cite_raw_outputs_that_exist():
    """BENCHMARKS.md cites each file under bench/results/, and every file it cites is there."""
    text = (REPO_ROOT / "BENCHMARKS.md").read_text()
    cited = set(re.findall(r"bench/results/[\w.-]+", text))
    kept = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "bench" / "results").iterdir()}
    assert cited == kept, f"cited, not kept: {sorted(cited - kept)}; kept, never cited: {sorted(kept - cited)}"
    assert not re.search(r"^#.*\bissue \d+", text, re.MULTILINE | re.IGNORECASE), "a heading cites a tracker number"


# A section cited by name in text a user reads (the demo's closing note, dagster.yaml's comments):
# `README "Section"`, `README section "Section"`, `docs/page.md "Section"`.
CITATION = re.compile(r'\b(README|docs/[\w-]+\.md)(?: section)?,? "([^"\n]+)"')


def test_sections_cited_by_name_exist_where_they_are_cited() -> None:
    """Issue 56.16: the demo's closing note sent readers to a README section that is in docs/outputs.md."""
    files = [*sorted((REPO_ROOT / "batch_assets").rglob("*.py")), *sorted((REPO_ROOT / "batch_assets").rglob("*.yaml"))]
    citations = [
        (path.relative_to(REPO_ROOT).as_posix(), page, section)
        for path in files
        for page, section in CITATION.findall(path.read_text(encoding="utf-8"))
    ]
    assert any(path == "batch_assets/app/runner.py" for path, _, _ in citations)  # the demo's note is read
    missing = [
        f"{path} cites {page} {section!r}"
        for path, page, section in citations
        if slugify(section, "-") not in _anchors(REPO_ROOT / ("README.md" if page == "README" else page))
    ]
    assert not missing, missing


def test_the_doctor_exit_status_reads_the_same_in_its_help_and_in_the_docs(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56.16: docs/cli.md said `doctor` exits 0 only when every check passes; it exits 1 only
    for a FAIL line (doctor/report.py `exit_status`), as its --help says: WARN lines do not count."""
    from batch_assets.cli_parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["doctor", "--help"])
    assert "(WARN lines do not count)" in " ".join(capsys.readouterr().out.split())
    [row] = [line for line in (DOCS / "cli.md").read_text().splitlines() if line.startswith("| `batch-assets doctor`")]
    assert "exit 0 unless a check FAILs: WARN and SKIP lines do not count" in row
