"""A throwaway PostgreSQL server for the tests that need the real database (test_postgres_storage.py,
test_k8s_first_run.py): Debian's server binaries, `initdb` + `pg_ctl`, run as the `postgres` user when
the tests run as root, listening on a free loopback port.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from batch_assets_tests.support import free_port

psycopg2 = pytest.importorskip("psycopg2", reason="dagster-postgres is not installed (pip install -e '.[test]')")


def postgres_bin_dir() -> Path | None:
    """Debian keeps the server binaries in /usr/lib/postgresql/<version>/bin, off the PATH."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0
    )
    for candidate in reversed(versions):
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    username: str
    password: str
    db_name: str

    def env(self) -> dict[str, str]:
        """The variables deploy/postgres/dagster.yaml reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USERNAME": self.username,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.db_name,
        }

    def query(self, sql: str) -> list[tuple]:
        with (
            psycopg2.connect(
                host=self.host, port=self.port, user=self.username, password=self.password, dbname=self.db_name
            ) as connection,
            connection.cursor() as cursor,
        ):
            cursor.execute(sql)
            return cursor.fetchall()


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL cluster on a free loopback port with an empty database
    `batch_assets`; skips the test where the server binaries (or a user to run them as) are missing."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip(
            "PostgreSQL server binaries not found: install Debian's postgresql "
            "(scripts/install_system_deps.sh does it as root)"
        )
    # initdb refuses to run as root: run the server as the `postgres` user the Debian package creates.
    run_as: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to run the PostgreSQL server as")
        run_as = ["runuser", "-u", "postgres", "--"]
    # Under /tmp (not pytest's root-only tmp_path) so the `postgres` user can reach it.
    root = Path(tempfile.mkdtemp(prefix="batch_assets_pg_"))
    password = "batch-assets-test"
    (root / "pwfile").write_text(password + "\n")
    if owner is not None:
        for path in (root, root / "pwfile"):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    data = root / "data"
    port = free_port()

    def pg(*args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*run_as, *args], capture_output=True, text=True, timeout=120, **kwargs)

    initdb = pg(
        str(bin_dir / "initdb"),
        "-D",
        str(data),
        "-U",
        "dagster",
        f"--pwfile={root / 'pwfile'}",
        "--auth-host=scram-sha-256",
        "--auth-local=trust",
        "-E",
        "UTF8",
        "--locale=C",
    )
    assert initdb.returncode == 0, initdb.stderr
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
    started = pg(
        str(bin_dir / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(root / "server.log"),
        "-w",
        "-t",
        "60",
        "-o",
        options,
        "start",
    )
    assert started.returncode == 0, started.stderr + started.stdout
    try:
        connection = psycopg2.connect(host="127.0.0.1", port=port, user="dagster", password=password, dbname="postgres")
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute("CREATE DATABASE batch_assets")
        connection.close()
        yield PostgresServer("127.0.0.1", port, "dagster", password, "batch_assets")
    finally:
        pg(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
