"""`batch-assets serve`: one command starts the API, the batch runner and whatever a batch needs.

The server keeps its state under `$DAGSTER_HOME/serve` (store.py) and runs batches through
`batch-assets run` (batch_runs.py): no daemon or code server needs to be started besides it. One
server per home (a second is refused), bound to 127.0.0.1 unless told otherwise; bound to another
address it refuses to start without a key in `BATCH_ASSETS_SERVE_API_KEY`.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
from collections.abc import Callable

from batch_assets.serve.settings import (
    CHAT_TASK,
    DEFAULT_EXPIRY_SECONDS,
    DEFAULT_MAX_STORED_MB,
    EMBEDDINGS_TASK,
    SERVE_KEY_ENV,
    UploadLimits,
    is_loopback,
)

LOCK_NAME = ".serve.lock"


def command_serve(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    # Imported here: `batch-assets --help` stays quick.
    import uvicorn

    from batch_assets.runtime.instance import prepare_instance
    from batch_assets.serve.app import build_app
    from batch_assets.serve.batch_runs import BatchRunner
    from batch_assets.serve.store import ServeStore

    key = os.environ.get(SERVE_KEY_ENV) or None
    if key is None and not is_loopback(args.host):
        say(f"error: serving on {args.host} (not this machine only) needs a key: set {SERVE_KEY_ENV}")
        return 2
    # The tasks of the dg project the command stands in, else the bundled ones (`args.source`, set by
    # cli.py); each batch's `batch-assets run` starts in the same folder and finds the same.
    loaded = args.source.load_tasks().tasks
    known = {task.name for task in loaded}
    if missing := [name for name in (args.task, args.embeddings_task) if name not in known]:
        say(f"error: unknown task {missing[0]!r} (--task / --embeddings-task); tasks: {', '.join(sorted(known))}")
        return 2
    home = prepare_instance()
    store = ServeStore(home / "serve", expiry_seconds=max(1, int(args.file_expiry_days * 86_400)))
    lock = (store.root / LOCK_NAME).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        say(f"error: a batch-assets serve already runs on {home}; stop it before starting another")
        return 2
    tasks = {"/v1/chat/completions": args.task, "/v1/completions": args.task, "/v1/embeddings": args.embeddings_task}
    # A batch whose lines name a task's LoRA adapter as their model runs that task (engine.lora).
    adapters = {
        task.engine.lora.served_name(): task.name
        for task in loaded
        if task.engine.lora is not None and task.input.format == "openai_batch"
    }
    runner = BatchRunner(store, tasks, adapters)
    limits = UploadLimits(
        max_bytes=int(args.max_file_mb * 1024 * 1024),
        max_requests=args.max_requests,
        max_stored_bytes=int(args.max_stored_mb * 1024 * 1024),
    )
    app = build_app(store, runner, limits, key, host=args.host)
    runner.start()
    say(
        f"OpenAI Files and Batches API at http://{args.host}:{args.port}/v1 "
        f"({'bearer key required' if key else 'no key'}); state in {store.root}; runs in the Dagster UI of {home}"
    )
    try:
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")).run()
    finally:
        runner.stop()
    return 0


def positive(text: str) -> float:
    """A size or a number of days, more than 0 and finite (`nan` and `inf` are refused by argparse,
    with its usage line, as `cli_parser.days` refuses them)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number more than 0 (not {text})")
    return value


def port_number(text: str) -> int:
    """A TCP port, 1 to 65535: the socket layer would take 99999 modulo 65536 and 0 as "any free port",
    and the command would name a port it does not listen on."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535 (not {text})")
    return value


def add_serve_parser(commands, in_project) -> None:
    """`serve` under the CLI's subcommands; `in_project`: the parser of the `--project` option."""
    serve = commands.add_parser(
        "serve",
        parents=[in_project],
        help="serve OpenAI's Files and Batches API; each batch runs as a partition of the openai_batch task",
        description=(
            "POST /v1/files, GET /v1/files/{id}[/content], POST /v1/batches, GET /v1/batches[/{id}], "
            "POST /v1/batches/{id}/cancel. Batches run one at a time through `batch-assets run` (in the "
            "Dagster UI of this DAGSTER_HOME) and survive a restart. Bound elsewhere than this machine, it "
            f"needs a key in {SERVE_KEY_ENV} (clients send it as their API key)."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--max-file-mb", type=positive, default=200.0, help="largest upload in MB (default 200, as OpenAI)"
    )
    serve.add_argument(
        "--max-requests", type=int, default=50_000, help="most lines in a batch file (default 50000, as OpenAI)"
    )
    serve.add_argument(
        "--max-stored-mb",
        type=positive,
        default=DEFAULT_MAX_STORED_MB,
        help=f"most MB of files kept, uploads and outputs together (default {DEFAULT_MAX_STORED_MB})",
    )
    serve.add_argument(
        "--file-expiry-days",
        type=positive,
        default=DEFAULT_EXPIRY_SECONDS / 86_400,
        help="days a file is kept unless its upload (expires_after) or batch (output_expires_after) says "
        "otherwise; its batch's partition goes with it (default 30, as OpenAI)",
    )
    serve.add_argument("--task", default=CHAT_TASK, help="task for chat and completions batches")
    serve.add_argument("--embeddings-task", default=EMBEDDINGS_TASK, help="task for /v1/embeddings batches")
