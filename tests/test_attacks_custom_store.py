"""A user's own store: optional capabilities absent, conformance suites against broken
stores, and the two latest refactors (``stores.rows.listed_items`` /
``listing_around_damage`` and ``run.approvals.of_the_turn``).

A custom store reaches the CLI only through the embeddable entry points
(``frontier_main``/``resume_main``/``run_command`` take a ``Stores``) and the console only
through ``create_app(Stores)``: the ``tesserix`` command itself takes a URL and knows no
scheme but the built-in ones.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import io
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import httpx
import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, LeasePolicy, ScriptedProvider
from tesserix_adk.cli import ExitCode, resume_main
from tesserix_adk.cli.commands import (
    add_frontier_commands,
    add_resume_commands,
    add_worker_commands,
    new_parser,
    run_command,
)
from tesserix_adk.console import create_app
from tesserix_adk.errors import CheckpointCorruptError, IndeterminateToolCallError
from tesserix_adk.run.approvals import of_the_turn
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import (
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    MemoryWorkIndex,
)
from tesserix_adk.stores.protocols import (
    ApprovalRequest,
    DamagedEntry,
    RunListing,
    StepHistory,
    StoredCheckpoint,
    WorkIndex,
    WorkItem,
    WorkListing,
    WorksAroundDamage,
    WorkState,
)
from tesserix_adk.stores.rows import listed_items, listing_around_damage
from tesserix_adk.testing import (
    ApprovalStoreConformance,
    CheckpointStoreConformance,
    FakeClock,
    LeaseStoreConformance,
    WorkIndexConformance,
)
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "acme-custom"
AGENT = "booking"


# --- stores a user writes ------------------------------------------------------------------


class LatestOnly:
    """A checkpoint store with the four required methods only: no steps, no run listing."""

    def __init__(self) -> None:
        self._inner = MemoryCheckpointStore()

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        await self._inner.put(tenant, run_id, payload, step=step, fence=fence)

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        return await self._inner.latest(tenant, run_id)

    async def forget(self, tenant: str, run_id: str) -> None:
        await self._inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        await self._inner.seal(tenant, run_id, fence)


class PlainWork:
    """A work index with the required methods only (no ``WorksAroundDamage``); the entries
    of ``damaged`` runs read as a damaged row does (``CheckpointCorruptError``)."""

    def __init__(self, inner: MemoryWorkIndex, damaged: Sequence[str] = ()) -> None:
        self.inner = inner
        self.damaged = set(damaged)

    def _check(self, items: list[WorkItem]) -> list[WorkItem]:
        for i in items:
            if i.run_id in self.damaged:
                raise CheckpointCorruptError(
                    f"a stored work item cannot be read (state 'hand-edited' of {i.run_id})"
                )
        return items

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        return await self.inner.submit(tenant, run_id, agent=agent, input=input)

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        return await self.inner.input(tenant, run_id)

    async def entry(self, tenant: str, run_id: str) -> WorkItem | None:
        got = await self.inner.entry(tenant, run_id)
        return None if got is None else self._check([got])[0]

    async def want(self, tenant: str, run_id: str, **kwargs: Any) -> None:
        await self.inner.want(tenant, run_id, **kwargs)

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        await self.inner.park(tenant, run_id, agent=agent, reason=reason)

    async def done(self, tenant: str, run_id: str) -> None:
        await self.inner.done(tenant, run_id)

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        # A worker's poll leaves a damaged entry out (as the built-in ones do).
        got = await self.inner.due(limit=limit, agents=agents)
        return [i for i in got if i.run_id not in self.damaged]

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        return self._check(await self.inner.items(tenant, state=state))


def custom_stores(clock: FakeClock, *, damaged: Sequence[str] = ()) -> Stores:
    """A user's bundle: memory stores on ``clock`` but a checkpoint store and a work index
    without any optional capability."""
    leases = MemoryLeaseStore(clock=clock)
    return Stores(
        checkpoints=LatestOnly(),
        idempotency=MemoryIdempotencyStore(clock=clock),
        leases=leases,
        history=MemoryHistoryStore(),
        ledger=MemoryLedger(),
        approvals=MemoryApprovalStore(),
        work=PlainWork(MemoryWorkIndex(leases, clock=clock), damaged),
    )


def runner_over(stores: Stores, checkpoints: Any = None, **kwargs: Any) -> AgentRunner:
    return AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(checkpoints or stores.checkpoints, history=stores.history),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        work=stores.work,
        lease_policy=LeasePolicy(ttl=5, renew_within=2),
        **kwargs,
    )


def _after_tool_result_of_turn_1(body: dict[str, Any]) -> bool:
    return bool(body.get("boundary") == "after_tool_result" and body.get("iteration") == 1)


# --- (1) optional capabilities absent: the runner ------------------------------------------


def test_the_custom_bundle_really_lacks_the_optional_capabilities(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    assert not isinstance(stores.checkpoints, StepHistory)
    assert not isinstance(stores.checkpoints, RunListing)
    assert isinstance(stores.work, WorkIndex)
    assert not isinstance(stores.work, WorksAroundDamage)


async def test_a_crash_after_the_booking_was_recorded_resumes_with_one_booking(
    clock: FakeClock, airline: Airline
) -> None:
    """Died before the ``after_tool_result`` frontier: the outcome is recorded, so the
    resume replays it; the airline holds one booking."""
    stores = custom_stores(clock)
    died = runner_over(
        stores,
        FaultyCheckpointStore(stores.checkpoints, crash_before=_after_tool_result_of_turn_1),
    )
    with pytest.raises(SimulatedCrash):
        await died.run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert airline.bookings == ["LH123"]
    clock.advance(10)  # the dead attempt's lease lapses
    run = await runner_over(stores).resume(booking_agent(airline), "r1", tenant=T)
    assert run.status.value == "completed"
    assert airline.bookings == ["LH123"]


async def test_a_crash_inside_the_booking_is_refused_never_sent_again(
    clock: FakeClock, airline: Airline
) -> None:
    stores = custom_stores(clock)

    def die(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash("died inside book_seat, after the airline took it")

    airline.hook = die
    with pytest.raises(SimulatedCrash):
        await runner_over(stores).run(booking_agent(airline), "book", tenant=T, run_id="r2")
    airline.hook = None
    clock.advance(10)
    with pytest.raises(IndeterminateToolCallError):
        await runner_over(stores).resume(booking_agent(airline), "r2", tenant=T)
    assert airline.bookings == ["LH123"]


# --- (1) optional capabilities absent: the CLI ---------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = new_parser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_frontier_commands(sub)
    add_resume_commands(sub)
    add_worker_commands(sub)
    return parser


def cli(stores: Stores, *argv: str) -> tuple[int, str, str]:
    """A command of the product's own CLI over ``stores`` (closed afterwards: memory stores
    keep their data)."""
    out, err = io.StringIO(), io.StringIO()
    args = _parser().parse_args(list(argv))
    agents = {AGENT: booking_agent(Airline())}
    code = run_command(args, stores=stores, agents=agents, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _one_sentence(code: int, err: str) -> None:
    assert code in {int(c) for c in ExitCode}, code
    assert "Traceback" not in err
    assert err.count("\n") <= 1, err


async def _a_run_in_doubt(stores: Stores, clock: FakeClock) -> Airline:
    airline = Airline()

    def die(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash("died inside book_seat")

    airline.hook = die
    with pytest.raises(SimulatedCrash):
        await runner_over(stores).run(booking_agent(airline), "book", tenant=T, run_id="doubt")
    clock.advance(10)
    return airline


def test_inspect_and_show_work_or_name_the_missing_capability(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    asyncio.run(_a_run_in_doubt(stores, clock))
    code, out, err = cli(stores, "inspect", "doubt", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "book_seat" in out and "indeterminate" in out
    code, out, err = cli(stores, "show", "doubt", "--tenant", T)
    _one_sentence(code, err)
    if code != ExitCode.CARRIED_ON:
        assert "does not offer StepHistory" in err


def test_runs_and_stuck_without_run_listing_say_so_in_one_sentence(
    clock: FakeClock,
) -> None:
    stores = custom_stores(clock)
    asyncio.run(_a_run_in_doubt(stores, clock))
    for argv in (("runs", "--tenant", T), ("runs", "--tenant", T, "--stuck")):
        code, _, err = cli(stores, *argv)
        assert code == ExitCode.USAGE, (argv, err)
        _one_sentence(code, err)
        assert "does not offer RunListing" in err


def test_resume_of_a_run_in_doubt_exits_4_and_books_nothing(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    airline = asyncio.run(_a_run_in_doubt(stores, clock))
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        ["run", "--resume", "doubt", "--tenant", T, "--agent", AGENT],
        stores=stores,
        agents={AGENT: booking_agent(airline)},
        provider=lambda: ScriptedProvider(BOOK_TURNS),
        out=out,
        err=err,
    )
    assert code == ExitCode.MUST_NOT_CARRY_ON, err.getvalue()
    _one_sentence(code, err.getvalue())
    assert airline.bookings == ["LH123"]


def test_resolve_then_resume_completes_with_one_booking(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    airline = asyncio.run(_a_run_in_doubt(stores, clock))
    airline.hook = None
    code, out, err = cli(
        stores,
        "resolve",
        "doubt",
        "--tenant",
        T,
        "--call",
        "call_1_0",
        "--outcome",
        '{"booking": "B1", "flight": "LH123"}',
        "--by",
        "ops",
    )
    assert code == ExitCode.CARRIED_ON, err + out
    run = asyncio.run(runner_over(stores).resume(booking_agent(airline), "doubt", tenant=T))
    assert run.status.value == "completed"
    assert airline.bookings == ["LH123"]


def test_cancel_of_a_run_with_a_plain_work_index(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    asyncio.run(_a_run_in_doubt(stores, clock))
    code, _, err = cli(stores, "cancel", "doubt", "--tenant", T, "--by", "ops")
    _one_sentence(code, err)
    assert code in (ExitCode.CARRIED_ON, ExitCode.MUST_NOT_CARRY_ON), err


# --- (1) a damaged entry in an index without WorksAroundDamage -----------------------------


def test_one_damaged_entry_in_a_plain_index_does_not_hide_runs_with_a_frontier(
    clock: FakeClock,
) -> None:
    """README: without ``WorksAroundDamage`` a damaged row stops the listing of runs not
    started yet, said in one row; the runs with a frontier are still listed."""
    leases = MemoryLeaseStore(clock=clock)
    work = PlainWork(MemoryWorkIndex(leases, clock=clock), damaged=["broken"])
    base = custom_stores(clock)
    stores = replace(base, checkpoints=MemoryCheckpointStore(), leases=leases, work=work)
    airline = Airline()

    async def setup() -> None:
        run = await runner_over(stores).run(booking_agent(airline), "book", tenant=T, run_id="fine")
        assert run.status.value == "completed"
        await work.submit(T, "broken", agent=AGENT, input=b"{}")
        await work.submit(T, "waiting", agent=AGENT, input=b"{}")

    asyncio.run(setup())
    code, out, err = cli(stores, "runs", "--tenant", T)
    _one_sentence(code, err)
    assert "fine" in out, out + err
    assert "unreadable" in out and "broken" in out


# --- (1) optional capabilities absent: the console -----------------------------------------


async def _page(stores: Stores, path: str) -> httpx.Response:
    app = create_app(stores)
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")
    async with app.router.lifespan_context(app), client:
        return await client.get(path)


async def test_console_run_page_of_a_store_without_step_history(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    await _a_run_in_doubt(stores, clock)
    page = await _page(stores, f"/t/{T}/runs/doubt")
    assert "Traceback" not in page.text
    assert page.status_code == 200, page.text
    assert "book_seat" in page.text and "resolve" in page.text.lower()
    assert "steps cannot be listed" in page.text and "StepHistory" in page.text


async def test_console_runs_page_of_a_store_without_run_listing(clock: FakeClock) -> None:
    stores = custom_stores(clock)
    await _a_run_in_doubt(stores, clock)
    page = await _page(stores, f"/t/{T}/runs")
    assert "Traceback" not in page.text
    assert "does not offer RunListing" in page.text, page.text


# --- (2) the conformance suites against deliberately broken stores -------------------------


class _NoRoundTrips:
    """The ``request`` a suite's round-trip tests ask for: no ``round_trips`` here."""

    def getfixturevalue(self, name: str) -> None:
        return None


async def suite_failures(
    suite: type, fixtures: Callable[[], Awaitable[dict[str, Any]]]
) -> set[str]:
    """Run every test of ``suite`` with fresh ``fixtures``: the names of those that fail
    (a skip is no failure)."""
    failed: set[str] = set()
    for name in sorted(n for n in dir(suite) if n.startswith("test_")):
        method = getattr(suite(), name)
        given = await fixtures()
        patch = pytest.MonkeyPatch()
        given |= {"request": _NoRoundTrips(), "monkeypatch": patch}
        kwargs = {p: given[p] for p in inspect.signature(method).parameters}
        try:
            await method(**kwargs)
        except pytest.skip.Exception:
            continue
        except (Exception, pytest.fail.Exception):
            failed.add(name)
        finally:
            patch.undo()
    return failed


def work_fixtures(make: Callable[[MemoryLeaseStore, FakeClock], WorkIndex]) -> Any:
    async def fixtures() -> dict[str, Any]:
        clock = FakeClock()
        leases = MemoryLeaseStore(clock=clock)
        return {"work_index": make(leases, clock), "work_leases": leases, "clock": clock}

    return fixtures


class NewestFirstWork(MemoryWorkIndex):
    """Lists a tenant's entries newest first (``items`` and ``listing`` alike)."""

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        return list(reversed(await super().items(tenant, state=state)))

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        return WorkListing(tuple(await self.items(tenant, state=state)))


class EveryTenantsListing(MemoryWorkIndex):
    """Offers ``WorksAroundDamage`` but its ``listing`` forgets the tenant it was asked
    for: every tenant's runs in one tenant's listing."""

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        return WorkListing(tuple(await super().items(None, state=state)))


class ListingIgnoresState(MemoryWorkIndex):
    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        return WorkListing(tuple(await super().items(tenant)))


class ForgetfulDone(MemoryWorkIndex):
    """Loses the write of ``done``."""

    async def done(self, tenant: str, run_id: str) -> None:
        return None


class DueIgnoresLeases(MemoryWorkIndex):
    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        items = [i for i in await super().items() if i.state is not WorkState.parked]
        return items[:limit]


async def test_the_harness_passes_the_built_in_work_index() -> None:
    """The harness itself: the shipped memory index fails nothing."""
    got = await suite_failures(
        WorkIndexConformance,
        work_fixtures(lambda leases, clock: MemoryWorkIndex(leases, clock=clock)),
    )
    assert got == set()


@pytest.mark.parametrize("broken", [ForgetfulDone, DueIgnoresLeases, ListingIgnoresState])
async def test_the_work_index_suite_catches_a_broken_index(broken: type) -> None:
    got = await suite_failures(
        WorkIndexConformance, work_fixtures(lambda leases, clock: broken(leases, clock=clock))
    )
    assert got, f"{broken.__name__} passed the whole WorkIndexConformance"


async def test_the_work_index_suite_catches_a_listing_that_ignores_the_tenant() -> None:
    got = await suite_failures(
        WorkIndexConformance,
        work_fixtures(lambda leases, clock: EveryTenantsListing(leases, clock=clock)),
    )
    assert got, "EveryTenantsListing passed the whole WorkIndexConformance"


async def test_the_work_index_suite_catches_a_listing_newest_first() -> None:
    got = await suite_failures(
        WorkIndexConformance,
        work_fixtures(lambda leases, clock: NewestFirstWork(leases, clock=clock)),
    )
    assert got, "NewestFirstWork passed the whole WorkIndexConformance"


class IgnoresFences(MemoryCheckpointStore):
    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        await super().put(tenant, run_id, payload, step=step, fence=None)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        return None


class StaleLatest(MemoryCheckpointStore):
    """``latest`` answers the first frontier it ever read for a run (a stale cache)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cache: dict[tuple[str, str], StoredCheckpoint | None] = {}

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        if (tenant, run_id) not in self.cache:
            self.cache[tenant, run_id] = await super().latest(tenant, run_id)
        return self.cache[tenant, run_id]


class LosesEveryOtherPut(MemoryCheckpointStore):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n = 0

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        self.n += 1
        if self.n % 2 == 0:
            return
        await super().put(tenant, run_id, payload, step=step, fence=fence)


class ReorderedSteps(MemoryCheckpointStore):
    async def steps(self, tenant: str, run_id: str) -> list[int]:
        return list(reversed(await super().steps(tenant, run_id)))


@pytest.mark.parametrize("broken", [IgnoresFences, StaleLatest, LosesEveryOtherPut, ReorderedSteps])
async def test_the_checkpoint_suite_catches_a_broken_store(broken: type) -> None:
    async def fixtures() -> dict[str, Any]:
        async def make(keep_last: int) -> Any:
            return broken(keep_last=keep_last)

        return {"checkpoint_store": broken(), "make_checkpoint_store": make, "clock": None}

    assert await suite_failures(CheckpointStoreConformance, fixtures)


class SameFenceLeases(MemoryLeaseStore):
    """Hands every acquisition fence 1: a stale holder is never told apart."""

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> Any:
        lease = await super().acquire(tenant, run_id, holder, ttl)
        return replace(lease, fence=1)


async def test_the_lease_suite_catches_fences_that_do_not_rise() -> None:
    async def fixtures() -> dict[str, Any]:
        clock = FakeClock()
        return {"lease_store": SameFenceLeases(clock=clock), "clock": clock}

    assert await suite_failures(LeaseStoreConformance, fixtures)


class TenantBlindApprovals(MemoryApprovalStore):
    """Finds a request by its id in whichever tenant holds it."""

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        for t in ("acme", "globex", tenant):
            got = await super().get(t, id)
            if got is not None:
                return got
        return None


async def test_the_approval_suite_catches_a_store_blind_to_tenants() -> None:
    async def fixtures() -> dict[str, Any]:
        return {"approval_store": TenantBlindApprovals()}

    assert await suite_failures(ApprovalStoreConformance, fixtures)


# --- (3) stores.rows.listed_items / listing_around_damage ----------------------------------


def _item(run_id: str, tenant: str = T) -> WorkItem:
    return WorkItem(tenant=tenant, run_id=run_id, agent=AGENT, state=WorkState.wanted, since=1.0)


def test_a_listing_goes_on_past_damage_keeping_order_and_naming_each() -> None:
    rows: list[tuple[str, str, bool]] = [
        (T, "a", True),
        (T, "b", False),
        (T, "c", True),
        ("?", "?", False),
        (T, "d", True),
    ]

    def read(row: tuple[str, str, bool]) -> WorkItem:
        if not row[2]:
            raise CheckpointCorruptError(f"entry {row[1]} is damaged")
        return _item(row[1])

    def names(row: tuple[str, str, bool]) -> tuple[str | None, str | None]:
        if row[0] == "?":
            raise ValueError("the names do not read either")
        return row[0], row[1]

    listing = listing_around_damage(rows, read, names)
    assert [i.run_id for i in listing.items] == ["a", "c", "d"]
    assert listing.damaged == (
        DamagedEntry(T, "b", "entry b is damaged"),
        DamagedEntry(None, None, "entry ? is damaged"),
    )
    with pytest.raises(CheckpointCorruptError, match=f"'{T}/b': entry b is damaged"):
        listed_items(listing)
    assert listed_items(WorkListing(listing.items)) == list(listing.items)


def test_listed_items_does_not_name_an_unreadable_entry_none_slash_none() -> None:
    listing = WorkListing((), (DamagedEntry(None, None, "state is int 7"),))
    with pytest.raises(CheckpointCorruptError) as caught:
        listed_items(listing)
    assert "None" not in str(caught.value), str(caught.value)


class DamageNamingIndex(MemoryWorkIndex):
    """Offers ``WorksAroundDamage`` and names one damaged entry whose values (quoted in
    ``why``) hold a secret, as a hand-edited row's would."""

    SECRET = "sk-proj-" + "Q7x9" * 10

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        plain = await super().items(tenant, state=state)
        why = f"a stored work item cannot be read (reason is {self.SECRET!r})"
        return WorkListing(tuple(plain), (DamagedEntry(tenant, "hand-edited", why),))


def test_a_damaged_entrys_secret_is_not_shown_by_runs_or_the_console(clock: FakeClock) -> None:
    leases = MemoryLeaseStore(clock=clock)
    work = DamageNamingIndex(leases, clock=clock)
    base = custom_stores(clock)
    stores = replace(base, checkpoints=MemoryCheckpointStore(), leases=leases, work=work)
    code, out, err = cli(stores, "runs", "--tenant", T)
    _one_sentence(code, err)
    assert "hand-edited" in out, out + err
    assert DamageNamingIndex.SECRET not in out + err
    page = asyncio.run(_page(stores, f"/t/{T}/runs"))
    assert "hand-edited" in page.text
    assert DamageNamingIndex.SECRET not in page.text


# --- (3) run.approvals.of_the_turn ---------------------------------------------------------


class CopiedFrom(MemoryApprovalStore):
    """Answers a request as a row copied from elsewhere would read: ``change`` applied."""

    def __init__(self, change: Callable[[ApprovalRequest], ApprovalRequest]) -> None:
        super().__init__()
        self.change = change
        self.copied = False

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        got = await super().get(tenant, id)
        return got if got is None or not self.copied else self.change(got)


def _approval_runner(stores: Stores, approvals: MemoryApprovalStore) -> AgentRunner:
    return runner_over(replace(stores, approvals=approvals))


async def _waiting_then_copied(
    clock: FakeClock, change: Callable[[ApprovalRequest], ApprovalRequest]
) -> tuple[Stores, CopiedFrom, Airline]:
    stores = replace(custom_stores(clock), checkpoints=MemoryCheckpointStore())
    approvals = CopiedFrom(change)
    airline = Airline()
    agent = booking_agent(airline, approval=True)
    run = await _approval_runner(stores, approvals).run(agent, "book", tenant=T, run_id="r")
    assert run.status.value == "waiting_approval"
    approvals.copied = True
    return stores, approvals, airline


def _decided(request: ApprovalRequest, **changes: Any) -> ApprovalRequest:
    from tesserix_adk.stores.protocols import ApprovalStatus

    return replace(request, status=ApprovalStatus.approved, by="someone-else", **changes)


async def test_a_request_of_another_run_is_refused_and_nothing_booked(clock: FakeClock) -> None:
    stores, approvals, airline = await _waiting_then_copied(
        clock, lambda r: _decided(r, run_id="other-run")
    )
    with pytest.raises(CheckpointCorruptError, match="names run 'other-run'"):
        await _approval_runner(stores, approvals).resume(
            booking_agent(airline, approval=True), "r", tenant=T
        )
    assert airline.bookings == []


async def test_a_request_of_another_turn_is_refused_and_nothing_booked(clock: FakeClock) -> None:
    stores, approvals, airline = await _waiting_then_copied(
        clock, lambda r: _decided(r, iteration=r.iteration + 7)
    )
    with pytest.raises(CheckpointCorruptError):
        await _approval_runner(stores, approvals).resume(
            booking_agent(airline, approval=True), "r", tenant=T
        )
    assert airline.bookings == []


async def test_a_request_of_the_same_run_id_in_another_tenant_is_refused(
    clock: FakeClock,
) -> None:
    stores, approvals, airline = await _waiting_then_copied(
        clock, lambda r: _decided(r, tenant="globex")
    )
    refused: BaseException | None = None
    try:
        await _approval_runner(stores, approvals).resume(
            booking_agent(airline, approval=True), "r", tenant=T
        )
    except CheckpointCorruptError as exc:
        refused = exc
    assert airline.bookings == [], "booked on another tenant's approval"
    assert refused is not None


def test_of_the_turn_is_true_only_for_the_run_and_turn_named() -> None:
    request = ApprovalRequest(id="req-1", tenant=T, run_id="r", calls=(), iteration=2)
    assert of_the_turn(request, T, "r", 2)
    assert not of_the_turn(request, T, "r", 1)
    assert not of_the_turn(request, T, "R", 2)
    assert not of_the_turn(request, T, "r ", 2)
    assert not of_the_turn(request, "globex", "r", 2)
