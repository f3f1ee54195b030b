"""The Dagster instance at `$DAGSTER_HOME`, created and migrated by one process at a time.

Dagster's SQLite storages create their tables and stamp their schema revision on first use, and that
is not atomic: two commands started at once on a new home can leave `history/runs.db` with two
alembic heads (which `dagster instance migrate` cannot repair) or fail with "table runs already
exists". So every `batch-assets` command and `make ui` (`batch-assets ui`) copies `dagster.yaml` and
opens every storage once under an exclusive lock on `$DAGSTER_HOME/.batch_assets_setup.lock`; the
first one creates the tables, the others wait a moment and then find them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

# The instance settings for one machine; the repo root's dagster.yaml links here, and the wheel
# carries it, so an installed `batch-assets` sets up the same instance as a checkout.
INSTANCE_TEMPLATE = Path(__file__).resolve().parent.parent / "lib" / "dagster.yaml"
DEFAULT_DAGSTER_HOME = ".dagster_home"
SETUP_LOCK_NAME = ".batch_assets_setup.lock"


@contextmanager
def exclusive_file_lock(path: Path) -> Iterator[None]:
    """An exclusive `flock` on `path` (created if missing), released when the block (or the process)
    ends. flock belongs to the open file, so other threads of this process wait for it too."""
    try:
        # Writable for everyone the umask allows: a home shared by a daemon's user and a person's.
        descriptor = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    except PermissionError:  # created by another user: flock works on a read-only descriptor too
        descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing drops the lock


def home_lock(home: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive lock on the Dagster home's setup."""
    return exclusive_file_lock(home / SETUP_LOCK_NAME)


class DagsterHomeError(Exception):
    """`DAGSTER_HOME` names no folder a command can use (a file, or a place where none can be made)."""


def home_path() -> Path:
    """`DAGSTER_HOME` (default `.dagster_home/`) as an absolute path; nothing is created."""
    return Path(os.environ.get("DAGSTER_HOME") or DEFAULT_DAGSTER_HOME).expanduser().resolve()


def home_problem(home: Path) -> str | None:
    """Why `home` cannot be the Dagster home (None: it is a folder, or one can be made there), checked
    without creating anything."""
    if home.exists():
        if home.is_dir():
            return None
        return (
            f"DAGSTER_HOME={home} is a file, not a folder: point DAGSTER_HOME at a folder (one that does not "
            "exist yet is created)"
        )
    existing = next(parent for parent in home.parents if parent.exists())
    if not existing.is_dir():
        return f"DAGSTER_HOME={home} cannot be created: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"DAGSTER_HOME={home} cannot be created: {existing} is not writable here"
    return None


def dagster_home() -> Path:
    """`DAGSTER_HOME` (default `.dagster_home/`), created if missing and exported to this process;
    `DagsterHomeError` where it names no folder that can be used."""
    home = home_path()
    problem = home_problem(home)
    if problem is not None:
        raise DagsterHomeError(problem)
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DagsterHomeError(f"DAGSTER_HOME={home} cannot be created: {error.strerror or error}") from error
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def prepare_instance() -> Path:
    """Create `DAGSTER_HOME` with the bundled dagster.yaml and its storages, once, under the setup lock."""
    home = dagster_home()
    with home_lock(home):
        config = home / "dagster.yaml"
        if not config.exists():
            shutil.copyfile(INSTANCE_TEMPLATE, home / ".dagster.yaml.tmp")
            os.replace(home / ".dagster.yaml.tmp", config)
        with dg.DagsterInstance.get() as instance:
            _touch_storages(instance)
    return home


def open_instance() -> dg.DagsterInstance:
    """The instance at `DAGSTER_HOME`, its storages created and migrated (see module doc)."""
    prepare_instance()
    return dg.DagsterInstance.get()


def _touch_storages(instance: dg.DagsterInstance) -> None:
    # Each call opens one storage, which creates its tables on a new home.
    instance.get_runs(limit=1)
    instance.get_dynamic_partitions("batch_assets_setup")
    instance.all_instigator_state()
    if instance.event_log_storage.supports_global_concurrency_limits:
        instance.event_log_storage.get_concurrency_keys()
