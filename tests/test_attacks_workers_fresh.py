"""Attacks on "Running workers" (with ``Resumer`` and deciding an indeterminate call) and on
"Operating it from the CLI": a real ``tesserix worker``-style process killed with SIGKILL
inside a side-effecting tool, the operator's whole 3 a.m. path after it, two operators'
resolves racing in two processes, answers given for the wrong tenant or twice, the ids a
caller of ``Resumer`` can pass, and bad command lines (unicode that could forge a line,
store URLs wrong in many ways). The world is a file the tool appends one line to per
booking (``O_APPEND``), so a process killed right after it cannot lose it.

Found, and fixed (their tests pass now: ``run/ids.check_worker`` in ``Resumer.resume`` and
``AgentRunner``; ``AgentRunner.cancel`` records nothing for a run that ended):
- LOW ``test_resumer_refuses_a_worker_name_no_store_can_keep_as_configuration``:
  ``Resumer.resume(worker=...)`` checks the run id and tenant but not the worker name it
  stores as the lease holder: a lone surrogate is reported as a damaged stored lease
  (``CheckpointCorruptError``) on SQLite and as a raw ``UnicodeEncodeError`` on
  PostgreSQL/Redis; a NUL on PostgreSQL is ``StoreUnavailableError`` (retryable: a driver
  retries a call that can never succeed). The CLI checks ``--worker``; the API does not.

- LOW ``test_cancel_of_a_finished_run_twice_cancels_nothing``: ``tesserix cancel`` of a run
  that already completed prints "had already ended completed; nothing to cancel" (exit 0),
  yet the request is recorded: ``show`` then says "cancel requested by b" (``--json``:
  ``cancel {by, at}``) on a completed run, an audit trail that contradicts what the operator
  was told.

Held:
- a worker process SIGKILLed right after the booking: the next worker parks the call in
  doubt (no guess), ``runs --stuck`` lists it, ``resolve --never-ran`` is refused (exit 3)
  inside the margin, ``resolve --outcome`` records it, a second resolve is exit 4, the
  worker carries the run to completed and the airline holds exactly one booking;
- ``resolve --outcome`` and ``resolve --never-ran`` from two processes at once: exactly one
  is recorded, the other refused (3 or 4), and the call is then sent once or never as the
  winner said;
- ``resolve`` and ``cancel`` for the wrong tenant: exit 1, one sentence, store unchanged;
- ``resolve`` while a custom driver (``Resumer``) holds the run: exit 3, nothing recorded;
- ``Resumer.resume`` of run ids no store keeps (NUL, lone surrogate, 100 kB): typed
  ``ConfigurationError``, nothing written;
- ids with U+2028, U+202E, U+0085 print escaped in the one error sentence;
- store URLs: ``sqlite://``, ``sqlite:rel``, an unknown option, a missing directory, a
  PostgreSQL database or schema that does not exist, Redis on a PostgreSQL port, a broken
  IPv6 host, a port that is not a number: one sentence each, the documented exit code;
- numbers at their edges: ``--margin`` nan/inf/negative/1e400, ``--limit`` 0/-1,
  ``--lease-ttl`` nan: exit 2, one sentence.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from tesserix_adk import AgentRunner, LeasePolicy, ScriptedProvider, Worker, open_stores
from tesserix_adk.cli.main import main
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.resumer import Resumer
from tesserix_adk.stores.bundle import Stores

T = "acme"
PY = sys.executable

AGENT_MODULE = textwrap.dedent(
    """
    import os, signal
    from tesserix_adk import Agent, tool

    TURNS = [[("book_seat", {"flight": "LH400"})], "Booked."]

    @tool
    def book_seat(flight: str, ctx) -> dict:
        \"\"\"Book one seat.\"\"\"
        if os.environ.get("DIE") == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        fd = os.open(os.environ["WORLD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{ctx.idempotency_key} {flight} {os.getpid()}\\n".encode())
        os.close(fd)
        if os.environ.get("DIE") == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return {"booking": "BK-1"}

    agent = Agent("booker", "Book it.", [book_seat])
    """
)

WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from tesserix_adk import AgentRunner, LeasePolicy, ScriptedProvider, Worker, open_stores
    from booker import TURNS, agent

    async def go(url):
        async with open_stores(url) as stores:
            runner = AgentRunner.from_stores(
                ScriptedProvider(list(TURNS)), stores,
                lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5), never_ran_margin=0.2,
            )
            await Worker(runner, [agent], exit_when_idle=True, poll_interval=0.05).run()

    asyncio.run(go(sys.argv[1]))
    """
)


# --- helpers ------------------------------------------------------------------------------


def _world(tmp: Path) -> Path:
    (tmp / "booker.py").write_text(AGENT_MODULE)
    (tmp / "work.py").write_text(WORKER_SCRIPT)
    return tmp / "world.txt"


def _booker(tmp: Path) -> Any:
    sys.path.insert(0, str(tmp))
    try:
        sys.modules.pop("booker", None)
        import booker  # type: ignore[import-not-found]

        return booker
    finally:
        sys.path.remove(str(tmp))


def _bookings(world: Path) -> list[str]:
    return world.read_text().splitlines() if world.exists() else []


def _runner(stores: Stores, turns: list[Any], ttl: float = 1.0) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns)),
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        never_ran_margin=0.2,
    )


async def _work(url: str, booker: Any) -> None:
    async with open_stores(url) as stores:
        worker = Worker(_runner(stores, booker.TURNS), [booker.agent], exit_when_idle=True)
        worker.poll_interval = 0.05
        await asyncio.wait_for(worker.run(), 20)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _one_sentence(err: str) -> bool:
    return err.startswith("tesserix") and err.count("\n") == 1 and "Traceback" not in err


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _record(url: str) -> Any:
    async def go() -> Any:
        async with open_stores(url) as stores:
            (record,) = await stores.idempotency.records(T, "r1")
            return record

    return asyncio.run(go())


def _in_doubt(url: str, tmp: Path, world: Path, die: str, env: dict[str, str]) -> None:
    """Submit r1, let a worker process take it and SIGKILL itself ``die`` the booking."""

    async def submit() -> None:
        booker = _booker(tmp)
        async with open_stores(url) as stores:
            await stores.create_schema()
            await _runner(stores, booker.TURNS).submit(booker.agent, "book", tenant=T, run_id="r1")

    asyncio.run(submit())
    done = subprocess.run(
        [PY, str(tmp / "work.py"), url],
        cwd=tmp,
        env={**env, "DIE": die, "WORLD": str(world)},
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ADK_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    return env


# ==========================================================================================
# Defects
# ==========================================================================================


async def _resume_with_worker(url: str, worker: str) -> BaseException | None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        try:
            carried = await Resumer.from_stores(stores).resume("r1", tenant=T, worker=worker)
        except BaseException as exc:  # what is raised is the point
            return exc
        await stores.leases.release(carried.lease)
        return None


@pytest.mark.parametrize(
    ("backend", "worker"),
    [
        pytest.param("sqlite", "w\udcff", id="sqlite-surrogate"),
        pytest.param("postgres", "w\x00x", id="postgres-nul", marks=pytest.mark.postgres),
    ],
)
async def test_resumer_refuses_a_worker_name_no_store_can_keep_as_configuration(
    backend: str, worker: str, tmp_path: Path
) -> None:
    if backend == "sqlite":
        failure = await _resume_with_worker(f"sqlite:///{tmp_path / 's.db'}", worker)
    else:
        async with services.postgres_schema() as schema:
            failure = await _resume_with_worker(services.schema_url(schema), worker)
    # As the CLI refuses `--worker` (and Resumer its run id): a typed, non-retryable refusal
    # before anything is written, not a "damaged row" nor "the store is down".
    assert isinstance(failure, ConfigurationError), repr(failure)


# ==========================================================================================
# Held
# ==========================================================================================


def test_a_worker_killed_after_the_booking_leaves_it_for_an_operator_and_books_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = _world(tmp_path)
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    _in_doubt(url, tmp_path, world, "after", _env(tmp_path))
    assert len(_bookings(world)) == 1
    booker = _booker(tmp_path)
    # Past the dead worker's lease: the next worker cannot know, so it parks (no guess).
    asyncio.run(asyncio.sleep(1.1))
    asyncio.run(_work(url, booker))
    assert len(_bookings(world)) == 1
    code, out, _ = _cli(capsys, "runs", "--tenant", T, "--stuck", "--store", url)
    assert code == 0 and "r1" in out
    # --never-ran inside the default margin (10 s past the last lease): not now.
    code, _, err = _cli(
        capsys, "resolve", "r1", "--tenant", T, "--call", "call_0_0", "--never-ran",
        "--by", "alice", "--store", url,
    )  # fmt: skip
    assert code == 3 and _one_sentence(err)
    outcome = json.dumps({"booking": "BK-1"})
    argv = ["resolve", "r1", "--tenant", T, "--call", "call_0_0", "--outcome", outcome]
    code, _, err = _cli(capsys, *argv, "--by", "alice", "--store", url)
    assert code == 0, err
    code, _, err = _cli(capsys, *argv, "--by", "bob", "--store", url)
    assert code == 4 and _one_sentence(err)
    asyncio.run(_work(url, booker))
    code, out, _ = _cli(capsys, "inspect", "r1", "--tenant", T, "--json", "--store", url)
    assert code == 0 and json.loads(out)["status"] == "completed"
    assert len(_bookings(world)) == 1
    assert _record(url).by == "alice"


def test_two_operators_resolving_at_once_record_one_answer_and_it_is_obeyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = _world(tmp_path)
    monkeypatch.setenv("WORLD", str(world))  # the in-process worker's tool books here
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    env = _env(tmp_path)
    _in_doubt(url, tmp_path, world, "before", env)
    assert _bookings(world) == []
    asyncio.run(asyncio.sleep(1.1))
    base = [PY, "-m", "tesserix_adk", "resolve", "r1", "--tenant", T, "--call", "call_0_0"]
    argvs = [
        [*base, "--outcome", '{"booking": "BK-9"}', "--by", "olga", "--store", url],
        [*base, "--never-ran", "--margin", "0", "--by", "nick", "--store", url],
    ]

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)

    with ThreadPoolExecutor(2) as pool:
        olga, nick = pool.map(run, argvs)
    codes = sorted([olga.returncode, nick.returncode])
    assert codes[0] == 0 and codes[1] in (3, 4), (olga, nick)
    loser = olga if olga.returncode else nick
    assert _one_sentence(loser.stderr)
    asyncio.run(_work(url, _booker(tmp_path)))
    record = _record(url)
    if olga.returncode == 0:
        assert record.by == "olga" and _bookings(world) == []
    else:
        assert record.never_ran_by == "nick" and len(_bookings(world)) == 1


@pytest.fixture
def in_doubt(tmp_path: Path) -> tuple[Path, str]:
    """r1 of tenant acme died (SIGKILL) before its booking, its lease lapsed."""
    world = _world(tmp_path)
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    _in_doubt(url, tmp_path, world, "before", _env(tmp_path))
    asyncio.run(asyncio.sleep(1.1))  # the dead worker's lease lapses
    return path, url


def test_resolve_and_cancel_for_the_wrong_tenant_change_nothing(
    in_doubt: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = in_doubt
    before = _dump(path)
    for argv in (
        ["resolve", "r1", "--tenant", "other", "--call", "call_0_0", "--outcome", "{}"],
        ["resolve", "r1", "--tenant", "other", "--call", "call_0_0", "--never-ran"],
        ["cancel", "r1", "--tenant", "other"],
    ):
        code, _, err = _cli(capsys, *argv, "--by", "mallory", "--store", url)
        assert code == 1 and _one_sentence(err), (argv, err)
    assert _dump(path) == before


def test_resolve_while_a_custom_driver_holds_the_run_is_not_now(
    in_doubt: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = in_doubt

    async def go() -> None:
        async with open_stores(url) as stores:
            carried = await Resumer.from_stores(stores).resume("r1", tenant=T, worker="mine")
            try:
                assert [c.call_id for c in carried.plan.indeterminate] == ["call_0_0"]
                argv = ["resolve", "r1", "--tenant", T, "--call", "call_0_0"]
                code, _, err = await asyncio.to_thread(
                    _cli, capsys, *argv, "--outcome", "{}", "--by", "a", "--store", url
                )
                assert code == 3 and _one_sentence(err), err
            finally:
                await stores.leases.release(carried.lease)
            (record,) = await stores.idempotency.records(T, "r1")
            assert record.by is None and record.outcome is None

    asyncio.run(go())


def test_cancel_of_a_finished_run_twice_cancels_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = _world(tmp_path)
    os.environ["WORLD"] = str(world)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    booker = _booker(tmp_path)

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            await _runner(stores, booker.TURNS).run(booker.agent, "go", tenant=T, run_id="r1")

    try:
        asyncio.run(go())
    finally:
        del os.environ["WORLD"]
    for _ in range(2):
        code, out, _ = _cli(capsys, "cancel", "r1", "--tenant", T, "--by", "b", "--store", url)
        assert code == 0 and "nothing to cancel" in out
    code, out, _ = _cli(capsys, "show", "r1", "--tenant", T, "--json", "--store", url)
    shown = json.loads(out)
    assert code == 0 and shown["status"] == "completed" and not shown.get("cancel"), shown
    assert len(_bookings(world)) == 1


@pytest.mark.parametrize("run_id", ["n\x00", "\udcff", "x" * 100_000])
async def test_resumer_refuses_run_ids_no_store_keeps_before_writing(
    run_id: str, tmp_path: Path
) -> None:
    path = tmp_path / "s.db"
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        before = _dump(path)
        with pytest.raises(ConfigurationError):
            await Resumer.from_stores(stores).resume(run_id, tenant=T, worker="w")
        assert _dump(path) == before


@pytest.mark.parametrize("odd", ["r\u2028x", "r\u202ex", "r\x85x", "r\u200bx\u2029"])
def test_unicode_that_could_forge_a_line_is_escaped_in_the_one_sentence(
    odd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert _cli(capsys, "schema", "apply", "--store", url)[0] == 0
    for argv in (
        ["inspect", odd, "--tenant", T],
        ["show", "r", "--tenant", odd],
        ["cancel", odd, "--tenant", T, "--by", "b"],
        ["steps", odd, "--tenant", T],
    ):
        code, _, err = _cli(capsys, *argv, "--store", url)
        assert code == 1 and _one_sentence(err), (argv, err)
        body = err[:-1]
        assert all(c.isprintable() for c in body), repr(err)


def _store_cases(tmp: Path) -> list[tuple[str, int]]:
    pg = services.POSTGRES_URL
    cases = [
        ("sqlite://", 2),
        ("sqlite:relative.db", 2),
        (f"sqlite:///{tmp}/s.db?mode=ro", 2),
        (f"sqlite:///{tmp}/no/such/dir/x.db", 1),
        ("ftp://host/x", 2),
        ("postgresql://postgres@[::1/test", 2),
        ("postgresql://postgres@127.0.0.1:notaport/test", 2),
        ("postgresql://postgres@127.0.0.1:5432/test?bogus=1", 2),
        ("redis://127.0.0.1:5432/0?allow_volatile=true", 3),
    ]
    if pg is not None:
        cases.append(("postgresql://postgres@127.0.0.1:5432/no_such_db_w3", 1))
    return cases


def test_store_urls_wrong_in_many_ways_are_one_sentence_and_their_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for url, expected in _store_cases(tmp_path):
        for argv in (["runs", "--tenant", T], ["inspect", "r", "--tenant", T, "--json"]):
            code, out, err = _cli(capsys, *argv, "--store", url)
            assert code == expected and _one_sentence(err), (url, argv, code, err)
            assert "Traceback" not in out
            if "--json" in argv:
                assert json.loads(out)["error"]["exit_code"] == expected


@pytest.mark.postgres
def test_a_postgres_schema_that_does_not_exist_is_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = services.schema_url("no_such_schema_w3fresh")
    code, _, err = _cli(capsys, "runs", "--tenant", T, "--store", url)
    assert code == 1 and _one_sentence(err) and "schema apply" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["resolve", "r1", "--tenant", T, "--call", "c", "--never-ran", "--by", "b", "--margin"],
        ["runs", "--tenant", T, "--limit"],
        ["worker", "--agent", "booker:agent", "--lease-ttl"],
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf", "-5", "1e400", "0x10"])
def test_numbers_at_their_edges_are_usage_errors(
    argv: list[str], value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if argv[0] == "runs" and value in ("nan", "inf", "1e400"):
        value = "-1"
    url = f"sqlite:///{tmp_path / 's.db'}"
    code, _, err = _cli(capsys, *argv, value, "--store", url)
    assert code == 2 and _one_sentence(err), (argv, value, err)
