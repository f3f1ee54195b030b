"""The arguments of `batch-assets` (cli.py): its commands, their options and their help."""

from __future__ import annotations

import argparse
import math

from batch_assets.serve.command import add_serve_parser, port_number


def build_parser() -> argparse.ArgumentParser:
    from batch_assets.pipeline.inputs.read_prompts import SUPPORTED_SUFFIXES

    parser = argparse.ArgumentParser(prog="batch-assets", description="Offline LLM batch inference as Dagster assets.")
    commands = parser.add_subparsers(dest="command", required=True)
    in_project = project_option()
    run = commands.add_parser(
        "run",
        parents=[in_project],
        help="run files through a task's pipeline",
        description=(
            "Copy each file into the task's drop zone, register it as a partition and materialize its assets "
            "and checks in this process (one engine start for all files); prints one summary line per file, naming "
            "every check that failed (ERROR and WARN). A file whose partition is materialized from the same file "
            "and code versions is UP TO DATE and runs nothing (--replace runs it again). Exit status: 0 when "
            "every file succeeded, 1 when one failed, "
            "failed an ERROR check (or, with --fail-on-warn, a WARN check) or had only error rows, 2 for a usage "
            "error (nothing run), 130 when interrupted."
        ),
    )
    run.add_argument("task", help="the task to run (its name as `batch-assets tasks` lists it)")
    run.add_argument(
        "files",
        nargs="+",
        help=f"input files ({', '.join(SUPPORTED_SUFFIXES)}); each is copied into the task's drop zone and becomes "
        "one partition named after the file",
    )
    run.add_argument(
        "--replace",
        action="store_true",
        help="run each file again even when it is UP TO DATE (its partition materialized from this file with the "
        "task's current code versions; add --no-result-cache to infer its rows again too), and let a file replace a "
        "different drop file of the same name (from another folder), with its outputs",
    )
    run.add_argument(
        "--fail-on-warn",
        action="store_true",
        help="exit 1 also when a check of WARN severity failed (accuracy, confidence, agreement, error share, label "
        "drift); without it those are named on the summary line and the exit status is 0",
    )
    commands.add_parser("tasks", parents=[in_project], help="list the tasks and their drop zones")
    demo = commands.add_parser("demo", help="run the bundled sample drops of every task")
    for command in (run, demo):
        command.add_argument(
            "--verbose", action="store_true", help="show Dagster's and the engine's logs and full tracebacks here too"
        )
        command.add_argument(
            "--no-result-cache",
            dest="use_result_cache",
            action="store_false",
            help="neither read nor write the task's result cache: infer every row (checkpoints still resume a run)",
        )
    doctor = commands.add_parser(
        "doctor",
        parents=[in_project],
        help="check what a first run needs here (instance, GPUs, models, storage, cluster), one line each",
        description=(
            "One line per check: OK, WARN, FAIL or SKIP, what was found and, for a problem, the setting to change. "
            "Run it on a laptop, in the code server's pod or in a run pod. Exit status: 0 when nothing a first run "
            "needs failed (WARN lines do not count), 1 otherwise."
        ),
    )
    doctor.add_argument("--verbose", action="store_true", help="print the traceback of a check that could not run")
    ui = commands.add_parser(
        "ui",
        parents=[in_project],
        help="start the Dagster UI and daemon (`dg dev`) on this DAGSTER_HOME; one per home",
        description="In a dg project: `dg dev` of that project, from its folder. Elsewhere: the bundled tasks' "
        "code location (workspace.yaml where the folder has one).",
    )
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ui.add_argument("--port", type=port_number, default=3000, help="port to listen on (default 3000)")
    ui.add_argument(
        "--workspace",
        help="Dagster workspace file (default: workspace.yaml where there is one, else the bundled code location)",
    )
    for add in (add_drop_parser, add_estimate_parser, add_serve_parser):
        add(commands, in_project)
    add_cache_parser(commands)
    return parser


def project_option() -> argparse.ArgumentParser:
    """`--project PATH`, the one definition of the option, shared by the commands that read tasks."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--project",
        type=folder_named,
        metavar="PATH",
        help="the dg project whose tasks to use (its folder or one inside it); default: the dg project the "
        "working folder is in (as `dg` finds it), else the bundled tasks",
    )
    return parent


def folder_named(text: str) -> str:
    """A folder argument: an empty one would name no folder, and the working folder be taken instead."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a folder (not an empty string)")
    return text


def add_drop_parser(commands, in_project: argparse.ArgumentParser) -> None:
    """`drop TASK FILE...`: what `run` does before it runs, for Dagster's own verbs to run the partitions."""
    drop = commands.add_parser(
        "drop",
        parents=[in_project],
        help="copy files into a task's drop zone and register their partitions, without running them",
        description="Copy each file into the task's drop zone and register its partition(s), as `run` does first; "
        "prints each partition and the `dg launch` line that materializes it (or let the drops sensor, or the UI's "
        "launchpad, run them).",
    )
    drop.add_argument("task", help="the task (its name as `batch-assets tasks` lists it)")
    drop.add_argument("files", nargs="+", help="input files; each becomes one partition named after the file")
    drop.add_argument(
        "--replace",
        action="store_true",
        help="let a file replace a different drop file of the same name (from another folder)",
    )


def add_estimate_parser(commands, in_project: argparse.ArgumentParser) -> None:
    """`estimate TASK FILE...`: what each file would cost, before it runs."""
    estimate = commands.add_parser(
        "estimate",
        parents=[in_project],
        help="rows, refused rows, tokens, cache hits and cost of files for a task, without running them",
        description="For each file, read and formatted as its run would: rows, rows refused before any engine "
        "(by error code), prompt tokens (the task's tokenizer, as the run counts prompt_tokens), the most generated "
        "tokens (rows x max_tokens) and the expected ones (from the task's earlier partitions), rows the result "
        "cache answers and, with engine.price, the cost at worst and expected (GPU-hours at the measured rows/s "
        "with engine.price.per_gpu_hour). Starts no engine, sends no request, copies nothing. Exit status 0, or 2 "
        "for a usage error.",
    )
    estimate.add_argument("task", help="the task (its name as `batch-assets tasks` lists it)")
    estimate.add_argument("files", nargs="+", help="input files, as `run` takes them")


def add_cache_parser(commands) -> None:
    """`cache prune` under the CLI's subcommands."""
    cache = commands.add_parser("cache", help="look after the tasks' result caches")
    actions = cache.add_subparsers(dest="cache_action", required=True, help="what to do with the caches")
    pruning = actions.add_parser(
        "prune",
        help="remove cached results by age and by task version (each task's `cache:` settings)",
        description="Remove cached results stored more than `cache.max_age_days` ago and those of fingerprints "
        "beyond a task's `cache.keep_fingerprints` latest; prints what was removed and each task's cache after.",
    )
    pruning.add_argument("--task", help="only this task (default: every task)")
    pruning.add_argument(
        "--older-than",
        type=days,
        metavar="DAYS",
        help="remove results older than this many days (0 or more; 0: every result), whatever max_age_days says",
    )


def days(text: str) -> float:
    """An age in days, 0 or more: a negative one dates the limit in the future (every result is older),
    NaN and infinity match nothing or everything alike."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of days, 0 or more (not {text})")
    return value
