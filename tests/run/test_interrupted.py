"""An interrupt a store driver lost: the run stops at its next boundary, never runs on.

Ctrl-C of ``tesserix run --resume`` is ``asyncio.run`` cancelling the main task. On Python
3.11 ``asyncio.wait_for`` returns the awaited result, and drops the cancellation, when the
result is in by the time the cancelled caller wakes; redis-py wraps every command it sends
in one. An interrupt landing while such a send runs was lost: the run carried on to
completion and the command exited 0. The task still says it is being cancelled
(``Task.cancelling()``), so the run honours that at its next boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from run.helpers import Recording
from run.helpers import at as _at
from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    RunStatus,
    ScriptedProvider,
)
from tesserix_adk.run import run_claim_key
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash


async def _interrupted_and_lost() -> None:
    """What a driver does when the interrupt arrives with its reply: the task is asked to
    cancel, and the driver returns the reply anyway (Python 3.11's ``asyncio.wait_for``)."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0)  # the reply is in: returned, the cancellation lost


async def _interrupt(run: asyncio.Task[Any] | None) -> None:
    """The interrupt, landing in a store call: lost there if the call is the run's own
    task's; a call made in a task of its own (an outcome recorded to the end) leaves the
    run's task waiting on it, and that task hears the cancellation as asyncio gives it."""
    if run is None or run is asyncio.current_task():
        await _interrupted_and_lost()
    else:
        run.cancel()


class _LosesAnInterrupt:
    """Counts every call of the stores it wraps; at the ``k``-th, the interrupt lands as
    the reply comes back and is lost."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.seen = 0
        self.landed: str | None = None
        self.asked_before = 0  # model requests sent before the interrupt landed
        self.run: asyncio.Task[Any] | None = None  # the task carrying the run

    def wrap(self, inner: Any, name: str, provider: Recording) -> Any:
        return _Wrapped(inner, name, self, provider)


class _Wrapped:
    def __init__(self, inner: Any, name: str, trip: _LosesAnInterrupt, provider: Recording):
        self._inner, self._name, self._trip, self._provider = inner, name, trip, provider

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if attr.startswith("_") or not asyncio.iscoroutinefunction(value):
            return value

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await value(*args, **kwargs)
            trip = self._trip
            trip.seen += 1
            if trip.seen == trip.k:
                trip.landed = f"{self._name}.{attr}"
                trip.asked_before = len(self._provider.requests)
                await _interrupt(trip.run)
            return result

        return call


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="Python 3.11's asyncio.wait_for")
async def test_python_3_11_wait_for_loses_a_cancellation_that_arrives_with_the_result() -> None:
    """The cause, as redis-py meets it: its ``send_packed_command`` is
    ``await asyncio.wait_for(self._send_packed_command(command), socket_timeout)``, and the
    SIGINT handler runs while that inner task writes to the socket."""
    outer = asyncio.current_task()
    assert outer is not None

    async def send() -> str:
        outer.cancel()  # the SIGINT handler, run inside the driver's send
        return "sent"

    assert await asyncio.wait_for(send(), 5) == "sent"  # no CancelledError
    assert outer.cancelling() == 1  # ... though the task is still being cancelled
    outer.uncancel()


async def _died_after_the_model_call(
    airline: Airline,
) -> tuple[FaultyCheckpointStore, MemoryIdempotencyStore, MemoryLeaseStore, Any]:
    """Run "r" of the booking agent, its process dead right after its first
    ``after_model_call`` frontier (nothing claimed); its stores and agent, to resume."""
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 1))
    idem, leases = MemoryIdempotencyStore(), MemoryLeaseStore()
    agent = booking_agent(airline)
    died = AgentRunner(
        ScriptedProvider(BOOK_TURNS), idempotency=idem, checkpoints=Checkpointer(store)
    )
    with pytest.raises(SimulatedCrash):
        await died.run(agent, "book", tenant="acme", run_id="r")
    store.crash_after = None
    return store, idem, leases, agent


async def test_an_interrupt_lost_as_the_resume_seals_its_stores_stops_it_sending_nothing(
    airline: Airline,
) -> None:
    """The flaky `test_ctrl_c_of_run_resume_releases_its_lease_and_resume_claim[redis]`,
    made certain: the resume takes the lease, the interrupt lands as it seals the first
    store and is lost there. The resume must stop (the CLI's 130) with book_seat unsent and
    its lease and resume claim released, not book the seat and complete (the CLI's 0)."""
    store, idem, leases, agent = await _died_after_the_model_call(airline)
    assert airline.bookings == []

    provider = Recording(ScriptedProvider(BOOK_TURNS))
    trip = _LosesAnInterrupt(k=-1)
    sealing = trip.wrap(idem, "idempotency", provider)

    async def seal(tenant: str, run_id: str, fence: int) -> None:
        await idem.seal(tenant, run_id, fence)
        trip.landed = "idempotency.seal"
        await _interrupted_and_lost()

    sealing.seal = seal
    runner = AgentRunner(
        provider, idempotency=sealing, checkpoints=Checkpointer(store), leases=leases
    )
    resume = asyncio.create_task(runner.resume(agent, "r", tenant="acme"))
    with pytest.raises(asyncio.CancelledError):
        await resume
    assert trip.landed == "idempotency.seal"
    assert airline.bookings == []
    assert provider.requests == []
    assert await leases.current("acme", "r") is None
    key = run_claim_key("acme", "r")
    claim = (await idem.lookup([key], tenant="acme")).get(key)
    assert claim is None or claim.status is not RecordStatus.in_flight


async def test_an_interrupt_lost_at_any_store_call_never_lets_the_model_be_asked_again() -> None:
    """At every store call of a whole run in turn, the interrupt lands with the reply and
    is lost: the run goes no further than the turn in hand (recording what it did) and
    stops; the model is never asked again, nothing is sent twice, the lease is let go."""
    for k in range(1, 300):
        airline = Airline()
        idem, leases = MemoryIdempotencyStore(), MemoryLeaseStore()
        cps = MemoryCheckpointStore()
        provider = Recording(ScriptedProvider(BOOK_TURNS))
        trip = _LosesAnInterrupt(k)
        runner = AgentRunner(
            provider,
            idempotency=trip.wrap(idem, "idempotency", provider),
            checkpoints=Checkpointer(trip.wrap(cps, "checkpoints", provider)),
            leases=trip.wrap(leases, "leases", provider),
        )
        task = trip.run = asyncio.create_task(
            runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
        )
        try:
            run = await task
        except asyncio.CancelledError:
            run = None
        if trip.landed is None:
            assert run is not None and run.status is RunStatus.completed
            break  # past the last store call of a whole run
        where = f"interrupted at {trip.landed} (store call {k})"
        assert len(provider.requests) == trip.asked_before, where
        assert run is None or trip.asked_before == len(BOOK_TURNS), where
        assert len(airline.bookings) <= 1, where
        assert await leases.current("acme", "r") is None, where
    assert trip.landed is None, "the sweep never reached the end of the run"


class _CutOff:
    """Wraps a store: at its ``k``-th call (counted across the stores sharing it), the
    call takes effect and the interrupt lands before its reply is back (the caller hears
    ``CancelledError``), as on PostgreSQL when SIGINT arrives with a COMMIT on the wire."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.seen = 0
        self.landed: str | None = None

    def wrap(self, inner: Any, name: str) -> Any:
        trip = self

        class Wrapped:
            def __getattr__(self, attr: str) -> Any:
                value = getattr(inner, attr)
                if attr.startswith("_") or not asyncio.iscoroutinefunction(value):
                    return value

                async def call(*args: Any, **kwargs: Any) -> Any:
                    result = await value(*args, **kwargs)
                    trip.seen += 1
                    if trip.seen == trip.k:
                        trip.landed = f"{name}.{attr}"
                        raise asyncio.CancelledError
                    return result

                return call

        return Wrapped()


async def test_an_interrupt_cutting_off_any_reply_of_the_resume_leaves_nothing_held() -> None:
    """Ctrl-C of a resume at each store call in turn, landing after the store did what was
    asked but before its reply came back: neither the lease nor the resume claim is left
    behind for the next resume to wait out (seen on PostgreSQL in CI: the lease's grant)."""
    for k in range(1, 8):
        store, idem, leases, agent = await _died_after_the_model_call(Airline())

        trip = _CutOff(k)
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=trip.wrap(idem, "idempotency"),
            checkpoints=Checkpointer(store),
            leases=trip.wrap(leases, "leases"),
        )
        with pytest.raises(asyncio.CancelledError):
            await runner.resume(agent, "r", tenant="acme")
        assert trip.landed is not None, k
        assert await leases.current("acme", "r") is None, trip.landed
        key = run_claim_key("acme", "r")
        claim = (await idem.lookup([key], tenant="acme")).get(key)
        assert claim is None or claim.status is not RecordStatus.in_flight, trip.landed
