"""Result cache: outputs of deterministic decoding, reused across partitions and re-runs.

A cached result is keyed by `request_key` (the hash of the full prompt text the model sees) under
the same fingerprint as the checkpoints (model and its weights, dtype, engine seed, context length,
sampling params, output constraint), so it is only reused where the engine would give the same
answer. Only deterministic decoding (temperature 0, or a fixed seed) is cached, and only results
that finished without an error.

The cache is a table in a SQL database, so a lookup reads only the keys it asks for (an index
lookup each) and an add writes only its new rows: their cost grows with the partition, never with
the cache, however long a backfill runs. Where it lives:

- `BATCH_ASSETS_RESULT_CACHE_URL` (a SQLAlchemy URL) when set;
- else, when the Dagster instance keeps its runs in Postgres (deploy/: a cluster, several
  machines), that database, shared by every run pod with nothing to configure;
- else, with local storage, SQLite in the task's storage folder,
  `<data>/storage/<task>/_result_cache/results.sqlite3` (delete `_result_cache/` to drop the cache);
- else (storage on S3 without that URL), SQLite next to the Dagster instance,
  `$DAGSTER_HOME/result_cache/<task>.sqlite3`: one cache per machine.

Many writers at once are safe: rows are only ever inserted, a key already present is left as it is
(`ON CONFLICT DO NOTHING`, the same result under the same fingerprint), and SQLite runs in WAL mode
with a busy timeout so concurrent runs on one machine wait for each other's short transactions.
A store that is down or full fails the step with a `StorageError` naming it and the setting to
change; the partition's checkpoints still hold every row inferred, so a re-run infers nothing again.
A SQLite file that is not a database or is damaged is set aside as `<name>.corrupt-<time>` (its
WAL with it), with a warning naming both, and the run goes on with a fresh, empty cache there.
A store this process may not write (a read-only SQLite file or folder, `?mode=ro` in a `file:` URI,
a Postgres role without INSERT or ALTER, a standby) is read as it is, columns of later versions it
lacks as null, and written nothing, with one warning per cache naming it and the setting.

Caches of earlier versions (`_result_cache/<fingerprint>/part-*.parquet`) are imported into the
table the first time their fingerprint is used, then removed.

Materialize `inference_outputs` with `use_result_cache: false` (`batch-assets run --no-result-cache`)
to bypass the cache once.

Each row records when it was stored (`created_at`), and each task the fingerprints it used and when
it last used each (`batch_assets_result_cache_versions`), so that storage/cache_retention.py can
remove rows by age and fingerprints a task no longer uses (`batch-assets cache prune`). A table made
before those existed gets the column on first use, its rows dated then.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from threading import Lock
from typing import Any, TypeVar

import polars as pl
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from upath import UPath

from batch_assets.pipeline.result_stores import RESULT_SCHEMA
from batch_assets.runtime.instance import exclusive_file_lock
from batch_assets.storage.checkpoints import conform_results, remove_path
from batch_assets.storage.errors import StorageError, scrub
from batch_assets.storage.locations import DATA_ENV, data_root, is_local

URL_ENV = "BATCH_ASSETS_RESULT_CACHE_URL"
SQLITE_NAME = "results.sqlite3"
# Keys per `IN (…)` query and rows per insert: under SQLite's bound-parameter limit (32,766), and
# large enough that a 100,000-row partition is a few dozen round trips to Postgres.
KEYS_PER_QUERY = 2_000
ROWS_PER_INSERT = 5_000

_METADATA = sa.MetaData()
RESULTS = sa.Table(
    "batch_assets_result_cache",
    _METADATA,
    sa.Column("fingerprint", sa.String(64), primary_key=True),
    sa.Column("request_key", sa.String(64), primary_key=True),
    sa.Column("generated_text", sa.Text),
    sa.Column("finish_reason", sa.String(32)),
    sa.Column("num_prompt_tokens", sa.BigInteger),
    sa.Column("num_generated_tokens", sa.BigInteger),
    sa.Column("cumulative_logprob", sa.Float),
    sa.Column("created_at", sa.BigInteger),  # POSIX seconds
    sa.Column("token_logprobs", sa.Text),  # an OpenAI batch line's per-token log-probabilities, as JSON
    # The key is the row: no separate rowid b-tree in SQLite (half the size, one lookup per key).
    sqlite_with_rowid=False,
)
# Which task used which fingerprint, last when: what `keep_fingerprints` counts (one database may
# hold several tasks' caches, and two tasks with the same settings share a fingerprint).
VERSIONS = sa.Table(
    "batch_assets_result_cache_versions",
    _METADATA,
    sa.Column("task", sa.String(200), primary_key=True),
    sa.Column("fingerprint", sa.String(64), primary_key=True),
    sa.Column("last_used", sa.BigInteger, nullable=False),
)
_VALUE_COLUMNS = [column.name for column in RESULTS.columns if column.name not in ("fingerprint", "created_at")]

_engines: dict[str, sa.Engine] = {}
# Per URL, as this process found its store: the results table's columns (a table of an earlier
# version that could not be given the later ones lacks them), and why it may not write there (a
# read-only SQLite file, a Postgres role without ALTER or INSERT), if so. Reads go on; writes stop.
_columns: dict[str, frozenset[str]] = {}
_read_only: dict[str, str] = {}
_SQLITE_READONLY = 8
_PG_REFUSED = {"42501", "25006"}
_engines_lock = Lock()
# SQLite's primary result codes of a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB.
_CORRUPT_CODES = {11, 26}
_CORRUPT_TEXTS = ("database disk image is malformed", "file is not a database")
T = TypeVar("T")


def cache_url(task_dir: UPath, instance: object | None = None) -> str:
    """Where the cache of the task stored in `task_dir` lives (see the module docstring)."""
    if url := os.environ.get(URL_ENV):
        return url
    if postgres := instance_postgres_url(instance):
        _remember_token_provider(postgres, instance)
        return postgres
    if is_local(task_dir):
        return f"sqlite:///{Path(task_dir.path) / '_result_cache' / SQLITE_NAME}"
    home = Path(os.environ.get("DAGSTER_HOME") or ".dagster_home").expanduser().resolve()
    return f"sqlite:///{home / 'result_cache' / f'{task_dir.name}.sqlite3'}"


def shown_url(url: str) -> str:
    """The URL with its password hidden."""
    return sa.make_url(url).render_as_string(hide_password=True)


def instance_postgres_url(instance: object | None) -> str | None:
    """The Postgres database of a Dagster instance whose runs live there (dagster-postgres' run
    storage keeps its URL as `postgres_url`), else None."""
    storage = getattr(instance, "run_storage", None)
    url = getattr(storage, "postgres_url", None)
    return url if isinstance(url, str) else None


# The instance's database credentials where dagster-postgres fetches them per connection (a cloud's
# workload identity, `PgTokenProvider`): the cache's engine connects as the instance's storage does.
_token_providers: dict[str, object] = {}


def _remember_token_provider(url: str, instance: object | None) -> None:
    # dagster-postgres keeps it as a private attribute of its storages, with no public accessor;
    # batch_assets_tests/test_result_cache.py checks the attribute is still there.
    provider = getattr(getattr(instance, "run_storage", None), "_token_provider", None)
    if provider is not None:
        _token_providers[url] = provider


def cache_engine(url: str) -> sa.Engine:
    """The engine of the cache at `url`, its tables made (one per URL and process)."""
    return _engine(url)


def _engine(url: str) -> sa.Engine:
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _create_engine(url)
        return engine


def _forget_engine(url: str) -> None:
    with _engines_lock:
        engine = _engines.pop(url, None)
        _columns.pop(url, None)
        _read_only.pop(url, None)
    if engine is not None:
        engine.dispose()


def _create_engine(url: str) -> sa.Engine:
    parsed = sa.make_url(url)
    if parsed.get_backend_name() != "sqlite" and url in _token_providers:
        from dagster_postgres.utils import create_pg_engine

        engine = create_pg_engine(url, _token_providers[url], pool_pre_ping=True)  # type: ignore[arg-type]
    elif parsed.get_backend_name() != "sqlite":
        engine = create_database_engine(url, pool_pre_ping=True)
    else:
        path = sqlite_file(url)
        if path is not None and parsed.query.get("mode") != "ro":
            path.parent.mkdir(parents=True, exist_ok=True)
        # A writer holds SQLite's lock for one short insert; another run waits for it, not fails.
        engine = create_database_engine(url, connect_args={"timeout": 120})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    for table in (RESULTS, VERSIONS):
        try:
            table.create(engine, checkfirst=True)
        except sa.exc.SQLAlchemyError as exc:
            # Two processes creating the table at once: one wins, and the other finds it made.
            if sa.inspect(engine).has_table(table.name):
                continue
            if not write_refused(exc):
                raise
            _read_only.setdefault(url, driver_line(exc))
    _add_later_columns(url, engine)
    return engine


# The package to install for each database driver module a SQLAlchemy URL may name.
_DRIVER_PACKAGES = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "pg8000": "pg8000",
    "asyncpg": "asyncpg",
    "MySQLdb": "mysqlclient",
    "pymysql": "PyMySQL",
}


def create_database_engine(url: str, **arguments: Any) -> sa.Engine:
    """`sa.create_engine`, where a driver that is not installed is a `StorageError` naming the cache,
    the setting and the package to install (SQLAlchemy imports the driver here)."""
    try:
        return sa.create_engine(url, **arguments)
    except ImportError as error:
        module = (error.name or "").split(".")[0] or str(error)
        package = _DRIVER_PACKAGES.get(module, module)
        setting = f" ({URL_ENV})" if os.environ.get(URL_ENV) == url else ""
        raise StorageError(
            f"the result cache {shown_url(url)}{setting} needs the database driver {module}, which is not "
            f'installed: `pip install "{package}"`, or point {URL_ENV} at another database'
        ) from error


def _add_later_columns(url: str, engine: sa.Engine) -> None:
    """Give a table made before a column was added that column: `created_at` dating its rows now,
    `token_logprobs` null (constant defaults: SQLite and Postgres add them without rewriting the table).
    A store this process may not alter (a read-only file, a role without ALTER) keeps the table as it
    is: the columns it lacks read as null, and the cache writes nothing (`_read_only`)."""
    later = {"created_at": f"BIGINT DEFAULT {int(time.time())}", "token_logprobs": "TEXT"}
    present = _table_columns(engine)
    for name, definition in later.items():
        if name in present or not present:
            continue
        try:
            with engine.begin() as connection:
                connection.execute(sa.text(f"ALTER TABLE {RESULTS.name} ADD COLUMN {name} {definition}"))
            present.add(name)
        except sa.exc.SQLAlchemyError as exc:
            present = _table_columns(engine)
            if name in present:
                continue  # another process added it meanwhile
            if not write_refused(exc):
                raise
            _read_only.setdefault(url, driver_line(exc))
    _columns[url] = frozenset(present)


def _table_columns(engine: sa.Engine) -> set[str]:
    """The columns of the results table as stored (none when there is no table)."""
    if not sa.inspect(engine).has_table(RESULTS.name):
        return set()
    return {column["name"] for column in sa.inspect(engine).get_columns(RESULTS.name)}


def write_refused(exc: BaseException) -> bool:
    """Whether `exc` says this process may not write the store: a read-only SQLite file or folder
    (SQLITE_READONLY), a Postgres role without the privilege (42501) or a read-only transaction, as
    on a standby (25006)."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        return code & 0xFF == _SQLITE_READONLY if code is not None else "readonly database" in str(orig)
    # psycopg2 names the SQLSTATE `pgcode`, psycopg 3 `sqlstate`.
    return (getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)) in _PG_REFUSED


def driver_line(exc: sa.exc.SQLAlchemyError) -> str:
    """The driver's first line of `exc`: what failed (its further lines are guesses and links)."""
    return scrub((str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0])


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite `url` (its `file:` URI form too, as `?mode=ro&uri=true` spells a
    read-only one), else None."""
    parsed = sa.make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    if parsed.query.get("uri") in ("true", "1") and database.startswith("file:"):
        database = database.removeprefix("file:").split("?", 1)[0]
    return Path(database)


# SQLite's primary result codes of a write the disk could not take: SQLITE_FULL, and SQLITE_IOERR,
# which is what a full disk gives where the shared-memory file of the write-ahead log cannot grow.
_SQLITE_FULL, _SQLITE_IOERR = 13, 10
# Free bytes under which a disk I/O error of SQLite is taken for a full disk (a few of its pages).
_NEARLY_FULL_BYTES = 1 << 20


def full_disk(url: str, exc: sa.exc.SQLAlchemyError) -> str | None:
    """What to say when `exc` is a SQLite cache's file system out of space: the folder, and the setting
    that puts the cache there; None for any other failure."""
    code, path = getattr(getattr(exc, "orig", None), "sqlite_errorcode", None), sqlite_file(url)
    if path is None or code is None or code & 0xFF not in (_SQLITE_FULL, _SQLITE_IOERR):
        return None
    measured = next(folder for folder in path.parents if folder.exists())
    if code & 0xFF == _SQLITE_IOERR and shutil.disk_usage(measured).free >= _NEARLY_FULL_BYTES:
        return None  # an I/O error on a disk with room: something else
    if os.environ.get(URL_ENV):
        where = f"point {URL_ENV} at a database on another disk"
    elif is_local(data_root()):
        where = f"point {DATA_ENV} at other storage ({URL_ENV} for the cache alone)"
    else:  # outputs on S3: the cache is next to the Dagster instance (`cache_url`)
        where = f"point DAGSTER_HOME at another disk ({URL_ENV} for the cache alone)"
    return f"no space left on device in {path.parent}: free space there, or {where}"


def _sqlite_pragmas(connection, _record) -> None:
    cursor = connection.cursor()
    # WAL: readers never wait for a writer. NORMAL sync survives a killed process; a power cut may
    # lose the last adds, which the partitions' checkpoints still hold. A file opened read-only keeps
    # the mode it has (switching writes its header): nothing is written to it.
    with contextlib.suppress(sqlite3.OperationalError):
        cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # 64 MiB of pages per connection (SQLite's default is 2 MiB): an add of a partition's new keys
    # touches one random leaf page per key of a large cache; the OS caches the rest.
    cursor.execute("PRAGMA cache_size=-65536")
    cursor.close()


def corrupt_sqlite_file(url: str, exc: sa.exc.SQLAlchemyError) -> Path | None:
    """The SQLite file of `url` when `exc` says it is not a database or is damaged, else None."""
    orig = getattr(exc, "orig", None)
    path = sqlite_file(url)
    return path if isinstance(orig, sqlite3.DatabaseError) and _is_corruption(orig) else None


def _is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _CORRUPT_CODES
    return any(text in str(exc) for text in _CORRUPT_TEXTS)


def _still_corrupt(path: Path) -> bool:
    """Whether the file at `path` is (still) damaged: another run may have set it aside already."""
    if not path.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=120)) as database:
            return database.execute("PRAGMA quick_check").fetchone() != ("ok",)
    except sqlite3.DatabaseError as exc:
        return _is_corruption(exc)


def set_aside(path: Path) -> Path | None:
    """Rename a damaged SQLite file (and its WAL and shared-memory files, so they stay a pair) to
    `<name>.corrupt-<time>`; None when another process did so first. Under a lock beside it: two
    runs that meet the same damage rename it once, and never rename the fresh cache made after."""
    with exclusive_file_lock(path.with_name(f"{path.name}.lock")):
        if not _still_corrupt(path):
            return None
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{path}{suffix}", f"{aside}{suffix}")
        return aside


class ResultCache:
    """The cached results of one task under one fingerprint."""

    def __init__(
        self,
        task_dir: UPath,
        fingerprint: str,
        url: str | None = None,
        instance: object | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        """`instance`: the run's Dagster instance, whose Postgres (if any) holds the cache. `warn`:
        where to say that a damaged cache was set aside (the run's log; else this module's logger)."""
        self.fingerprint = fingerprint
        self.task = task_dir.name
        self.url = url or cache_url(task_dir, instance)
        self.warn = warn or logging.getLogger(__name__).warning
        # Where earlier versions kept this fingerprint's results as parquet files.
        self.legacy_folder = task_dir / "_result_cache" / fingerprint
        self._imported = False
        self._recorded = False
        self._said_read_only = False

    def lookup(self, keys: pl.Series | None = None) -> pl.DataFrame:
        """Cached results for `keys` (all cached results when None), each key once."""
        rows = self._use_store("read from", lambda: self._read(keys))
        frame = pl.DataFrame(rows, schema=[(name, RESULT_SCHEMA[name]) for name in _VALUE_COLUMNS], orient="row")
        return conform_results(frame.with_columns(pl.lit(None, dtype=pl.String).alias("error")))

    def add(self, results: pl.DataFrame) -> int:
        """Store finished results (rows with an error are not cached). Returns rows offered (none
        where the store may not be written: said once, and the run goes on without caching)."""
        finished = conform_results(results.filter(pl.col("error").is_null())).unique("request_key")
        if finished.height == 0:
            return 0
        return finished.height if self._use_store("write to", lambda: self._write(finished)) else 0

    def _read(self, keys: pl.Series | None) -> list[tuple]:
        engine = _engine(self.url)
        self._import_legacy()
        self._record_use()
        if not _columns.get(self.url):
            return []  # a read-only store without the table: nothing cached there
        with engine.connect() as connection:
            if keys is None:
                return [tuple(row) for row in connection.execute(self._select())]
            if engine.dialect.name == "sqlite":
                return self._read_sqlite(connection, keys)
            # One statement, compiled once, its `IN (…)` list bound per batch of keys (an expanding
            # parameter: SQLAlchemy does not build an expression per key).
            query = self._select().where(RESULTS.c.request_key.in_(sa.bindparam("keys", expanding=True)))
            unique = keys.drop_nulls().unique().to_list()
            return [
                tuple(row)
                for start in range(0, len(unique), KEYS_PER_QUERY)
                for row in connection.execute(query, {"keys": unique[start : start + KEYS_PER_QUERY]})
            ]

    def _write(self, finished: pl.DataFrame) -> bool:
        _engine(self.url)
        self._record_use()
        return self._writable() and self._try_write(lambda: self._insert(finished))

    def _record_use(self) -> None:
        """Note that the task uses this fingerprint now (once per cache object: a step's)."""
        if self._recorded or not self._writable():
            return
        engine = _engine(self.url)
        dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
        row = {"task": self.task, "fingerprint": self.fingerprint, "last_used": int(time.time())}
        statement = dialect.insert(VERSIONS).values(row)

        def record() -> None:
            with engine.begin() as connection:
                connection.execute(
                    statement.on_conflict_do_update(
                        index_elements=["task", "fingerprint"], set_={"last_used": row["last_used"]}
                    )
                )

        self._recorded = self._try_write(record)

    def _writable(self) -> bool:
        """Whether this process may write the store; where not, a warning (once) says so."""
        reason = _read_only.get(self.url)
        if reason is not None and not self._said_read_only:
            self._said_read_only = True
            missing = sorted(set(_VALUE_COLUMNS) - _columns.get(self.url, frozenset()))
            lacks = f"; its column(s) {', '.join(missing)} read as empty" if _columns.get(self.url) and missing else ""
            where = sqlite_file(self.url) or shown_url(self.url)
            self.warn(
                f"the result cache {where} cannot be written here ({reason}){lacks}: this run reuses what it holds "
                f"and caches nothing new (point {URL_ENV} at a database this run may write, or let it write this "
                "one, or run without the cache: `batch-assets run --no-result-cache`)"
            )
        return reason is None

    def _try_write(self, work: Callable[[], None]) -> bool:
        """`work`, a write; False where the store refuses it (read-only from then on, said once)."""
        try:
            work()
        except sa.exc.SQLAlchemyError as exc:
            if not write_refused(exc):
                raise
            _read_only.setdefault(self.url, driver_line(exc))
            return self._writable()
        return True

    def _read_sqlite(self, connection: sa.Connection, keys: pl.Series) -> list[tuple]:
        """The rows of `keys` in one query: the keys bound as one JSON array that SQLite's
        `json_each` unpacks (no bound-parameter limit, no parameter per key for SQLAlchemy to
        process), the rows fetched as the driver returns them."""
        listed = sa.func.json_each(sa.bindparam("keys")).table_valued("value")
        query = self._select().where(RESULTS.c.request_key.in_(sa.select(listed.c.value)))
        compiled = query.compile(dialect=connection.dialect)
        values = {**compiled.params, "keys": json.dumps(keys.drop_nulls().unique().to_list())}
        assert compiled.positiontup is not None  # sqlite3's parameters are positional
        return list(connection.exec_driver_sql(str(compiled), tuple(values[name] for name in compiled.positiontup)))

    def _select(self) -> sa.Select:
        # A column the stored table lacks (one of a later version it could not be given) reads as null.
        present = _columns.get(self.url, frozenset(_VALUE_COLUMNS))
        columns = [RESULTS.c[name] if name in present else sa.null().label(name) for name in _VALUE_COLUMNS]
        return sa.select(*columns).where(RESULTS.c.fingerprint == self.fingerprint)

    def _insert(self, frame: pl.DataFrame) -> None:
        engine = _engine(self.url)
        # `INSERT … ON CONFLICT DO NOTHING` is dialect syntax: SQLAlchemy spells it per database.
        dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
        statement = dialect.insert(RESULTS).on_conflict_do_nothing()
        rows = frame.select(_VALUE_COLUMNS).with_columns(
            pl.lit(self.fingerprint).alias("fingerprint"), pl.lit(int(time.time())).alias("created_at")
        )
        # On SQLite the statement is compiled once and the rows go to sqlite3's `executemany` as
        # tuples: SQLAlchemy's `execute` would process each row's parameters in Python, most of an
        # add's time. Other databases keep `execute`, which batches rows into multi-row INSERTs
        # (its "insertmanyvalues"): one round trip per thousand rows, not per row.
        compiled = statement.compile(dialect=engine.dialect) if engine.dialect.name == "sqlite" else None
        for start in range(0, rows.height, ROWS_PER_INSERT):
            batch = rows.slice(start, ROWS_PER_INSERT)
            with engine.begin() as connection:
                if compiled is not None and compiled.positiontup is not None:
                    connection.exec_driver_sql(str(compiled), batch.select(compiled.positiontup).rows())
                else:
                    connection.execute(statement, batch.to_dicts())

    def _import_legacy(self) -> None:
        """Move this fingerprint's parquet files of earlier versions into the table, once.

        Rows are inserted before their file is removed, so a reader at any moment finds each result
        in the table or still in its file; two processes importing at once insert the same rows
        (kept once) and remove the same files."""
        if self._imported:
            return
        self._imported = True
        if self.url in _read_only or not self.legacy_folder.exists():
            return
        for path in sorted(self.legacy_folder.glob("part-*.parquet"), key=lambda p: p.name):
            try:
                with path.open("rb") as handle:
                    frame = conform_results(pl.read_parquet(handle))
            except FileNotFoundError:
                continue  # imported and removed by another process meanwhile
            self._insert(frame.filter(pl.col("error").is_null()).unique("request_key"))
            with contextlib.suppress(FileNotFoundError):
                remove_path(path)
        with contextlib.suppress(OSError, NotImplementedError):  # S3 has no folders to remove
            self.legacy_folder.rmdir()

    def _use_store(self, action: str, work: Callable[[], T]) -> T:
        """`work` on the database. A damaged SQLite file is set aside and `work` runs once more on a
        fresh one; any other failure is a `StorageError` naming the store (password hidden) and what
        to set."""
        try:
            try:
                return work()
            except sa.exc.DatabaseError as exc:
                damaged = corrupt_sqlite_file(self.url, exc)
                if damaged is None:
                    raise
                self._set_aside(damaged, exc)
                return work()
        except sa.exc.SQLAlchemyError as exc:
            raise self._storage_error(action, exc) from exc

    def _set_aside(self, path: Path, exc: sa.exc.DatabaseError) -> None:
        _forget_engine(self.url)
        self._recorded = False  # the fresh database records this task's use of the fingerprint again
        aside = set_aside(path)
        if aside is not None:
            self.warn(
                f"the result cache {path} is damaged ({exc.orig}): set aside as {aside.name} and replaced by an "
                "empty cache, so this run infers the rows it would have reused (delete the old file when it is "
                "not needed)"
            )

    def _storage_error(self, action: str, exc: sa.exc.SQLAlchemyError) -> StorageError:
        full = full_disk(self.url, exc)
        if full is not None:
            return StorageError(f"{action} the result cache {sqlite_file(self.url)} failed: {full}", errno.ENOSPC)
        # The driver's first line says what failed; its further lines are its guesses (e.g. "Is the
        # server running on that host...?", read as being about the LLM server) and SQLAlchemy's link.
        return StorageError(
            f"{action} the result cache {shown_url(self.url)} failed: {driver_line(exc)} (point {URL_ENV} at a "
            "working database, or run without the cache: `batch-assets run --no-result-cache`, or materialize "
            "inference_outputs with use_result_cache: false)"
        )
