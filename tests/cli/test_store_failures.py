"""Exit codes say what an operator can do about a store, on the real backends: a damaged
database is 4 (retrying never helps), a database that does not exist is 1 naming `tesserix
schema apply`, a Redis database number or a URL option nobody knows is 2 in words a user
understands, and a store the operator may only read can still be inspected."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, ScriptedProvider
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.stores.urls import open_stores


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _one_sentence(err: str) -> bool:
    return err.startswith("tesserix: ") and err.count("\n") == 1 and "Traceback" not in err


async def _finished_run(url: str, *, apply: bool = True) -> None:
    async with open_stores(url) as stores:
        if apply:
            await stores.create_schema()
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer.from_stores(stores),
            leases=stores.leases,
            ledger=stores.ledger,
        )
        await runner.run(booking_agent(Airline()), "book", tenant="t", run_id="r")


# --- a damaged database ---------------------------------------------------------------------


def test_a_file_that_is_not_a_database_is_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "adk.sqlite3"
    path.write_bytes(b"not a database, just some text that fills a page " * 100)
    code, _, err = _main(capsys, "--store", f"sqlite:///{path}", "inspect", "r", "--tenant", "t")
    assert code == ExitCode.MUST_NOT_CARRY_ON, err
    assert _one_sentence(err) and "restore it from a backup" in err


def test_a_database_with_damaged_pages_is_exit_4_not_retry_later(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    asyncio.run(_finished_run(url))
    size = path.stat().st_size
    with path.open("r+b") as f:  # the header page stays; every table page after it is noise
        f.seek(4096)
        f.write(b"\xa5" * (size - 4096))
    for command in (("inspect", "r", "--tenant", "t"), ("runs", "--tenant", "t")):
        code, _, err = _main(capsys, "--store", url, *command)
        assert code == ExitCode.MUST_NOT_CARRY_ON, err
        assert _one_sentence(err) and "malformed" in err


# --- PostgreSQL ---------------------------------------------------------------------------


def _postgres_reachable() -> None:
    import psycopg

    try:
        psycopg.connect(services.POSTGRES_URL, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL} cannot be reached: {exc}")


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


@pytest.mark.postgres
def test_a_missing_postgres_database_is_exit_1_naming_schema_apply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _postgres_reachable()
    url = _with_database(services.POSTGRES_URL, f"adktest_absent_{secrets.token_hex(4)}")
    code, _, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t")
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert _one_sentence(err) and "tesserix schema apply" in err and "createdb" in err


@pytest.mark.postgres
def test_a_postgres_schema_never_applied_is_exit_1_naming_schema_apply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def go() -> tuple[int, str]:
        async with services.postgres_schema() as schema:
            return await asyncio.to_thread(
                _main_code_err, capsys, services.schema_url(schema), "inspect", "r", "--tenant", "t"
            )

    code, err = asyncio.run(go())
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert _one_sentence(err) and "tesserix schema apply" in err


def _main_code_err(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str]:
    code, _, err = _main(capsys, "--store", url, *argv)
    return code, err


@pytest.mark.postgres
def test_an_unknown_postgres_option_is_exit_2_in_plain_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = services.with_query(services.POSTGRES_URL, bogus="1")
    code, _, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t")
    assert code == ExitCode.USAGE, err
    assert _one_sentence(err) and "unknown option 'bogus'" in err


# --- Redis --------------------------------------------------------------------------------


def _redis_reachable() -> None:
    async def ping() -> None:
        client = await services.redis_client()
        await client.aclose()

    asyncio.run(ping())


def _redis_db(path: str) -> str:
    parts = urlsplit(services.REDIS_URL)
    return urlunsplit((parts.scheme, parts.netloc, path, "allow_volatile=true", ""))


@pytest.mark.redis
def test_a_redis_database_the_server_lacks_is_exit_2_not_retry_later(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _redis_reachable()
    code, _, err = _main(capsys, "--store", _redis_db("/99999"), "inspect", "r", "--tenant", "t")
    assert code == ExitCode.USAGE, err
    assert _one_sentence(err) and "has no database" in err
    assert "DB index" not in err  # the driver's words, not the operator's


@pytest.mark.redis
@pytest.mark.parametrize("path", ["/abc", "/0/1", "/-1x"])
def test_a_redis_database_that_is_not_a_number_is_exit_2(
    capsys: pytest.CaptureFixture[str], path: str
) -> None:
    code, _, err = _main(capsys, "--store", _redis_db(path), "inspect", "r", "--tenant", "t")
    assert code == ExitCode.USAGE, err
    assert _one_sentence(err) and "database number" in err


@pytest.mark.redis
def test_an_unknown_redis_option_is_exit_2_in_plain_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = services.with_query(services.REDIS_URL, bogus="1")
    code, _, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t")
    assert code == ExitCode.USAGE, err
    assert _one_sentence(err) and "unknown option 'bogus'" in err
    assert "__init__" not in err and "keyword argument" not in err


# --- a store the operator may only read -----------------------------------------------------


def _as_reader() -> list[str]:
    """The command prefix that drops root (file permissions do not bind root)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot drop to a user files bind")
    prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    # The dropped user must be able to import the kit at all: a checkout under a 0700
    # directory (as `mktemp -d` makes) is closed to it, whatever the store's permissions.
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", "import tesserix_adk"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(
            "the unprivileged user cannot import the kit from this checkout (its directory is "
            f"closed to other users): {probe.stderr.strip()[-200:]}"
        )
    return prefix


@pytest.fixture
def readable_dir() -> Iterator[Path]:
    """A directory outside pytest's (root-only) tmp tree, so another user can reach it."""
    path = Path(tempfile.mkdtemp(prefix="tesserix-ro-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for p in (path, *path.iterdir()):
            p.chmod(0o777)
        shutil.rmtree(path, ignore_errors=True)


def _inspect_as_reader(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_as_reader(), sys.executable, "-m", "tesserix_adk", "inspect", "r", "--tenant", "t"],
        env={**os.environ, "ADK_STORE": url},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_read_only_sqlite_file_can_be_inspected(readable_dir: Path) -> None:
    path = readable_dir / "adk.sqlite3"
    asyncio.run(_finished_run(f"sqlite:///{path}"))
    path.chmod(0o444)
    readable_dir.chmod(0o1777)  # the reader may add its -shm/-wal files beside it
    done = _inspect_as_reader(f"sqlite:///{path}")
    assert done.returncode == 0, done.stderr
    assert "completed at step 5" in done.stdout


def test_a_sqlite_store_in_a_read_only_directory_can_be_inspected(readable_dir: Path) -> None:
    path = readable_dir / "adk.sqlite3"
    asyncio.run(_finished_run(f"sqlite:///{path}"))
    path.chmod(0o444)
    readable_dir.chmod(0o555)
    done = _inspect_as_reader(f"sqlite:///{path}")
    assert done.returncode == 0, done.stderr
    assert "completed at step 5" in done.stdout


@pytest.mark.postgres
def test_a_postgres_store_a_role_may_only_select_from_can_be_inspected(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import psycopg

    _postgres_reachable()
    role = f"adktest_reader_{secrets.token_hex(4)}"

    async def go() -> tuple[int, str, str]:
        async with services.postgres_schema() as schema:
            await _finished_run(services.schema_url(schema))
            admin = await psycopg.AsyncConnection.connect(services.POSTGRES_URL, autocommit=True)
            try:
                await admin.execute(f'CREATE ROLE "{role}" LOGIN')
                await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
                await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
                parts = urlsplit(services.schema_url(schema))
                host = parts.netloc.rpartition("@")[2]
                url = urlunsplit((parts.scheme, f"{role}@{host}", parts.path, parts.query, ""))
                return await asyncio.to_thread(_main, capsys, "--store", url, *_INSPECT)
            finally:
                await admin.execute(f'DROP OWNED BY "{role}"')
                await admin.execute(f'DROP ROLE "{role}"')
                await admin.close()

    code, out, err = asyncio.run(go())
    assert code == ExitCode.CARRIED_ON, err
    assert "completed at step 5" in out


_INSPECT = ("inspect", "r", "--tenant", "t")
