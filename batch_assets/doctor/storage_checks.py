"""Drops, outputs and the result cache: each location readable and writable (a marker file or object
written and deleted), each result cache store reachable, with its size."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import sqlalchemy as sa
from upath import UPath

from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.instance_checks import CONNECT_TIMEOUT_S, cause_line, storage_setting
from batch_assets.doctor.report import Check, fail, ok, skip, warn
from batch_assets.storage.errors import StorageError, scrub, storage_errors
from batch_assets.storage.locations import DATA_ENV, data_root, is_local, storage_root, task_storage_dir
from batch_assets.storage.result_cache import RESULTS, URL_ENV, cache_url, create_database_engine, instance_postgres_url

MARKER_PREFIX = ".batch_assets_doctor-"
S3_SETTINGS = "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"


def check_locations(ctx: DoctorContext) -> Iterator[Check]:
    try:
        root = data_root()
    except ValueError as error:
        yield fail("data", str(error), DATA_ENV)
        return
    yield location_check("drops", root / "drops")
    yield location_check("outputs", storage_root())


def location_check(label: str, path: UPath) -> Check:
    """List the folder, write a marker into it and delete the marker."""
    name = f"{label} location"
    url = scrub(str(path))
    setting = DATA_ENV if is_local(path) else f"{DATA_ENV}, {S3_SETTINGS}"
    try:
        entries = _write_and_delete_marker(path)
    except StorageError as error:
        return fail(name, str(error), setting)
    except OSError as error:  # not a storage failure by `storage_errors`' account, e.g. a path under a file
        return fail(name, f"{url}: {error}", setting)
    return ok(name, f"{url}: readable and writable ({entries} entries)")


def _write_and_delete_marker(path: UPath) -> int:
    marker = path / f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    with storage_errors("listing", path):
        if is_local(path):
            path.mkdir(parents=True, exist_ok=True)
        entries = len(list(path.iterdir())) if path.exists() else 0
    with storage_errors("writing", marker):
        marker.write_bytes(b"batch-assets doctor\n")
    with storage_errors("deleting", marker):
        marker.unlink()
    return entries


def check_result_cache(ctx: DoctorContext) -> Iterator[Check]:
    name = "result cache"
    if ctx.instance is None:
        yield skip(name, "the instance did not open (above)")
        return
    urls = sorted({cache_url(task_storage_dir(task.name), ctx.instance) for task in ctx.tasks.tasks})
    if not urls:
        yield skip(name, "no task loaded")
        return
    rows = size = stores = 0
    for url in urls:
        where = sa.make_url(url).render_as_string(hide_password=True)
        try:
            found = store_size(url)
        except sqlite3.DatabaseError as error:
            yield warn(
                name, f"{where} is damaged ({error}): the next run sets it aside and starts an empty one", URL_ENV
            )
            continue
        except StorageError as error:  # its driver is not installed
            yield fail(name, str(error), _cache_setting(ctx))
            return
        except (sa.exc.SQLAlchemyError, OSError) as error:
            yield fail(name, f"{where}: {cause_line(error)}", _cache_setting(ctx))
            return
        if found is not None:
            stores += 1
            rows, size = rows + found[0], size + found[1]
    kind = "SQLite, one file per task" if urls[0].startswith("sqlite") and len(urls) > 1 else where
    yield ok(name, f"{kind}: {stores} of {len(urls)} created, {rows:,} rows, {size / 1e6:.1f} MB")


def _cache_setting(ctx: DoctorContext) -> str:
    if ctx.env.get(URL_ENV):
        return URL_ENV
    if instance_postgres_url(ctx.instance):
        return f"{URL_ENV}, or the instance's {storage_setting(ctx)}"
    return f"{DATA_ENV}, or {URL_ENV}"


def store_size(url: str) -> tuple[int, int] | None:
    """(rows, bytes) of the result cache at `url`; None when it does not exist yet (a first run
    creates it). Reads only: no table or file is created."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_size(Path(parsed.database or ""))
    arguments = {"connect_timeout": CONNECT_TIMEOUT_S} if parsed.get_backend_name() == "postgresql" else {}
    engine = create_database_engine(url, connect_args=arguments)
    try:
        with engine.connect() as connection:
            if not sa.inspect(connection).has_table(RESULTS.name):
                return None
            rows = connection.execute(sa.select(sa.func.count()).select_from(RESULTS)).scalar_one()
            size = 0
            if engine.dialect.name == "postgresql":
                size = connection.execute(
                    sa.text("SELECT pg_total_relation_size(:t)"), {"t": RESULTS.name}
                ).scalar_one()
            return int(rows), int(size)
    finally:
        engine.dispose()


def _sqlite_size(path: Path) -> tuple[int, int] | None:
    if not path.is_file():
        return None
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as database:
        tables = database.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        if (RESULTS.name,) not in tables:
            return None
        rows = database.execute(f"SELECT count(*) FROM {RESULTS.name}").fetchone()[0]
    size = sum(part.stat().st_size for part in (path, Path(f"{path}-wal")) if part.exists())
    return int(rows), size
