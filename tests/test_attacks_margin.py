"""Attacks on issue 20 point 1b: ``resolve --never-ran`` (and a reconciler's ``never_ran``)
only past a margin after the run's last lease ended, and on the declared store capabilities.

A strict xfail is a defect found (its reason says which); a plain test is a promise that held.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from adapters.services import postgres_schema, redis_stores, schema_url
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.leases import NEVER_RAN_MARGIN, Leaseholder, LeasePolicy, never_ran_wait
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import run_listing, step_history
from tesserix_adk.stores.memory.checkpoints import MemoryCheckpointStore
from tesserix_adk.stores.memory.leases import MemoryLeaseStore
from tesserix_adk.stores.protocols import RecordStatus, RunListing, StepHistory
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.clock import FakeClock

T, R = "acme", "r"

# --- every backend, store level ------------------------------------------------------------


@asynccontextmanager
async def _postgres() -> AsyncIterator[Stores]:
    from tesserix_adk.adapters.postgres import open_postgres_stores

    async with postgres_schema() as schema:
        stores = open_postgres_stores(schema_url(schema))
        try:
            await stores.create_schema()
            yield stores
        finally:
            await stores.aclose()


@asynccontextmanager
async def _opened(backend: str, tmp_path: Path) -> AsyncIterator[Stores]:
    if backend == "redis":
        async with redis_stores() as stores:
            yield stores
        return
    if backend == "postgres":
        async with _postgres() as stores:
            yield stores
        return
    url = "memory://" if backend == "memory" else f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        yield stores


BACKENDS = ["memory", "sqlite", "redis", "postgres"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_chain_lapsed_then_taken_and_released_reports_the_last_end(
    backend: str, tmp_path: Path
) -> None:
    """A lapsed; B took and released; C's previous_end and ended_ago are B's release, not
    A's older end (which would let the margin look long past)."""
    async with _opened(backend, tmp_path) as stores:
        a = await stores.leases.acquire(T, R, "A", 0.2)
        await asyncio.sleep(0.5)
        b = await stores.leases.acquire(T, R, "B", 30)
        assert b.previous_end is not None
        assert b.previous_end == pytest.approx(a.expires_at, abs=1e-3)
        await stores.leases.release(b)
        ago = await stores.leases.ended_ago(T, R)
        assert ago is not None and 0 <= ago < 0.4, ago
        c = await stores.leases.acquire(T, R, "C", 30)
        assert c.previous_end is not None
        assert c.previous_end > a.expires_at + 0.2
        assert c.previous_end <= c.expires_at - 30 + 1e-3
        assert await stores.leases.ended_ago(T, R) is None  # C is live


@pytest.mark.parametrize("backend", BACKENDS)
async def test_ended_ago_is_never_negative_and_rises(backend: str, tmp_path: Path) -> None:
    async with _opened(backend, tmp_path) as stores:
        lease = await stores.leases.acquire(T, R, "A", 30)
        assert await stores.leases.ended_ago(T, R) is None
        await stores.leases.release(lease)
        seen = []
        for _ in range(5):
            ago = await stores.leases.ended_ago(T, R)
            assert ago is not None and ago >= 0
            seen.append(ago)
            await asyncio.sleep(0.02)
        assert seen == sorted(seen) and seen[-1] > seen[0]
        # A release by a stale holder changes nothing.
        await stores.leases.release(lease)
        again = await stores.leases.ended_ago(T, R)
        assert again is not None and again >= seen[-1]


async def test_sqlite_ended_ago_survives_a_reopen(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        lease = await stores.leases.acquire(T, R, "A", 30)
        await stores.leases.release(lease)
        before = await stores.leases.ended_ago(T, R)
    async with open_stores(url) as stores:
        after = await stores.leases.ended_ago(T, R)
        nxt = await stores.leases.acquire(T, R, "B", 30)
    assert before is not None and after is not None and after >= before
    assert nxt.previous_end is not None and nxt.fence == lease.fence + 1


async def test_redis_a_resent_acquire_reports_the_same_previous_end() -> None:
    """redis-py resends a command whose reply was lost: the resend (same token) gets the
    lease it took, with the previous_end the first send saw, not its own grant."""
    async with redis_stores() as stores:
        leases: Any = stores.leases
        first = await leases.acquire(T, R, "A", 30)
        await leases.release(first)
        keys = [leases._lease(T, R), leases._keys.run(T, R, "lease:fence")]
        args = ["B", str(30_000_000), "tok-1"]
        sent = await leases._acquire(keys=keys, args=args)
        resent = await leases._acquire(keys=keys, args=args)
        assert sent[0] == resent[0] == b"ok"
        assert list(resent) == list(sent)
        assert sent[3]  # the release of A is on record
        other = await leases._acquire(keys=keys, args=["C", str(30_000_000), "tok-2"])
        assert other[0] == b"held"


async def test_postgres_acquire_racing_a_take_and_release_reports_the_latest_end() -> None:
    import psycopg

    from tesserix_adk.adapters.postgres import open_postgres_stores

    async with postgres_schema() as schema:
        stores = open_postgres_stores(schema_url(schema))
        try:
            await stores.create_schema()
            a = await stores.leases.acquire(T, R, "A", 0.2)
            await asyncio.sleep(0.4)  # A lapsed
            other = await psycopg.AsyncConnection.connect(schema_url(schema))
            try:
                # B takes the lapsed lease and releases it, committed only once C's acquire
                # has taken its snapshot and is waiting on the row.
                await other.execute(
                    "UPDATE adk_run_leases SET fence = fence + 1, holder = 'B', "
                    "expires_at = clock_timestamp() + interval '30 seconds' "
                    "WHERE tenant = %s AND run_id = %s",
                    (T, R),
                )
                c_task = asyncio.create_task(stores.leases.acquire(T, R, "C", 30))
                await asyncio.sleep(0.5)
                assert not c_task.done()
                cur = await other.execute(
                    "UPDATE adk_run_leases SET holder = NULL, expires_at = clock_timestamp() "
                    "WHERE tenant = %s AND run_id = %s "
                    "RETURNING extract(epoch FROM expires_at)::float8",
                    (T, R),
                )
                row = await cur.fetchone()
                assert row is not None
                b_end = float(row[0])
                await other.commit()
                c = await c_task
            finally:
                await other.close()
            assert c.fence == a.fence + 2
            assert c.previous_end is not None
            # The last lease before C is B's, released at b_end (well after A's end).
            assert c.previous_end >= b_end - 1e-3, (c.previous_end, b_end, a.expires_at)
        finally:
            await stores.aclose()


# --- the reconciler's wait (Leaseholder.since_previous_end) ----------------------------------


async def test_since_previous_end_counts_from_the_last_holder_in_a_chain() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore(clock=clock)
    policy = LeasePolicy(ttl=30, renew_within=10)
    await store.acquire(T, R, "A", 5)
    clock.advance(100)  # A lapsed long ago
    b = await store.acquire(T, R, "B", 30)
    clock.advance(1)
    await store.release(b)
    c = await store.acquire(T, R, "C", policy.ttl)
    held = Leaseholder(store, c, policy, monotonic=lambda: 0.0)
    since = held.since_previous_end()
    assert since is not None and since < 0.5
    assert never_ran_wait(since) == pytest.approx(NEVER_RAN_MARGIN, abs=0.5)


async def test_since_previous_end_is_kept_across_renewals() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore(clock=clock)
    policy = LeasePolicy(ttl=30, renew_within=10)
    first = await store.acquire(T, R, "A", 5)
    clock.advance(5)  # A lapsed just now
    c = await store.acquire(T, R, "C", policy.ttl)
    assert c.previous_end == first.expires_at
    held = Leaseholder(store, c, policy, monotonic=lambda: 0.0)
    clock.advance(20)
    await held.renew()
    since = held.since_previous_end()
    # Store time since A's end is 20 s; the holder may understate it, never overstate.
    assert since is not None and since <= 20 + 1e-6


# --- the CLI, memory and SQLite ------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite"])
def make_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    if request.param == "memory":
        shared = open_stores(url)
        yield lambda: shared
        return

    async def apply() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()

    asyncio.run(apply())
    yield lambda: open_stores(url)


def _in(stores: Stores, coro_fn: Any) -> Any:
    async def go() -> Any:
        try:
            return await coro_fn(stores)
        finally:
            await stores.aclose()

    return asyncio.run(go())


async def _claim(stores: Stores, key: str, call_id: str, fence: int | None) -> None:
    await stores.idempotency.claim(
        key,
        holder="w-dead",
        tenant=T,
        run_id=R,
        iteration=1,
        tool="book_seat",
        call_id=call_id,
        flags=None,
        fence=fence,
    )


def _resolve(make_stores: Any, call: str, *what: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(
        ["resolve", R, "--tenant", T, "--call", call, *what, "--by", "on-call"],
        stores=make_stores(),
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def _status(make_stores: Any, key: str) -> RecordStatus:
    async def go(stores: Stores) -> RecordStatus:
        (record,) = [r for r in await stores.idempotency.records(T, R) if r.key == key]
        return record.status

    return _in(make_stores(), go)  # type: ignore[no-any-return]


def _ended_ago(make_stores: Any) -> Any:
    return _in(make_stores(), lambda s: s.leases.ended_ago(T, R))


def test_never_ran_after_a_chain_waits_for_the_last_holder(make_stores: Any) -> None:
    """A claimed and lapsed long ago; B took the run and released it just now: the margin
    runs from B's end, not A's."""

    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 0.1)
        await _claim(stores, "k-1", "call_1_0", a.fence)
        await asyncio.sleep(1.2)
        b = await stores.leases.acquire(T, R, "B", 30)
        await stores.leases.release(b)

    _in(make_stores(), go)
    code, _, err = _resolve(make_stores, "call_1_0", "--never-ran", "--margin", "1")
    assert code == ExitCode.HELD, err
    assert _status(make_stores, "k-1") is RecordStatus.in_flight


def test_never_ran_while_a_lease_is_live_is_held_and_changes_nothing(make_stores: Any) -> None:
    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 60)
        await _claim(stores, "k-1", "call_1_0", a.fence)

    _in(make_stores(), go)
    for _ in range(2):
        code, _, err = _resolve(make_stores, "call_1_0", "--never-ran", "--margin", "0")
        assert code == ExitCode.HELD, err
    assert _ended_ago(make_stores) is None  # still A's live lease
    assert _status(make_stores, "k-1") is RecordStatus.in_flight


def test_an_outcome_within_the_margin_is_recorded(make_stores: Any) -> None:
    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 0.1)
        await _claim(stores, "k-1", "call_1_0", a.fence)
        await asyncio.sleep(0.2)

    _in(make_stores(), go)
    code, _, err = _resolve(make_stores, "call_1_0", "--outcome", '{"ok": 1}', "--margin", "3600")
    assert code == ExitCode.CARRIED_ON, err
    assert _status(make_stores, "k-1") is RecordStatus.completed


def test_a_refused_never_ran_does_not_push_the_margin_back(make_stores: Any) -> None:
    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 0.1)
        await _claim(stores, "k-1", "call_1_0", a.fence)
        await _claim(stores, "k-2", "call_1_1", a.fence)
        await stores.idempotency.resolve("k-1", b'{"ok": 1}', tenant=T, by="x")
        await asyncio.sleep(1.0)

    _in(make_stores(), go)
    before = _ended_ago(make_stores)
    assert before is not None and before >= 0.9
    code, _, err = _resolve(make_stores, "call_1_0", "--never-ran", "--margin", "0.5")
    assert code == ExitCode.MUST_NOT_CARRY_ON and "not in flight" in err, err
    # The other call in doubt was past its margin and still is.
    assert _ended_ago(make_stores) >= before
    code, _, err = _resolve(make_stores, "call_1_1", "--never-ran", "--margin", "0.5")
    assert code == ExitCode.CARRIED_ON, err


def test_never_ran_is_refused_while_a_leaseless_carrier_holds_the_run_claim(
    make_stores: Any,
) -> None:
    async def go(stores: Stores) -> None:
        from tesserix_adk.run.attempt import run_claim_key

        await stores.idempotency.claim(
            run_claim_key(T, R),
            holder="w-live",
            tenant=T,
            run_id=R,
            iteration=None,
            tool=None,
            call_id=None,
            flags=None,
            ttl=120,
        )
        await _claim(stores, "k-1", "call_1_0", None)

    _in(make_stores(), go)
    code, _, err = _resolve(make_stores, "call_1_0", "--never-ran")
    assert code == ExitCode.HELD, err
    assert _status(make_stores, "k-1") is RecordStatus.in_flight


@pytest.mark.parametrize("margin", ["1e999", "-0.5", "NaN", " inf", "", "10s", "0x10"])
def test_a_bad_margin_is_a_usage_error_in_one_sentence(make_stores: Any, margin: str) -> None:
    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 0.1)
        await _claim(stores, "k-1", "call_1_0", a.fence)
        await asyncio.sleep(0.2)

    _in(make_stores(), go)
    code, _, err = _resolve(make_stores, "call_1_0", "--never-ran", f"--margin={margin}")
    assert code == ExitCode.USAGE, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "margin" in lines[0], err
    assert _status(make_stores, "k-1") is RecordStatus.in_flight


def test_margin_zero_records_at_once_after_a_lapse(make_stores: Any) -> None:
    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 0.1)
        await _claim(stores, "k-1", "call_1_0", a.fence)
        await asyncio.sleep(0.2)

    _in(make_stores(), go)
    code, _, err = _resolve(make_stores, "call_1_0", "--never-ran", "--margin", "0")
    assert code == ExitCode.CARRIED_ON, err
    assert _status(make_stores, "k-1") is RecordStatus.never_ran


# --- declared capabilities -----------------------------------------------------------------


class _Minimal:
    """A checkpoint store offering only the required methods."""

    def __init__(self, inner: MemoryCheckpointStore) -> None:
        self.inner = inner

    async def put(self, *args: Any, **kwargs: Any) -> None:
        await self.inner.put(*args, **kwargs)

    async def latest(self, tenant: str, run_id: str) -> Any:
        return await self.inner.latest(tenant, run_id)

    async def forget(self, tenant: str, run_id: str) -> None:
        await self.inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        await self.inner.seal(tenant, run_id, fence)


def _minimal_stores() -> Stores:
    from dataclasses import replace

    base = open_stores("memory://")
    return replace(base, checkpoints=_Minimal(base.checkpoints))  # type: ignore[arg-type]


def _cli(stores: Stores, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(list(argv), stores=stores, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "capability"),
    [(("steps", R, "--tenant", T), "StepHistory"), (("runs", "--tenant", T), "RunListing")],
)
def test_the_cli_on_a_store_without_a_capability_says_so_in_one_sentence(
    argv: tuple[str, ...], capability: str
) -> None:
    code, _, err = _cli(_minimal_stores(), *argv)
    assert code == ExitCode.USAGE, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and capability in lines[0] and "_Minimal" in lines[0], err
    assert "Traceback" not in err


def test_inspect_needs_no_optional_capability() -> None:
    code, _, err = _cli(_minimal_stores(), "inspect", R, "--tenant", T)
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert "nothing is checkpointed" in err


def test_the_minimal_store_is_declared_without_the_capabilities() -> None:
    store = _Minimal(MemoryCheckpointStore())
    assert not isinstance(store, StepHistory) and not isinstance(store, RunListing)
    with pytest.raises(ConfigurationError, match="StepHistory"):
        step_history(store)
    with pytest.raises(ConfigurationError, match="RunListing"):
        run_listing(store)


@pytest.mark.parametrize("wrapper", ["pausing", "faulty"])
def test_a_wrapper_declares_only_what_its_inner_store_offers(wrapper: str) -> None:
    inner = _Minimal(MemoryCheckpointStore())
    if wrapper == "pausing":
        from tesserix_adk.cli.worker import PausingCheckpointStore

        wrapped: Any = PausingCheckpointStore(inner)  # type: ignore[arg-type]
    else:
        from tesserix_adk.testing.faults import FaultyCheckpointStore

        wrapped = FaultyCheckpointStore(inner)  # type: ignore[arg-type]
    assert not isinstance(wrapped, StepHistory)
    assert not isinstance(wrapped, RunListing)


# --- a released lease while the claimant's sync tool thread still runs ---------------------


def test_never_ran_is_refused_while_a_cancelled_runs_tool_thread_still_runs(
    tmp_path: Path,
) -> None:
    from tesserix_adk import Agent, AgentRunner, Checkpointer, ScriptedProvider, tool

    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def apply() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()

    asyncio.run(apply())
    started, asked, go = threading.Event(), threading.Event(), threading.Event()
    sent: list[str] = []

    @tool
    def book_seat(flight: str) -> str:
        """Book a seat (a blocking HTTP call that has not left yet)."""
        started.set()
        go.wait(10)
        sent.append(flight)
        return "booked"

    async def carrier() -> None:
        async with open_stores(url) as stores:
            runner = AgentRunner(
                ScriptedProvider([[("book_seat", {"flight": "LH123"})], "done"]),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(stores.checkpoints),
                leases=stores.leases,
                lease_policy=LeasePolicy(ttl=5, renew_within=2),
            )
            agent = Agent("booking", "Book.", [book_seat])
            task = asyncio.create_task(runner.run(agent, "book", tenant=T, run_id=R))
            await asyncio.to_thread(started.wait, 10)
            task.cancel()
            asked.set()
            with pytest.raises(BaseException):  # noqa: B017 - cancelled, however it ends
                await task

    worker = threading.Thread(target=lambda: asyncio.run(carrier()))
    worker.start()
    try:
        # Cancelled while its thread is inside the call: the run keeps its lease until the
        # thread returns (it cannot be stopped), so nobody may say the call never ran.
        assert asked.wait(10)

        async def key_of(stores: Stores) -> str:
            (record,) = [r for r in await stores.idempotency.records(T, R) if r.tool]
            assert record.status is RecordStatus.in_flight
            return record.key

        key = _in(open_stores(url), key_of)
        time.sleep(0.7)
        code, _, err = _resolve(lambda: open_stores(url), key, "--never-ran", "--margin", "0.5")
        recorded = _status(lambda: open_stores(url), key) is RecordStatus.never_ran
    finally:
        go.set()
        worker.join(15)
    assert sent == ["LH123"]  # the thread did send it
    assert code == ExitCode.HELD and not recorded, err


# --- SQLite: the store's clock is the calling process's wall clock -------------------------


@pytest.mark.xfail(
    strict=True,
    reason=(
        "on SQLite the margin is measured by the resolving process's wall clock, so an "
        "operator whose clock is 90 s ahead records never-ran for a call whose claimant's "
        "lease is live for another minute (the known clock limit, issue 20 point 7)"
    ),
)
def test_sqlite_never_ran_from_an_operator_whose_clock_is_ahead(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from reliability.skew import faketime_env, libfaketime

    so = libfaketime()
    if so is None:
        pytest.skip("libfaketime is not installed")
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def claimant(stores: Stores) -> None:
        await stores.create_schema()
        lease = await stores.leases.acquire(T, R, "w-live", 60)
        await _claim(stores, "k-1", "call_1_0", lease.fence)

    _in(open_stores(url), claimant)
    tesserix = Path(sys.executable).parent / "tesserix"
    argv = [str(tesserix), "resolve", R, "--store", url, "--tenant", T, "--call", "call_1_0"]
    done = subprocess.run(
        [*argv, "--never-ran", "--by", "on-call"],
        env={**os.environ, **faketime_env(so, "+90s")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # By the true clock the claimant's lease is live: it may be sending the call now.
    assert done.returncode == ExitCode.HELD, done.stdout + done.stderr
    assert _status(lambda: open_stores(url), "k-1") is RecordStatus.in_flight


async def test_postgres_never_ran_from_an_operator_whose_clock_is_ahead_is_held() -> None:
    """PostgreSQL decides by the server's clock: a skewed operator changes nothing."""
    import os
    import sys

    from reliability.skew import faketime_env, libfaketime
    from tesserix_adk.adapters.postgres import open_postgres_stores

    so = libfaketime()
    if so is None:
        pytest.skip("libfaketime is not installed")
    async with postgres_schema() as schema:
        url = schema_url(schema)
        stores = open_postgres_stores(url)
        try:
            await stores.create_schema()
            lease = await stores.leases.acquire(T, R, "w-live", 60)
            await _claim(stores, "k-1", "call_1_0", lease.fence)
            tesserix = Path(sys.executable).parent / "tesserix"
            proc = await asyncio.create_subprocess_exec(
                str(tesserix),
                *("resolve", R, "--store", url, "--tenant", T, "--call", "call_1_0"),
                *("--never-ran", "--by", "on-call"),
                env={**os.environ, **faketime_env(so, "+90s")},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == ExitCode.HELD, (out + err).decode()
            (record,) = [r for r in await stores.idempotency.records(T, R) if r.tool]
            assert record.status is RecordStatus.in_flight
        finally:
            await stores.aclose()


class _ComeAndGo:
    """A lease store where another holder takes and releases the run right after the
    operator's first look (``ended_ago``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        ago = await self.inner.ended_ago(tenant, run_id)
        b = await self.inner.acquire(tenant, run_id, "B", 30)
        await self.inner.release(b)
        return ago  # type: ignore[no-any-return]


def test_never_ran_sees_a_holder_that_came_and_went_after_the_first_look(
    make_stores: Any,
) -> None:
    from dataclasses import replace

    async def go(stores: Stores) -> None:
        a = await stores.leases.acquire(T, R, "A", 0.1)
        await _claim(stores, "k-1", "call_1_0", a.fence)
        await asyncio.sleep(1.2)

    _in(make_stores(), go)

    def racing() -> Stores:
        stores = make_stores()
        return replace(stores, leases=_ComeAndGo(stores.leases))

    code, _, err = _resolve(racing, "call_1_0", "--never-ran", "--margin", "1")
    assert code == ExitCode.HELD, err
    assert "margin" in err
    assert _status(make_stores, "k-1") is RecordStatus.in_flight
