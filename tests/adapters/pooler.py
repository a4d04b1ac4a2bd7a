"""A PgBouncer of the test's own, in transaction pool mode, in front of the test PostgreSQL.

Debian's ``pgbouncer`` (``make pgbouncer`` installs it), started on a free loopback port
from a config in a temporary directory and stopped after; the shared PostgreSQL server is
only connected to, never reconfigured. Not installed: the test skips with the reason (fails
under ``CI=true``). Through it, the kit's URL names its schema with ``schema=`` (PgBouncer
refuses the ``options`` startup parameter) and turns prepared statements off
(``prepare_threshold=none``: PgBouncer 1.18 hands each transaction to any server connection).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from adapters import services
from adapters.throwaway import free_port
from tesserix_adk.stores.bundle import Stores


@dataclass(frozen=True, slots=True, kw_only=True)
class PgBouncer:
    """A running PgBouncer: where it listens and the database it serves."""

    port: int
    database: str
    process: subprocess.Popen[bytes]
    log: Path

    def url(self, user: str = "postgres", **options: str) -> str:
        """A store URL through the pooler as ``user``, with the kit's ``options``."""
        base = f"postgresql://{user}@127.0.0.1:{self.port}/{self.database}"
        return services.with_query(base, **options) if options else base

    def stores_url(self, schema: str, user: str = "postgres") -> str:
        """The kit's URL for a pooler: its schema named, prepared statements off."""
        return self.url(user, schema=schema, prepare_threshold="none")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@contextmanager
def pgbouncer(
    *,
    users: Mapping[str, str] | None = None,
    connect_query: str | None = None,
    auth_type: str = "trust",
) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode on a free loopback port, in front of the test
    PostgreSQL; ``users`` (name: password) may log in (``auth_type`` trust, as the test
    server does, or one that checks the password), ``connect_query`` runs on each server
    connection it opens."""
    binary = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )
    if binary is None:
        services.unavailable("pgbouncer is not installed (`make pgbouncer` installs it)")
    where = urlsplit(services.POSTGRES_URL)
    database = unquote(where.path.lstrip("/")) or "postgres"
    owner = unquote(where.username or "postgres")
    logins = {owner: unquote(where.password or ""), **(users or {})}
    port = free_port()
    directory = Path(tempfile.mkdtemp(prefix="adk-pgbouncer-"))
    account: pwd.struct_passwd | None = None
    try:
        server = f"host={where.hostname or '127.0.0.1'} port={where.port or 5432}"
        if connect_query is not None:
            assert "'" not in connect_query
            server += f" connect_query='{connect_query}'"
        (directory / "users.txt").write_text(
            "".join(f'"{name}" "{password}"\n' for name, password in logins.items())
        )
        log = directory / "pgbouncer.log"
        (directory / "pgbouncer.ini").write_text(
            f"[databases]\n* = {server}\n\n[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = {auth_type}\nauth_file = {directory / 'users.txt'}\n"
            "pool_mode = transaction\nmax_client_conn = 500\ndefault_pool_size = 20\n"
            f"logfile = {log}\npidfile = {directory / 'pgbouncer.pid'}\n"
        )
        if os.geteuid() == 0:
            # PgBouncer refuses to run as root.
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                services.unavailable("running as root and there is no postgres user for PgBouncer")
            for path in (directory, *directory.iterdir()):
                os.chown(path, account.pw_uid, account.pw_gid)
        process = subprocess.Popen(
            [binary, str(directory / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=None if account is None else account.pw_uid,
            group=None if account is None else account.pw_gid,
            extra_groups=None if account is None else [],
        )
        try:
            deadline = time.monotonic() + 20
            while not _listening(port):
                if process.poll() is not None:
                    text = log.read_text() if log.exists() else ""
                    pytest.fail(f"pgbouncer exited with {process.returncode}: {text}")
                if time.monotonic() > deadline:
                    pytest.fail("the throwaway pgbouncer did not listen within 20 s")
                time.sleep(0.02)
            yield PgBouncer(port=port, database=database, process=process, log=log)
        finally:
            # It keeps nothing: SIGKILL, and the server sees its connections close.
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@asynccontextmanager
async def pooled_postgres_stores(
    *, keep_last: int | None = None, bouncer: PgBouncer | None = None
) -> AsyncIterator[Stores]:
    """``open_stores`` through a PgBouncer (``bouncer``, e.g. the session's, else one of
    its own), in a fresh schema (applied through the pooler too; dropped after)."""
    async with services.postgres_schema() as schema:
        with contextlib.ExitStack() as own:
            if bouncer is None:
                bouncer = own.enter_context(pgbouncer())
            url = bouncer.stores_url(schema)
            if keep_last is not None:
                url = services.with_query(url, keep_last=str(keep_last))
            async with services.postgres_stores_applied(url) as stores:
                yield stores
