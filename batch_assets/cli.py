"""`batch-assets`: the command line (arguments, terminal output, exit status) of the pipeline.

    batch-assets run TASK FILE...   copy each file into TASK's drop zone, register its partition and
                                    materialize its four assets and checks; one summary line each
    batch-assets drop TASK FILE...  what `run` does before running: copy into the drop zone, register
                                    the partitions (for `dg launch`, the launchpad or the sensor to run)
    batch-assets tasks              the tasks and their drop zones
    batch-assets estimate TASK FILE...  rows, tokens and cost of each file, before running it
    batch-assets demo               the bundled sample drops of every task, skipping partitions
                                    that already succeeded with the same file
    batch-assets ui                 the Dagster UI and daemon (`dg dev`) on DAGSTER_HOME, one per home
    batch-assets doctor             what a first run needs, one line per check with the setting to change
    batch-assets cache prune        prune the result caches by age and task version
    batch-assets serve              OpenAI's Files and Batches API; each batch a partition of openai_batch

The terminal shows one line per file and progress lines; the engine's and libraries' output goes to
the run's log (and `$DAGSTER_HOME/logs/`), tracebacks too (`--verbose` shows everything). The work of
`run` and `demo` is app/runner.py's, imported when needed so that `--help` stays quick; that of
`tasks` and `cache` is app/commands.py's.

`run`, `drop`, `tasks`, `doctor`, `ui` and `serve` work on the tasks of the dg project the working folder is
in (or `--project PATH` names), from that project's folder; elsewhere on the bundled tasks
(app/projects.py).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from batch_assets.app.commands import command_cache, command_drop, command_tasks, command_ui
from batch_assets.app.projects import BUNDLED, ProjectRefused, TaskSource, enter_project
from batch_assets.cli_parser import build_parser
from batch_assets.runtime.instance import DagsterHomeError, dagster_home
from batch_assets.runtime.interrupts import STOPPED, watch_stop_signals
from batch_assets.runtime.process_exit import exit_without_teardown

if TYPE_CHECKING:
    import argparse

    from batch_assets.app.run_outcomes import PartitionOutcome
    from batch_assets.app.runner import RunReporter


class Terminal:
    """Where the CLI's own lines go. While partitions run, the process's stdout and stderr (engine
    logs, warnings of libraries) go to a log file instead, so the terminal shows only these lines."""

    def __init__(self) -> None:
        self.stream: TextIO | None = None  # None: whatever sys.stdout is now
        self.verbose = False
        self.log_path: Path | None = None
        self.line_open = False  # a progress line is being updated in place (terminals only)

    @property
    def out(self) -> TextIO:
        return self.stream or sys.stdout

    def say(self, text: str) -> None:
        if self.line_open:
            text = "\n" + text
            self.line_open = False
        print(text, file=self.out, flush=True)

    def update(self, text: str) -> None:
        """A progress line: rewritten in place on a terminal, one line each otherwise."""
        if not self.out.isatty():
            self.say(text)
            return
        self.out.write(f"\r\033[K{text}")
        self.out.flush()
        self.line_open = True

    @contextmanager
    def library_output_to(self, log_path: Path):
        if self.verbose:
            yield
            return
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        saved_out, saved_err = os.dup(1), os.dup(2)
        self.stream = os.fdopen(os.dup(saved_out), "w", buffering=1)
        self.log_path = log_path
        with log_path.open("a") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            self.stream.close()
            self.stream = None


TERMINAL = Terminal()

_PROGRESS = re.compile(r"inferred (\d+)/(\d+) requests \((\d+)%\), ([\d.]+) rows/s")
_STARTING = re.compile(r"^(\d+) requests to infer|^reusing .*requests left to infer")
# Warnings the user must see without opening the run's log: a damaged result cache set aside, token
# counts that are approximate (an endpoint without a local tokenizer).
_NOTICES = re.compile(r"^the result cache .* is damaged|^task \S+: no local tokenizer for the endpoint's model")


class _ProgressHandler(logging.Handler):
    """Turns run_inference's progress lines into one short line per update on the terminal, and shows
    the few warnings that change what a run does or what its figures mean (`_NOTICES`)."""

    def __init__(self, label: str):
        super().__init__(logging.INFO)
        self.label = label

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "dagster_meta", None) or {}
        message = str(meta.get("orig_message") or record.getMessage())
        match = _PROGRESS.search(message)
        if match:
            done, total, percent, rate = int(match[1]), int(match[2]), match[3], float(match[4])
            left = f", {_time_left((total - done) / rate)}" if rate > 0 and done < total else ""
            text = f"  {self.label}: {done}/{total} requests ({percent}%), {rate:.1f} rows/s{left}"
            TERMINAL.update(text)
        elif _STARTING.search(message):
            TERMINAL.say(f"  {self.label}: {message}")
        elif _NOTICES.search(message):
            TERMINAL.say(f"  {self.label}: warning: {message}")


def _time_left(seconds: float) -> str:
    whole = int(round(seconds))
    duration = f"{whole // 60} min {whole % 60} s" if whole >= 60 else f"{whole} s"
    return "under 1 s left" if seconds < 1 else f"about {duration} left"


def _reporter() -> RunReporter:
    """Runs report here: notes and progress lines on the terminal, each call's outcomes as summary lines."""
    from batch_assets.app.runner import RunReporter

    return RunReporter(
        say=TERMINAL.say, files_done=_print_outcomes, run_log_handler=_ProgressHandler, console_log=TERMINAL.verbose
    )


def _print_outcomes(outcomes: list[PartitionOutcome]) -> None:
    if TERMINAL.log_path and any(not outcome.ok for outcome in outcomes):
        TERMINAL.say(f"engine and library output of this command: {TERMINAL.log_path}")
    from batch_assets.app.run_outcomes import usage_total_line

    for outcome in outcomes:
        TERMINAL.say(outcome.line())
    if total := usage_total_line(outcomes):
        TERMINAL.say(total)


def command_run(
    task_name: str,
    files: list[str],
    *,
    replace: bool = False,
    use_result_cache: bool = True,
    fail_on_warn: bool = False,
    source: TaskSource = BUNDLED,
) -> int:
    from batch_assets.app.runner import run_partitions

    outcomes = run_partitions(
        task_name,
        [Path(f) for f in files],
        # `--replace` runs a file again whatever it was run from before.
        skip_up_to_date=not replace,
        replace=replace,
        reporter=_reporter(),
        use_result_cache=use_result_cache,
        source=source,
    )
    return 0 if all(outcome.passed(fail_on_warn=fail_on_warn) for outcome in outcomes) else 1


def command_demo(*, use_result_cache: bool = True) -> int:
    from batch_assets.app.runner import demo_note, run_demo
    from batch_assets.pipeline.task_spec import load_tasks

    loaded = load_tasks()
    for error in loaded.errors:
        print(f"ERROR: task {error.name!r} not loaded: {error.message}", file=sys.stderr)
    all_ok = run_demo(loaded.tasks, _reporter(), use_result_cache=use_result_cache)
    note = demo_note(loaded.tasks)
    if note:
        TERMINAL.say(note)
    return 0 if all_ok and not loaded.errors else 1


def _command_run_or_demo(args: argparse.Namespace) -> int:
    if args.command == "run":
        return command_run(
            args.task,
            args.files,
            replace=args.replace,
            use_result_cache=args.use_result_cache,
            fail_on_warn=args.fail_on_warn,
            source=args.source,
        )
    return command_demo(use_result_cache=args.use_result_cache)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    TERMINAL.verbose = getattr(args, "verbose", False)
    # SIGTERM stops the command like Ctrl-C does (a run being executed is then marked failed).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        args.source = enter_project(args)
        if args.command == "tasks":
            return command_tasks(args.source)
        if args.command == "ui":
            return command_ui(args.host, args.port, args.workspace, args.source, TERMINAL.say)
        if args.command == "drop":
            return command_drop(args, TERMINAL.say)
        if args.command == "doctor":
            from batch_assets.doctor.run import run_doctor

            return run_doctor(TERMINAL.say, verbose=TERMINAL.verbose, source=args.source)
        if args.command == "cache":
            return command_cache(args, TERMINAL.say)
        if args.command == "estimate":
            from batch_assets.app.estimate_command import command_estimate

            return command_estimate(args, TERMINAL.say)
        if args.command == "serve":
            from batch_assets.serve.command import command_serve

            return command_serve(args, TERMINAL.say)
        watch_stop_signals(TERMINAL.say)
        # Until the command ends (the engine stops last), library output goes to the log file.
        log_path = dagster_home() / "logs" / f"batch-assets-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        with TERMINAL.library_output_to(log_path):
            code = _command_run_or_demo(args)
        # The console script (no argv given) leaves without the interpreter's teardown (~2 s once vLLM is in).
        return exit_without_teardown(code) if argv is None else code
    except KeyboardInterrupt:
        TERMINAL.say(STOPPED)
        return 130
    except Exception as error:  # noqa: BLE001 - the user gets one line; the details go to a log file
        if _is_refusal(error):
            TERMINAL.say(f"error: {error}")
            return 2
        return _unexpected(error)


def _is_refusal(error: Exception) -> bool:
    """A problem the user can fix, found before anything ran (exit status 2): a dg project that gives no
    tasks, a DAGSTER_HOME that names no usable folder, or one of the runner's refusals (when it raised
    one it is imported already, so other commands' errors do not import it)."""
    runner = sys.modules.get("batch_assets.app.runner")
    return isinstance(error, ProjectRefused | DagsterHomeError) or (
        runner is not None and isinstance(error, runner.REFUSALS)
    )


def _unexpected(error: BaseException) -> int:
    from batch_assets.app.error_causes import error_line

    if TERMINAL.verbose:
        traceback.print_exc()
    else:
        log = _log_folder() / f"batch-assets-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
    where = "" if TERMINAL.verbose else f" (traceback: {log}; or run with --verbose)"
    TERMINAL.say(f"error: {error_line(error)}{where}")
    return 1


def _log_folder() -> Path:
    """Where a traceback is kept: the home's `logs/`, or the temporary folder where the home is unusable."""
    try:
        return dagster_home() / "logs"
    except DagsterHomeError:
        return Path(tempfile.gettempdir())


if __name__ == "__main__":
    sys.exit(main())
