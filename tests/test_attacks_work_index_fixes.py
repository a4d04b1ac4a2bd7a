"""Attacks on the work-index fixes of 8115483: a counted take hidden for a ttl, the
too-many park decided holding the run (``run.holding.held_to_decide``), and the waiting
carrier's second look at its request (``run.approvals.told_waiting``).

The rig is the previous round's (``tests/test_attacks_work_index.py``): real stores on
every backend, real ``Worker`` and ``AgentRunner`` objects, and a view of the work index
that runs a hook at one exact point, so that an interleaving met by timing in a deployment
is met here by construction. Operators act through the console's own path.

Defects, found as strict xfails and fixed (markers removed): the too-many park now reads
the run's entry while holding the run and parks only if it is still what the poll saw
(``worker._as_polled``); ``told_waiting`` wakes the run when its second look fails.
- ``held_to_decide`` only sees a take once it holds the resume claim or the lease; a take
  that has counted itself and not yet claimed (it reads the frontier, or a start reads its
  submission) is invisible, so a late ``due`` reply landing there parks a run a live take
  is about to carry (the take then unparks it, but the page went out and the count is
  reset).
- the too-many park is decided from the count the late ``due`` reply carried, never from
  the index as it stands: a run another take moved on (its count started again) and left
  backing off, or one that went waiting and was approved meanwhile, is parked as
  ``too_many_attempts``; the approved run is then never carried until an operator unparks
  it.
- ``told_waiting`` reads the request after its ``done``: when that read fails, the error
  leaves the run ``done`` (a worker's counted retry never revives a done entry), so an
  approve whose wake that ``done`` overwrote is lost.

Held: a take that dies right after its counted take is taken again (once the ttl passes);
a decided run a dead take counted is still carried; a too-many park leaves neither resume
claim nor lease behind; a run whose request was decided before its carrier's ``done`` is
woken once, not endlessly, and so is one denied before it; a cancel landing between a
take's count and its start ends the run cancelled with nothing sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from run.helpers import fresh_stores
from tesserix_adk import Carried, Worker, WorkState
from tesserix_adk.console.actions import approve_argv, carry_out
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from test_attacks_work_index import (
    BACKENDS,
    FAST,
    TTL,
    PayModel,
    Steps,
    T,
    Work,
    _approve,
    _entry,
    _pay_agent,
    _run_taken_twice,
    _runner,
    _step_agent,
)


class SimulatedDeath(BaseException):
    """A process killed where it stands (nothing after it runs, nothing is given back)."""


async def _parked(stores: Stores) -> list[Any]:
    assert stores.work is not None
    return await stores.work.items(T, state=WorkState.parked)


def _late_reply(
    work: Work, read: asyncio.Event, release: asyncio.Event
) -> Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]:
    async def late(inner: Callable[[], Awaitable[Any]]) -> Any:
        items = await inner()  # read now...
        read.set()
        await release.wait()  # ...and handed to the worker later (a slow reply)
        return items

    return late


# --- a late due reply against a take that counted itself but holds nothing yet -----------


@pytest.mark.parametrize("path", ["resume", "start"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_late_due_reply_does_not_park_a_run_a_take_just_counted(
    backend: str, path: str, tmp_path: Path
) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        assert stores.work is not None
        agent = _step_agent()
        if path == "resume":
            # A frontier with a step done; two takes counted. The next take finishes it.
            model = Steps(steps=2, fail_at={2})
            await _run_taken_twice(stores, model, agent)
        else:
            # Submitted, never started: two takes died before its first frontier.
            model = Steps(steps=1, fail_at=set())
            setup, _ = _runner(stores, model)
            await setup.submit(agent, "go", tenant=T, run_id="r")
            await stores.work.want(T, "r", agent=agent.name, count=2)
        runner_a, work_a = _runner(stores, model)
        runner_b, work_b = _runner(stores, model)
        a = Worker(runner_a, [agent], max_attempts=2, poll_interval=0.01, backoff=FAST)
        b = Worker(runner_b, [agent], max_attempts=3, poll_interval=0.01, backoff=FAST)
        read, release = asyncio.Event(), asyncio.Event()
        parked_meanwhile: list[Any] = []

        async def a_reply_lands_now() -> None:
            # B counted its take (the run is out of fresh polls); A's reply, read before
            # that, is handed over now, before B reads the frontier and claims the run.
            release.set()
            await asyncio.wait_for(polling, 10)
            await asyncio.gather(*a._running.values())
            parked_meanwhile.extend(await _parked(stores))

        work_a.due_hook = _late_reply(work_a, read, release)
        work_b.after_counted_take = a_reply_lands_now
        polling = asyncio.create_task(a.poll())
        await asyncio.wait_for(read.wait(), 10)
        assert await b.poll() == 1
        await asyncio.gather(*b._running.values())
        assert [h for _, h in b.carried] == [Carried.finished]  # B's take was alive
        assert parked_meanwhile == [], (
            f"paged ({[h for _, h in a.carried]}) for a run a live take had just counted: "
            f"{parked_meanwhile[0].reason!r}"
        )


# --- a late due reply's count against the index as it stands now --------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_late_due_reply_does_not_park_a_run_that_moved_on_and_backs_off(
    backend: str, tmp_path: Path
) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        agent = _step_agent()
        # Calls: 1 step 0; 2 fails (the setup); 3 step 1 (B moves the run on); 4 fails, a
        # passing failure: the run backs off, unheld, its count started again.
        model = Steps(steps=3, fail_at={2, 4})
        await _run_taken_twice(stores, model, agent)
        runner_a, work_a = _runner(stores, model)
        runner_b, _ = _runner(stores, model)
        a = Worker(runner_a, [agent], max_attempts=2, poll_interval=0.01, backoff=FAST)
        b = Worker(runner_b, [agent], max_attempts=3, poll_interval=0.01, backoff=FAST)
        read, release = asyncio.Event(), asyncio.Event()
        work_a.due_hook = _late_reply(work_a, read, release)
        polling = asyncio.create_task(a.poll())
        await asyncio.wait_for(read.wait(), 10)
        assert await b.poll() == 1
        await asyncio.gather(*b._running.values())
        assert model.calls == 4 and [h for _, h in b.carried] == [Carried.retry]
        before = await _entry(stores)
        assert before.state is WorkState.wanted and before.attempts < 2  # moved on: recounted
        release.set()  # A's reply, read before B's take, lands only now
        await asyncio.wait_for(polling, 10)
        await asyncio.gather(*a._running.values())
        entry = await _entry(stores)
        assert entry.state is WorkState.wanted, (
            f"moved on, backing off from a rate limit with {before.attempts} attempt(s), "
            f"and parked by a stale count: {entry.reason!r}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_late_due_reply_does_not_park_an_approved_run(backend: str, tmp_path: Path) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        assert stores.work is not None
        sent: list[int] = []
        agent = _pay_agent(sent)
        setup, _ = _runner(stores, PayModel())
        await setup.submit(agent, "pay 5", tenant=T, run_id="r")
        await stores.work.want(T, "r", agent=agent.name, count=2)  # two takes died
        runner_a, work_a = _runner(stores, PayModel())
        runner_b, _ = _runner(stores, PayModel())
        a = Worker(runner_a, [agent], max_attempts=2, poll_interval=0.01, backoff=FAST)
        b = Worker(runner_b, [agent], max_attempts=3, poll_interval=0.01, backoff=FAST)
        read, release = asyncio.Event(), asyncio.Event()
        work_a.due_hook = _late_reply(work_a, read, release)
        polling = asyncio.create_task(a.poll())
        await asyncio.wait_for(read.wait(), 10)
        assert await b.poll() == 1
        await asyncio.gather(*b._running.values())
        assert [h for _, h in b.carried] == [Carried.waiting]
        await _approve(runner_b, stores)  # the operator approves: woken, decided
        assert (await _entry(stores)).state is WorkState.decided
        release.set()  # A's reply (the count before B's take) lands only now
        await asyncio.wait_for(polling, 10)
        await asyncio.gather(*a._running.values())
        parked = await _parked(stores)
        c = Worker(runner_b, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.wait_for(c.run(), 20)
        assert parked == [] and sent == [5], (
            f"approved, then parked by a stale count ({[h for _, h in a.carried]}): "
            f"{parked[0].reason if parked else None!r}; paid {sent}"
        )


# --- told_waiting's second look failing ---------------------------------------------------


class FlakyApprovals:
    """An approval store whose ``get`` fails once ``fail_next`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_next = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get(self, tenant: str, id: str) -> Any:
        if self.fail_next:
            self.fail_next = False
            raise StoreUnavailableError("approval store: connection refused")
        return await self.inner.get(tenant, id)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_approve_before_done_survives_a_failed_second_look(
    backend: str, tmp_path: Path
) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        sent: list[int] = []
        agent = _pay_agent(sent)
        runner, work = _runner(stores, PayModel())
        flaky = FlakyApprovals(runner.approvals)
        runner.approvals = flaky  # type: ignore[assignment]

        async def approve_now() -> None:
            # Approved the moment the request shows, before the carrier's done; the
            # approval store then blips for the carrier's second look.
            await _approve(runner, stores)
            flaky.fail_next = True

        work.before_done = approve_now
        await runner.submit(agent, "pay 5", tenant=T, run_id="r")
        worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.wait_for(worker.run(), 20)
        assert work.before_done is None and not flaky.fail_next  # both happened
        entry = await _entry(stores)
        listed = await carry_out(["runs", f"--tenant={T}", "--stuck"], stores)
        assert sent == [5], (
            f"approved, never carried: index says {entry.state if entry else None}; takes: "
            f"{[h for _, h in worker.carried]}; runs --stuck: {listed.text!r}"
        )


# --- what held -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_take_dying_after_its_count_leaves_a_decided_run_to_be_carried(
    backend: str, tmp_path: Path
) -> None:
    """A worker process dies right after counting its take of an approved run: the run is
    hidden for a ttl, then carried by another worker, the approved call made once."""
    async with fresh_stores(backend, tmp_path) as stores:
        sent: list[int] = []
        agent = _pay_agent(sent)
        runner, _ = _runner(stores, PayModel())
        await runner.submit(agent, "pay 5", tenant=T, run_id="r")
        first = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.wait_for(first.run(), 20)
        await _approve(runner, stores)
        dying, work = _runner(stores, PayModel())

        async def die() -> None:
            raise SimulatedDeath

        work.after_counted_take = die
        doomed = Worker(dying, [agent], poll_interval=0.01, backoff=FAST)
        assert await doomed.poll() == 1
        with pytest.raises(SimulatedDeath):
            await asyncio.gather(*doomed._running.values())
        entry = await _entry(stores)
        assert entry.state is WorkState.wanted and entry.attempts == 1
        survivor, _ = _runner(stores, PayModel())
        w = Worker(survivor, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.sleep(TTL + 0.1)
        await asyncio.wait_for(w.run(), 20)
        assert sent == [5]
        assert (await _entry(stores)).state is WorkState.done


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_too_many_park_leaves_no_claim_nor_lease_behind(
    backend: str, tmp_path: Path
) -> None:
    """The park holds the run to decide, and lets go: an operator's resume right after
    carries it."""
    async with fresh_stores(backend, tmp_path) as stores:
        agent = _step_agent()
        model = Steps(steps=2, fail_at={2})
        await _run_taken_twice(stores, model, agent)
        runner, _ = _runner(stores, model)
        w = Worker(runner, [agent], max_attempts=2, poll_interval=0.01, backoff=FAST)
        assert await w.poll() == 1
        await asyncio.gather(*w._running.values())
        assert [h for _, h in w.carried] == [Carried.parked]
        assert stores.leases is not None
        assert await stores.leases.current(T, "r") is None
        found = await stores.idempotency.lookup([run_claim_key(T, "r")], tenant=T)
        rec = found.get(run_claim_key(T, "r"))
        assert rec is None or rec.status is not RecordStatus.in_flight
        result = await runner.resume(agent, "r", tenant=T)  # an operator carries it on
        assert result.status.value == "completed"
        assert (await _entry(stores)).state is WorkState.done


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_decision_before_done_wakes_the_run_once(backend: str, tmp_path: Path) -> None:
    """Approved before its carrier's done: woken by the second look, carried once, and
    then left done (no wake after wake)."""
    async with fresh_stores(backend, tmp_path) as stores:
        sent: list[int] = []
        agent = _pay_agent(sent)
        runner, work = _runner(stores, PayModel())

        async def approve_now() -> None:
            await _approve(runner, stores)

        work.before_done = approve_now
        await runner.submit(agent, "pay 5", tenant=T, run_id="r")
        worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.wait_for(worker.run(), 20)
        assert sent == [5]
        assert [h for _, h in worker.carried] == [Carried.waiting, Carried.finished]
        assert (await _entry(stores)).state is WorkState.done


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_cancel_between_a_counted_take_and_its_start_sends_nothing(
    backend: str, tmp_path: Path
) -> None:
    """Cancelled while a take of the submitted run had counted itself and held nothing:
    the take starts it, finds the cancel, and nothing is paid; the run ends done."""
    async with fresh_stores(backend, tmp_path) as stores:
        sent: list[int] = []
        agent = _pay_agent(sent)
        runner, work = _runner(stores, PayModel())

        async def cancel_now() -> None:
            await runner.cancel("r", tenant=T, by="ops", reason="wrong invoice")

        work.after_counted_take = cancel_now
        await runner.submit(agent, "pay 5", tenant=T, run_id="r")
        worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.wait_for(worker.run(), 20)
        assert work.after_counted_take is None
        assert sent == []
        assert runner.checkpoints is not None
        cp = await runner.checkpoints.latest(T, "r")
        assert cp is not None and cp.status.value == "cancelled"
        assert (await _entry(stores)).state is WorkState.done


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_denial_before_done_wakes_the_run_once(backend: str, tmp_path: Path) -> None:
    """Denied before its carrier's done: woken once, the model told, nothing paid, done."""
    async with fresh_stores(backend, tmp_path) as stores:
        sent: list[int] = []
        agent = _pay_agent(sent)
        runner, work = _runner(stores, PayModel())

        async def deny_now() -> None:
            assert runner.checkpoints is not None
            cp = await runner.checkpoints.latest(T, "r")
            assert cp is not None and cp.pending_approval is not None
            argv = approve_argv(T, cp.pending_approval.id, by="ops", note=None, deny=True)
            done = await carry_out(argv, stores)
            assert done.ok, done.text

        work.before_done = deny_now
        await runner.submit(agent, "pay 5", tenant=T, run_id="r")
        worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST)
        await asyncio.wait_for(worker.run(), 20)
        assert sent == []
        assert [h for _, h in worker.carried] == [Carried.waiting, Carried.finished]
        assert (await _entry(stores)).state is WorkState.done
