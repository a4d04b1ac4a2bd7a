"""An attack on human approvals: the approval store, approve/deny through the CLI and the
Python API, approvals across a SIGKILL and a resume, parallel calls that need a person,
secrets in arguments that need one, other tenants, and damaged or edited request rows.

The oracle: what the operator approved is exactly what the tool receives, once; a denied,
undecided or damaged request sends nothing; no store and no listing holds a secret.
Tests marked ``xfail(strict=True)`` are defects of the code they were written against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    CheckpointPolicy,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    tool,
)
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.cli.failures import exit_code_for
from tesserix_adk.errors import AdkError, CheckpointCorruptError
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import ApprovalStatus
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
REPO = Path(__file__).resolve().parents[1]
TESSERIX = str(REPO / ".venv" / "bin" / "tesserix")


# --- the world ---------------------------------------------------------------------------


class Airline:
    """The outside world: every real dispatch, with the exact arguments it got."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def agent(self, *, parallel: int = 1) -> Agent:
        airline = self

        @tool(requires_approval=True)
        def book(flight: str, ctx: ToolContext, memo: str = "") -> dict[str, str]:
            """Book one seat (needs a person)."""
            airline.sent.append(("book", {"flight": flight, "memo": memo}))
            return {"booking": f"BK-{flight}"}

        @tool
        def hold(flight: str) -> str:
            """Hold a seat (side-effecting, no person needed)."""
            airline.sent.append(("hold", {"flight": flight}))
            return f"held {flight}"

        return Agent("booking", "Book.", [book, hold], parallel_tool_calls=parallel)


def _runner(stores: Stores, turns: list[Any], provider: Any = None) -> AgentRunner:
    return AgentRunner.from_stores(
        provider or ScriptedProvider(list(turns)),
        stores,
        lease_policy=LeasePolicy(ttl=5.0, renew_within=2.0),
        never_ran_margin=0.0,
        resume_claim_ttl=0.2,
    )


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Stores]:
    stores = open_stores(url)
    await stores.create_schema()
    async with stores:
        yield stores


def _cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix <argv>`` in-process against ``url``, on a thread of its own (it runs its
    own event loop; the calling test may be inside one)."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


class Told:
    """A provider that keeps what the model was told."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(list(turns))
        self.tool_texts: list[str] = []

    async def complete(self, request: Any) -> Any:
        self.tool_texts += [m.text for m in request.messages if m.role == "tool"]
        return await self.inner.complete(request)


BOOK_LH1: list[Any] = [[("book", {"flight": "LH1"})], "done"]


async def _waiting(url: str, airline: Airline, turns: list[Any], run_id: str = "r") -> str:
    async with _opened(url) as stores:
        run = await _runner(stores, turns).run(airline.agent(), "go", tenant=T, run_id=run_id)
    assert run.status is RunStatus.waiting_approval, run.status
    assert run.pending_approval is not None
    assert airline.sent == []
    return run.pending_approval.id


async def _resume(url: str, airline: Airline, turns: list[Any], run_id: str = "r") -> Any:
    async with _opened(url) as stores:
        return await _runner(stores, turns).resume(airline.agent(), run_id, tenant=T)


def _db(url: str) -> sqlite3.Connection:
    return sqlite3.connect(url.removeprefix("sqlite:///"))


# --- 1. a Redis request left half made by a death --------------------------------------


@pytest.mark.redis
async def test_a_redis_request_cut_between_its_two_commands_is_asked_again(
    tmp_path: Path,
) -> None:
    """The Redis approval store sets ``approval-id:{id}`` (SET NX) and then runs the
    ``request`` script: two round trips. A process killed between them, or a connection
    cut before the script reached the server, leaves the pointer without the request.
    The request id is derived from the turn, so every resume asks under the same id."""
    import redis.exceptions as redis_errors

    airline = Airline()
    async with store_url("redis", tmp_path) as url, _opened(url) as stores:
        store = stores.approvals
        script = store._request  # type: ignore[attr-defined]
        cut = {"done": False}

        async def cut_once(*args: Any, **kwargs: Any) -> Any:
            if not cut["done"]:
                cut["done"] = True
                raise redis_errors.ConnectionError("connection cut before the script ran")
            return await script(*args, **kwargs)

        store._request = cut_once  # type: ignore[attr-defined]
        with pytest.raises(AdkError):
            await _runner(stores, BOOK_LH1).run(airline.agent(), "go", tenant=T, run_id="r")
        await asyncio.sleep(0.3)
        # The resume (a fresh process would do the same) asks again under the same id.
        run = await _runner(stores, BOOK_LH1).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.waiting_approval
        assert run.pending_approval is not None
        await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ops")
        done = await _runner(stores, BOOK_LH1).resume(airline.agent(), "r", tenant=T)
        assert done.status is RunStatus.completed
        assert airline.sent == [("book", {"flight": "LH1", "memo": ""})]


# --- 2. approve and deny racing --------------------------------------------------------


def _race(url: str, request: str, sides: list[bool]) -> list[Any]:
    """Each side decides ``request`` from a thread of its own (its own stores and loop),
    all released at once; what each got back (the request, or the exception)."""
    barrier = threading.Barrier(len(sides))
    results: list[Any] = [None] * len(sides)

    def decide(i: int, approved: bool) -> None:
        async def go() -> Any:
            async with open_stores(url) as stores:
                await stores.approvals.get(T, request)  # connected before the barrier
                barrier.wait()
                return await stores.approvals.decide(
                    T, request, approved=approved, by=f"op{i}", note=f"side {i}"
                )

        try:
            results[i] = asyncio.run(go())
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=decide, args=(i, a)) for i, a in enumerate(sides)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_approve_and_deny_racing_leave_one_decision_and_the_run_obeys_it(
    backend: str, tmp_path: Path
) -> None:
    airline = Airline()
    async with store_url(backend, tmp_path) as url:
        request = await _waiting(url, airline, BOOK_LH1)
        sides = [True, False, True, False, True, False]
        results = await asyncio.to_thread(_race, url, request, sides)
        won = [r for r in results if not isinstance(r, Exception)]
        lost = [r for r in results if isinstance(r, Exception)]
        assert won, results
        standing = {r.status for r in won}
        assert len(standing) == 1, results  # nobody was told a decision that does not stand
        [status] = standing
        for side, r in zip(sides, results, strict=True):
            wanted = ApprovalStatus.approved if side else ApprovalStatus.denied
            if wanted is status:
                assert not isinstance(r, Exception), r
            else:
                assert isinstance(r, ValueError), r
        assert len(won) + len(lost) == len(sides)
        async with _opened(url) as stores:
            stored = await stores.approvals.get(T, request)
        assert stored is not None and stored.status is status
        assert stored.by == won[0].by
        told = Told(BOOK_LH1)
        async with _opened(url) as stores:
            run = await _runner(stores, BOOK_LH1, told).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.completed
        if status is ApprovalStatus.approved:
            assert airline.sent == [("book", {"flight": "LH1", "memo": ""})]
        else:
            assert airline.sent == []
            assert any(t.startswith(f"denied by {stored.by}") for t in told.tool_texts), told


# --- 3. damaged or edited request rows --------------------------------------------------


def _template(tmp: Path) -> tuple[str, str, dict[str, Any]]:
    """A store with one run waiting on the approval of ``book(LH1, memo=…)``."""
    url = f"sqlite:///{tmp / 'template.sqlite3'}"
    turns = [[("book", {"flight": "LH1", "memo": "window seat please"})], "done"]
    request = asyncio.run(_waiting(url, Airline(), turns))
    with contextlib.closing(_db(url)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return url, request, {"turns": turns}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict[str, Any]]:
    return _template(tmp_path_factory.mktemp("template"))


def _copy(template_url: str, to: Path) -> str:
    src = template_url.removeprefix("sqlite:///")
    dst = to / f"copy-{time.monotonic_ns()}.sqlite3"
    with (
        contextlib.closing(sqlite3.connect(src)) as a,
        contextlib.closing(sqlite3.connect(dst)) as b,
    ):
        a.backup(b)
    return f"sqlite:///{dst}"


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(position=st.integers(min_value=0, max_value=10_000), bit=st.integers(0, 6))
def test_a_flipped_byte_in_a_request_row_never_sends_edited_arguments(
    template: tuple[str, str, dict[str, Any]], tmp_path: Path, position: int, bit: int
) -> None:
    """Flip one bit of the stored ``calls`` column, approve, resume: either the run is
    refused with a typed error and nothing is sent, or exactly what the model asked for
    (never the edited arguments) is sent once."""
    template_url, request, extra = template
    url = _copy(template_url, tmp_path)
    with contextlib.closing(_db(url)) as db:
        (calls,) = db.execute("SELECT calls FROM adk_approvals WHERE id = ?", (request,)).fetchone()
        raw = bytearray(calls.encode("utf-8"))
        at = position % len(raw)
        raw[at] ^= 1 << bit
        try:
            edited = raw.decode("utf-8")
        except UnicodeDecodeError:
            edited = raw.decode("latin-1")
        db.execute("UPDATE adk_approvals SET calls = ? WHERE id = ?", (edited, request))
        db.commit()
    airline = Airline()
    code, out, err = _cli(url, "approve", request, "--tenant", T, "--by", "alice")
    assert code in (0, 4), (code, out, err)
    assert "Traceback" not in err
    try:
        run = asyncio.run(_resume(url, airline, extra["turns"]))
    except CheckpointCorruptError:
        assert airline.sent == []
        return
    assert run.status is RunStatus.completed, run.status
    assert airline.sent == [("book", {"flight": "LH1", "memo": "window seat please"})]


async def test_arguments_swapped_between_two_requests_are_refused_typed(tmp_path: Path) -> None:
    """Two runs wait, one on LH1 and one on LH2; their requests' stored calls are swapped
    and both approved: neither may send the other's flight, and both refuse, typed."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    turns_a: list[Any] = [[("book", {"flight": "LH1"})], "done"]
    turns_b: list[Any] = [[("book", {"flight": "LH2"})], "done"]
    req_a = await _waiting(url, airline, turns_a, "a")
    req_b = await _waiting(url, airline, turns_b, "b")
    with contextlib.closing(_db(url)) as db:
        rows = dict(db.execute("SELECT id, calls FROM adk_approvals").fetchall())
        db.execute("UPDATE adk_approvals SET calls = ? WHERE id = ?", (rows[req_b], req_a))
        db.execute("UPDATE adk_approvals SET calls = ? WHERE id = ?", (rows[req_a], req_b))
        db.commit()
    for req in (req_a, req_b):
        code, _, err = _cli(url, "approve", req, "--tenant", T, "--by", "alice")
        assert code == 0, err
    for run_id, turns in (("a", turns_a), ("b", turns_b)):
        with pytest.raises(CheckpointCorruptError):
            await _resume(url, airline, turns, run_id)
    assert airline.sent == []


async def test_a_request_row_of_another_run_is_never_acted_on(tmp_path: Path) -> None:
    """Runs a and b wait on the same call (book LH1). The operator denies a and approves b.
    The two rows are then swapped in the store (each id now holds the other's row): run a
    finds an approved request that says it belongs to run b, and must refuse it."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    req_a = await _waiting(url, airline, BOOK_LH1, "a")
    req_b = await _waiting(url, airline, BOOK_LH1, "b")
    assert _cli(url, "approve", req_a, "--tenant", T, "--by", "alice", "--deny")[0] == 0
    assert _cli(url, "approve", req_b, "--tenant", T, "--by", "alice")[0] == 0
    with contextlib.closing(_db(url)) as db:
        db.execute("UPDATE adk_approvals SET id = 'swap' WHERE id = ?", (req_a,))
        db.execute("UPDATE adk_approvals SET id = ? WHERE id = ?", (req_a, req_b))
        db.execute("UPDATE adk_approvals SET id = ? WHERE id = 'swap'", (req_b,))
        db.commit()
    with contextlib.suppress(AdkError):
        await _resume(url, airline, BOOK_LH1, "a")
    assert airline.sent == [], "run a, denied by the operator, sent on run b's approval"


# --- 4. parallel calls, one of which needs a person ------------------------------------

PARALLEL: list[Any] = [[("hold", {"flight": "LH1"}), ("book", {"flight": "LH1"})], "done"]


@pytest.mark.parametrize("approve", [True, False])
async def test_one_of_two_parallel_calls_needing_approval_sends_nothing_first_then_each_once(
    tmp_path: Path, approve: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    async with _opened(url) as stores:
        run = await _runner(stores, PARALLEL).run(
            airline.agent(parallel=2), "go", tenant=T, run_id="r"
        )
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    assert airline.sent == []  # approvals first: not even the call that needs nobody
    assert [c.name for c in run.pending_approval.calls] == ["book"]
    argv = ["approve", run.pending_approval.id, "--tenant", T, "--by", "alice"]
    assert _cli(url, *argv, *([] if approve else ["--deny"]))[0] == 0
    told = Told(PARALLEL)
    for _ in range(2):  # a second resume finds the run finished and sends nothing
        async with _opened(url) as stores:
            done = await _runner(stores, PARALLEL, told).resume(
                airline.agent(parallel=2), "r", tenant=T
            )
        assert done.status is RunStatus.completed
    expected = [("hold", {"flight": "LH1"})]
    if approve:
        expected.append(("book", {"flight": "LH1", "memo": ""}))
    assert sorted(airline.sent, key=repr) == sorted(expected, key=repr)


# --- 5. secrets in arguments that need approval -----------------------------------------

SECRETS = {
    "openai": "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAB7CD0EF",
    "github": "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
    "password": "password=" + "Tr0ub4dor-and-3",
}


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(sorted(SECRETS)), where=st.sampled_from(["memo", "flight"]))
def test_a_secret_in_arguments_needing_approval_is_masked_everywhere_and_never_sent_masked(
    kind: str, where: str
) -> None:
    import tempfile

    secret = SECRETS[kind]
    needle = secret.split("=", 1)[-1]
    args = {"flight": "LH1", "memo": "seat 14C"}
    args[where] = f"{args[where]} {secret}"
    turns: list[Any] = [[("book", args)], "done"]
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/adk.sqlite3"
        airline = Airline()
        request = asyncio.run(_waiting(url, airline, turns))
        shown = []
        for argv in (
            ["inspect", "r", "--tenant", T],
            ["inspect", "r", "--tenant", T, "--json"],
            ["show", "r", "--tenant", T],
            ["runs", "--tenant", T],
            ["approve", request, "--tenant", T, "--by", "alice"],
            ["show", "r", "--tenant", T],
        ):
            code, out, err = _cli(url, *argv)
            assert code == 0, (argv, err)
            shown.append(out + err)
        told = Told(turns)
        run = asyncio.run(_resume_with(url, airline, turns, told))
        assert run.status is RunStatus.completed
        # The tool got the call whole, or not at all: never the masked arguments.
        assert airline.sent in ([], [("book", args)]), airline.sent
        assert not any("[redacted" in json.dumps(a) for _, a in airline.sent)
        for text in shown:
            assert needle not in text
        for name in os.listdir(tmp):
            data = Path(tmp, name).read_bytes()
            assert needle.encode() not in data, name


async def _resume_with(url: str, airline: Airline, turns: list[Any], told: Told) -> Any:
    async with _opened(url) as stores:
        return await _runner(stores, turns, told).resume(airline.agent(), "r", tenant=T)


# --- 6. other tenants -------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_a_tenant_never_sees_decides_or_inherits_another_tenants_approval(
    backend: str, tmp_path: Path
) -> None:
    """Tenants acme and rival each run ``r`` with the same call: acme's approval is not
    rival's, rival cannot read or decide acme's request, and rival's run still waits."""
    async with store_url(backend, tmp_path) as url:
        airline_a, airline_b = Airline(), Airline()
        async with _opened(url) as stores:
            run_a = await _runner(stores, BOOK_LH1).run(
                airline_a.agent(), "go", tenant=T, run_id="r"
            )
            run_b = await _runner(stores, BOOK_LH1).run(
                airline_b.agent(), "go", tenant="rival", run_id="r"
            )
            assert run_a.pending_approval is not None and run_b.pending_approval is not None
            req_a, req_b = run_a.pending_approval.id, run_b.pending_approval.id
            assert req_a != req_b
            assert await stores.approvals.get("rival", req_a) is None
            with pytest.raises(KeyError):
                await stores.approvals.decide("rival", req_a, approved=True, by="mallory")
        code, _, err = _cli(url, "approve", req_a, "--tenant", "rival", "--by", "mallory")
        assert code == 1 and "Traceback" not in err
        assert _cli(url, "approve", req_a, "--tenant", T, "--by", "alice")[0] == 0
        async with _opened(url) as stores:
            b = await _runner(stores, BOOK_LH1).resume(airline_b.agent(), "r", tenant="rival")
            assert b.status is RunStatus.waiting_approval
            a = await _runner(stores, BOOK_LH1).resume(airline_a.agent(), "r", tenant=T)
            assert a.status is RunStatus.completed
        assert airline_b.sent == []
        assert airline_a.sent == [("book", {"flight": "LH1", "memo": ""})]


# --- 7. approve, then SIGKILL a real process --------------------------------------------

AGENT_FILE = '''
import asyncio, json, os, sys, time
from tesserix_adk import Agent, ScriptedProvider, ToolContext, tool

AIRLINE = os.environ["APPROVAL_AIRLINE"]
PAUSE = os.environ.get("APPROVAL_PAUSE", "")

if PAUSE == "before-claim":
    # Stand still just before the approved call's claim: the decision is taken, nothing
    # of the call is durable yet.
    from tesserix_adk.stores.sqlite.idempotency import SqliteIdempotencyStore
    _claim = SqliteIdempotencyStore.claim

    async def claim(self, *args, **kwargs):
        if kwargs.get("tool") == "book":
            print("CLAIMING", flush=True)
            await asyncio.sleep(60)
        return await _claim(self, *args, **kwargs)

    SqliteIdempotencyStore.claim = claim


@tool(requires_approval=True)
def book(flight: str, memo: str, ctx: ToolContext) -> str:
    """Book one seat (needs a person)."""
    with open(AIRLINE, "a") as f:
        f.write(json.dumps({"flight": flight, "memo": memo, "key": ctx.idempotency_key}) + "\\n")
        f.flush()
        os.fsync(f.fileno())
    if PAUSE == "after-effect":
        print("BOOKED", flush=True)
        time.sleep(60)
    return "BK-" + flight


agent = Agent("booking", "Book.", [book])
PROVIDER = ScriptedProvider([[("book", {"flight": "LH1", "memo": "aisle"})], "done"])
'''


class Site:
    def __init__(self, tmp: Path) -> None:
        self.url = f"sqlite:///{tmp / 'adk.sqlite3'}"
        self.airline = tmp / "airline.jsonl"
        self.agent = tmp / "approval_agent.py"
        self.agent.write_text(AGENT_FILE)
        self.tmp = tmp

    def env(self, pause: str = "") -> dict[str, str]:
        return {
            **os.environ,
            "APPROVAL_AIRLINE": str(self.airline),
            "APPROVAL_PAUSE": pause,
            "ADK_STORE": self.url,
        }

    def sent(self) -> list[dict[str, Any]]:
        if not self.airline.exists():
            return []
        return [json.loads(line) for line in self.airline.read_text().splitlines()]

    def resume(self) -> subprocess.CompletedProcess[str]:
        """``tesserix run --resume`` in a process of its own."""
        argv = [TESSERIX, "run", "--resume", "r", "--tenant", T, "--agent"]
        argv += [f"{self.agent}:agent", "--worker", "w", "--store", self.url]
        return subprocess.run(
            argv, env=self.env(), cwd=self.tmp, capture_output=True, text=True, timeout=60
        )

    def dying_resume(self, pause: str) -> subprocess.Popen[str]:
        """A resume in a process of its own, holding the run under a 1 s lease and resume
        claim (so that once it is killed, they lapse soon), paused at ``pause``."""
        return subprocess.Popen(
            [sys.executable, "-c", RESUMER, self.url, str(self.agent)],
            env=self.env(pause),
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


RESUMER = """
import asyncio, importlib.util, sys
from tesserix_adk import AgentRunner, LeasePolicy
from tesserix_adk.stores import open_stores

url, path = sys.argv[1:3]
spec = importlib.util.spec_from_file_location("approval_agent", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)


async def main():
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(
            module.PROVIDER, stores, worker="dying",
            lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5), resume_claim_ttl=1.0,
        )
        run = await runner.resume(module.agent, "r", tenant="acme")
        print("STATUS", run.status.value, flush=True)


asyncio.run(main())
"""


def _start_waiting(site: Site) -> str:
    """Start the run in-process (the agent file's tool, the CLI's default lease) until it
    waits on its approval; the request id."""
    sys.path.insert(0, str(site.tmp))
    try:
        os.environ["APPROVAL_AIRLINE"] = str(site.airline)
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"agent_{id(site)}", site.agent)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(site.tmp))

    async def go() -> str:
        async with _opened(site.url) as stores:
            runner = AgentRunner.from_stores(
                module.PROVIDER, stores, lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5)
            )
            run = await runner.run(module.agent, "go", tenant=T, run_id="r")
        assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
        return run.pending_approval.id

    return asyncio.run(go())


def _kill_when(proc: subprocess.Popen[str], marker: str) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 45
    for line in proc.stdout:
        if marker in line:
            break
        assert time.monotonic() < deadline
    else:
        proc.kill()
        raise AssertionError(f"{marker} never printed: {proc.communicate()[1]}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def _lease_lapses() -> None:
    time.sleep(2.0)  # the dead holder's 1 s lease and resume claim lapse


def test_approved_then_killed_before_the_claim_sends_exactly_once_on_resume(
    tmp_path: Path,
) -> None:
    site = Site(tmp_path)
    request = _start_waiting(site)
    assert _cli(site.url, "approve", request, "--tenant", T, "--by", "alice")[0] == 0
    proc = site.dying_resume("before-claim")
    _kill_when(proc, "CLAIMING")
    assert site.sent() == []
    _lease_lapses()
    done = site.resume()
    assert done.returncode == 0, done.stderr
    again = site.resume()
    assert again.returncode == 0, again.stderr
    assert [(s["flight"], s["memo"]) for s in site.sent()] == [("LH1", "aisle")]


def test_approved_then_killed_after_the_effect_is_refused_never_sent_again(
    tmp_path: Path,
) -> None:
    site = Site(tmp_path)
    request = _start_waiting(site)
    assert _cli(site.url, "approve", request, "--tenant", T, "--by", "alice")[0] == 0
    proc = site.dying_resume("after-effect")
    _kill_when(proc, "BOOKED")
    _lease_lapses()
    refused = site.resume()
    assert refused.returncode == 4, (refused.stdout, refused.stderr)
    assert "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    # Approving again (the same decision) changes nothing and sends nothing.
    assert _cli(site.url, "approve", request, "--tenant", T, "--by", "alice")[0] == 0
    assert site.resume().returncode == 4
    assert [(s["flight"], s["memo"]) for s in site.sent()] == [("LH1", "aisle")]


# --- 8. a stale request after the model asked otherwise on resume -----------------------


async def test_approving_a_stale_request_never_sends_what_the_model_asks_now(
    tmp_path: Path,
) -> None:
    """Only ``after_tool_result`` frontiers: an attempt records its request for LH1 and
    dies before the ``before_approval`` frontier, so the resume asks the model again, which
    now wants LH2. The operator approves the stale LH1 request: nothing is sent (neither
    LH1, nobody's call now, nor LH2, never approved). Once LH2's own request is approved,
    LH2 alone goes out, once."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    first: list[Any] = [[("book", {"flight": "LH1"})], "done"]
    second: list[Any] = [[("book", {"flight": "LH2"})], "done"]
    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))

    def runner(stores: Stores, turns: list[Any]) -> AgentRunner:
        return AgentRunner.from_stores(
            ScriptedProvider(list(turns)),
            stores,
            policy=policy,
            lease_policy=LeasePolicy(ttl=0.5, renew_within=0.2),
            resume_claim_ttl=0.2,
        )

    async with _opened(url) as stores:
        asked: list[str] = []
        ask = stores.approvals.request

        async def ask_then_die(*args: Any, **kwargs: Any) -> Any:
            made = await ask(*args, **kwargs)
            asked.append(made.id)
            raise SimulatedCrash("died before the before_approval frontier")

        stores.approvals.request = ask_then_die  # type: ignore[method-assign]
        with pytest.raises(SimulatedCrash):
            await runner(stores, first).run(airline.agent(), "go", tenant=T, run_id="r")
        del stores.approvals.request
    [stale] = asked
    await asyncio.sleep(0.7)
    async with _opened(url) as stores:
        run = await runner(stores, second).run(airline.agent(), "go", tenant=T, run_id="r")
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    fresh = run.pending_approval.id
    assert fresh != stale
    assert [dict(c.arguments) for c in run.pending_approval.calls] == [{"flight": "LH2"}]
    code, _, err = _cli(url, "approve", stale, "--tenant", T, "--by", "alice")
    assert code in (0, 4), err
    async with _opened(url) as stores:
        still = await runner(stores, second).resume(airline.agent(), "r", tenant=T)
    assert still.status is RunStatus.waiting_approval
    assert airline.sent == []
    assert _cli(url, "approve", fresh, "--tenant", T, "--by", "alice")[0] == 0
    async with _opened(url) as stores:
        done = await runner(stores, second).resume(airline.agent(), "r", tenant=T)
    assert done.status is RunStatus.completed
    assert airline.sent == [("book", {"flight": "LH2", "memo": ""})]


# --- 9. a request row gone from under a waiting run ----------------------------------------


@pytest.mark.parametrize("damage", ["moved to another tenant", "deleted"])
async def test_a_waiting_run_whose_request_row_is_gone_is_refused_as_damage(
    tmp_path: Path, damage: str
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    request = await _waiting(url, airline, BOOK_LH1)
    assert _cli(url, "approve", request, "--tenant", T, "--by", "alice")[0] == 0
    with contextlib.closing(_db(url)) as db:
        if damage == "deleted":
            db.execute("DELETE FROM adk_approvals WHERE id = ?", (request,))
        else:
            db.execute("UPDATE adk_approvals SET tenant = 'acmf' WHERE id = ?", (request,))
        db.commit()
    with pytest.raises(AdkError) as refused:
        await _resume(url, airline, BOOK_LH1)
    assert airline.sent == []
    # The frontier stands (inspect shows it): "nothing checkpointed" is not what happened.
    assert _cli(url, "inspect", "r", "--tenant", T)[0] == 0
    assert exit_code_for(refused.value) is ExitCode.MUST_NOT_CARRY_ON, refused.value
