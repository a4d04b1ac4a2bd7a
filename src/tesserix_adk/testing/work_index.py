"""The conformance suite every ``WorkIndex`` passes."""

from __future__ import annotations

import pytest

from tesserix_adk.stores.protocols import (
    LeaseStore,
    WakesParked,
    WorkIndex,
    WorksAroundDamage,
    WorkState,
)
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS, ClockedConformance
from tesserix_adk.testing.clock import FakeClock
from tesserix_adk.testing.counting import round_trips_of

__all__ = ["WorkIndexConformance"]

T = "acme"
A = "booking"
LONG = 3600.0


def _ids(items: list) -> list[str]:  # type: ignore[type-arg]
    return [i.run_id for i in items]


class WorkIndexConformance(ClockedConformance):
    """Subclass this in a test module to check a ``WorkIndex``.

    Provide fixtures ``work_index`` (a fresh, empty index), ``work_leases`` (the lease
    store of the same backend, whose live leases the index must skip) and ``clock`` (the
    ``FakeClock`` both read, or ``None`` for a server clock). Optionally ``round_trips``
    (see ``testing.counting``).
    """

    async def test_index_satisfies_the_protocol(self, work_index: WorkIndex) -> None:
        assert isinstance(work_index, WorkIndex)

    async def test_a_submission_is_recorded_once_with_its_input(
        self, work_index: WorkIndex
    ) -> None:
        assert await work_index.submit(T, "r1", agent=A, input=b"\x00first\xff") is True
        assert await work_index.submit(T, "r1", agent=A, input=b"second") is False
        assert await work_index.input(T, "r1") == b"\x00first\xff"
        assert await work_index.input(T, "nobody") is None
        (item,) = await work_index.items(T)
        assert (item.run_id, item.agent, item.state) == ("r1", A, WorkState.submitted)

    async def test_a_finished_run_is_still_known_to_submit(self, work_index: WorkIndex) -> None:
        """A client retrying its request after the run finished makes no second run."""
        await work_index.submit(T, "r1", agent=A, input=b"in")
        await work_index.done(T, "r1")
        assert await work_index.submit(T, "r1", agent=A, input=b"again") is False
        assert await work_index.input(T, "r1") == b"in"
        assert await work_index.due(limit=10) == []
        assert await work_index.items(T) == []
        (done,) = await work_index.items(T, state=WorkState.done)
        assert done.run_id == "r1"

    async def test_one_runs_entry_is_read_in_every_state_as_items_lists_it(
        self, work_index: WorkIndex
    ) -> None:
        """``entry`` reads one run whatever its state, done included, and nothing else."""
        assert await work_index.entry(T, "r1") is None
        await work_index.submit(T, "r1", agent=A, input=b"in")
        await work_index.want(T, "other", agent="refunds", delay=LONG, reason="store down")
        assert await work_index.entry("globex", "r1") is None
        assert await work_index.entry(T, "r") is None
        (listed,) = await work_index.items(T, state=WorkState.submitted)
        assert await work_index.entry(T, "r1") == listed
        await work_index.want(T, "r1", agent=A, count=1)
        await work_index.want(T, "r1", agent=A, delay=LONG, count=0, reason="boom")
        (listed,) = [i for i in await work_index.items(T) if i.run_id == "r1"]
        got = await work_index.entry(T, "r1")
        assert got == listed
        assert got is not None and (got.state, got.attempts, got.reason) == (
            WorkState.wanted,
            1,
            "boom",
        )
        await work_index.park(T, "r1", agent=A, reason="in doubt")
        (listed,) = await work_index.items(T, state=WorkState.parked)
        assert await work_index.entry(T, "r1") == listed
        await work_index.done(T, "r1")
        (listed,) = await work_index.items(T, state=WorkState.done)
        got = await work_index.entry(T, "r1")
        assert got == listed and got is not None and got.state is WorkState.done
        other = await work_index.entry(T, "other")
        assert other is not None and (other.agent, other.reason) == ("refunds", "store down")

    async def test_entry_keeps_odd_ids_and_tenants_apart(self, work_index: WorkIndex) -> None:
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                await work_index.submit(tenant, run_id, agent=f"{tenant}|{run_id}", input=b"")
        for tenant, run_id in JOIN_ALIKE_IDS:
            await work_index.want(tenant, run_id, agent=f"{tenant}|{run_id}")
        for tenant, run_id in [(t, r) for t in ODD_IDS for r in ODD_IDS] + list(JOIN_ALIKE_IDS):
            got = await work_index.entry(tenant, run_id)
            assert got is not None
            assert (got.tenant, got.run_id, got.agent) == (tenant, run_id, f"{tenant}|{run_id}")

    async def test_reading_one_entry_sends_as_many_requests_however_many_runs_there_are(
        self, work_index: WorkIndex, request: pytest.FixtureRequest
    ) -> None:
        trips = await round_trips_of(request)
        await work_index.want(T, "r0", agent=A)
        await work_index.entry(T, "r0")  # a first use may check the server once
        before = trips.count
        await work_index.entry(T, "r0")
        few = trips.count - before
        for n in range(1, 60):
            await work_index.want(T, f"r{n}", agent=A)
        before = trips.count
        assert await work_index.entry(T, "r0") is not None
        many = trips.count - before
        assert few >= 1, "round_trips saw nothing sent: it is not wired to the driver"
        assert many == few, f"with 60 runs entry sent {many} requests, with one {few}"

    async def test_due_hands_out_decided_then_wanted_then_submitted_oldest_first(
        self, work_index: WorkIndex, clock: FakeClock | None
    ) -> None:
        await work_index.submit(T, "s1", agent=A, input=b"")
        await self.let_pass(clock, 0.01)
        await work_index.want(T, "w1", agent=A)
        await self.let_pass(clock, 0.01)
        await work_index.submit(T, "s2", agent=A, input=b"")
        await self.let_pass(clock, 0.01)
        await work_index.want(T, "d1", agent=A, state=WorkState.decided)
        await self.let_pass(clock, 0.01)
        await work_index.want(T, "w2", agent=A)
        due = await work_index.due(limit=10)
        assert _ids(due) == ["d1", "w1", "w2", "s1", "s2"]
        assert [i.state for i in due] == [
            WorkState.decided,
            WorkState.wanted,
            WorkState.wanted,
            WorkState.submitted,
            WorkState.submitted,
        ]
        assert _ids(await work_index.due(limit=2)) == ["d1", "w1"]
        assert await work_index.due(limit=0) == []

    async def test_a_run_with_a_live_lease_is_not_due_until_it_lapses(
        self, work_index: WorkIndex, work_leases: LeaseStore, clock: FakeClock | None
    ) -> None:
        await work_index.want(T, "held", agent=A)
        await work_index.want(T, "free", agent=A)
        await work_leases.acquire(T, "held", "worker-a", self.short_ttl)
        assert _ids(await work_index.due(limit=10)) == ["free"]
        # The held run does not use up the limit either.
        assert _ids(await work_index.due(limit=1)) == ["free"]
        await self.let_pass(clock, self.past_short_ttl)
        assert sorted(_ids(await work_index.due(limit=10))) == ["free", "held"]

    async def test_a_released_lease_makes_the_run_due_at_once(
        self, work_index: WorkIndex, work_leases: LeaseStore
    ) -> None:
        await work_index.want(T, "r1", agent=A)
        lease = await work_leases.acquire(T, "r1", "worker-a", LONG)
        assert await work_index.due(limit=10) == []
        await work_leases.release(lease)
        assert _ids(await work_index.due(limit=10)) == ["r1"]

    async def test_a_parked_run_is_never_due_and_is_listed_with_its_reason(
        self, work_index: WorkIndex
    ) -> None:
        await work_index.submit(T, "r1", agent=A, input=b"")
        await work_index.park(T, "r1", agent=A, reason="book (call_1) is in doubt")
        assert await work_index.due(limit=10) == []
        (parked,) = await work_index.items(T, state=WorkState.parked)
        assert parked.reason == "book (call_1) is in doubt"
        assert await work_index.items(T, state=WorkState.wanted) == []
        await work_index.want(T, "r1", agent=A)  # an operator resolved the call
        (item,) = await work_index.due(limit=10)
        assert (item.run_id, item.state, item.reason) == ("r1", WorkState.wanted, None)

    async def test_a_delayed_run_is_due_only_after_its_delay(
        self, work_index: WorkIndex, clock: FakeClock | None
    ) -> None:
        await work_index.want(T, "r1", agent=A, delay=self.short_ttl, reason="store down")
        assert await work_index.due(limit=10) == []
        (waiting,) = await work_index.items(T)
        assert waiting.not_before is not None and waiting.attempts == 1
        assert waiting.reason == "store down"
        await self.let_pass(clock, self.past_short_ttl)
        assert _ids(await work_index.due(limit=10)) == ["r1"]

    async def test_retries_count_attempts_and_a_clean_want_starts_the_count_again(
        self, work_index: WorkIndex
    ) -> None:
        for _ in range(3):
            await work_index.want(T, "r1", agent=A, delay=LONG)
        (item,) = await work_index.items(T)
        assert item.attempts == 3
        # The runner marking the run it carries as wanted keeps the count of retries...
        await work_index.want(T, "r1", agent=A)
        (item,) = await work_index.items(T)
        assert (item.attempts, item.not_before) == (3, None)
        # ...an operator's act (a parked run wanted again) starts it again.
        await work_index.park(T, "r1", agent=A, reason="in doubt")
        await work_index.want(T, "r1", agent=A)
        (item,) = await work_index.items(T)
        assert (item.attempts, item.not_before) == (0, None)

    async def test_a_given_count_moves_the_attempts_whatever_the_states(
        self, work_index: WorkIndex
    ) -> None:
        """What a worker writes: each take counts one (so a run that kills its carrier is
        counted), a failure after a take keeps the count while it delays the run, a clean
        stop gives the take back, and the count never goes below 0."""
        await work_index.submit(T, "r1", agent=A, input=b"in")
        await work_index.want(T, "r1", agent=A, count=1)  # submitted -> wanted, taken
        (item,) = await work_index.items(T)
        assert (item.state, item.attempts, item.not_before) == (WorkState.wanted, 1, None)
        await work_index.want(T, "r1", agent=A, count=1)
        await work_index.want(T, "r1", agent=A, delay=LONG, count=0, reason="boom")
        (item,) = await work_index.items(T)
        assert (item.attempts, item.reason) == (2, "boom")
        assert item.not_before is not None
        assert await work_index.due(limit=10) == []
        await work_index.want(T, "r1", agent=A, count=-1)
        (item,) = await work_index.items(T)
        assert (item.attempts, item.not_before) == (1, None)
        # A worker's count never unparks a run (another worker parked it meanwhile) nor
        # revives a finished one; a want without one (an operator's wake) unparks it.
        await work_index.park(T, "r1", agent=A, reason="in doubt")
        await work_index.want(T, "r1", agent=A, delay=LONG, count=0)
        await work_index.want(T, "r1", agent=A, count=-1)
        (item,) = await work_index.items(T, state=WorkState.parked)
        assert (item.attempts, item.reason) == (1, "in doubt")
        await work_index.want(T, "r1", agent=A)
        (item,) = await work_index.items(T)
        assert (item.state, item.attempts) == (WorkState.wanted, 0)
        await work_index.want(T, "r1", agent=A, count=1)
        for _ in range(3):
            await work_index.want(T, "r1", agent=A, count=-1)
        (item,) = await work_index.items(T)
        assert item.attempts == 0
        await work_index.want(T, "fresh", agent=A, count=-1)
        await work_index.want(T, "new", agent=A, count=1)
        counts = {i.run_id: i.attempts for i in await work_index.items(T)}
        assert (counts["fresh"], counts["new"]) == (0, 1)
        # The input a submission carried stays through all of it.
        assert await work_index.input(T, "r1") == b"in"
        await work_index.done(T, "new")
        await work_index.want(T, "new", agent=A, count=-1)
        await work_index.want(T, "new", agent=A, count=1)
        assert [i.run_id for i in await work_index.items(T, state=WorkState.done)] == ["new"]

    async def test_due_keeps_to_the_agents_asked_for(self, work_index: WorkIndex) -> None:
        await work_index.want(T, "b", agent="booking")
        await work_index.want(T, "r", agent="refunds")
        assert _ids(await work_index.due(limit=10, agents=["refunds"])) == ["r"]
        assert sorted(_ids(await work_index.due(limit=10))) == ["b", "r"]
        assert await work_index.due(limit=10, agents=["nobody"]) == []

    async def test_tenants_are_kept_apart(self, work_index: WorkIndex) -> None:
        assert await work_index.submit("acme", "r1", agent=A, input=b"acme's")
        assert await work_index.submit("globex", "r1", agent=A, input=b"globex's")
        assert await work_index.input("globex", "r1") == b"globex's"
        await work_index.park("acme", "r1", agent=A, reason="why")
        assert [(i.tenant, i.run_id) for i in await work_index.due(limit=10)] == [("globex", "r1")]
        assert _ids(await work_index.items("acme", state=WorkState.parked)) == ["r1"]
        assert await work_index.items("globex", state=WorkState.parked) == []
        assert len(await work_index.items()) == 2

    async def test_a_listing_past_damage_lists_what_items_lists(
        self, work_index: WorkIndex
    ) -> None:
        """``WorksAroundDamage`` (optional): on an undamaged index, ``listing`` is ``items``
        in every state asked, and names nothing damaged."""
        if not isinstance(work_index, WorksAroundDamage):
            pytest.skip("the index does not offer WorksAroundDamage")
        for run_id in ("a", "b", "c", "d"):
            await work_index.submit(T, run_id, agent=A, input=b"{}")
        await work_index.park(T, "b", agent=A, reason="why")
        await work_index.done(T, "c")
        await work_index.want(T, "d", agent=A, state=WorkState.wanted)
        for state in (None, *WorkState):
            listing = await work_index.listing(T, state=state)
            assert list(listing.items) == await work_index.items(T, state=state), state
            assert listing.damaged == ()

    async def test_a_listing_past_damage_keeps_tenants_apart(self, work_index: WorkIndex) -> None:
        """``WorksAroundDamage`` (optional): a tenant's listing holds its own entries only,
        in every state, as ``items`` does: an operator's view of one tenant never shows
        another's runs."""
        if not isinstance(work_index, WorksAroundDamage):
            pytest.skip("the index does not offer WorksAroundDamage")
        await work_index.submit("acme", "r1", agent=A, input=b"{}")
        await work_index.submit("globex", "g1", agent=A, input=b"{}")
        await work_index.park("globex", "g2", agent=A, reason="why")
        await work_index.submit("globex", "g3", agent=A, input=b"{}")
        await work_index.done("globex", "g3")
        for state in (None, *WorkState):
            listing = await work_index.listing("acme", state=state)
            assert {i.tenant for i in listing.items} <= {"acme"}, state
            assert all(d.tenant in (None, "acme") for d in listing.damaged), state
        assert _ids(list((await work_index.listing("acme")).items)) == ["r1"]

    async def test_items_and_listing_are_oldest_first(
        self, work_index: WorkIndex, clock: FakeClock | None
    ) -> None:
        """``items`` (and ``listing``, when offered) list entries oldest first, in one state
        and across states, as the protocol says: operators read them in that order."""
        for run_id in ("first", "second", "third", "fourth"):
            await work_index.submit(T, run_id, agent=A, input=b"{}")
            await self.let_pass(clock, 0.01)
        await work_index.park(T, "first", agent=A, reason="why")
        await work_index.want(T, "third", agent=A, state=WorkState.wanted)
        listings = [await work_index.items(T)]
        if isinstance(work_index, WorksAroundDamage):
            listings.append(list((await work_index.listing(T)).items))
        for listed in listings:
            order = [i.run_id for i in listed]
            assert order == sorted(order, key={i.run_id: i.since for i in listed}.__getitem__)
        submitted = await work_index.items(T, state=WorkState.submitted)
        assert _ids(submitted) == ["second", "fourth"]

    async def test_ids_with_odd_characters_are_kept_verbatim(self, work_index: WorkIndex) -> None:
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                await work_index.submit(
                    tenant, run_id, agent=A, input=f"{tenant}|{run_id}".encode()
                )
        for tenant in ODD_IDS:
            assert sorted(_ids(await work_index.items(tenant))) == sorted(ODD_IDS)
            for run_id in ODD_IDS:
                assert await work_index.input(tenant, run_id) == f"{tenant}|{run_id}".encode()
        assert await work_index.items("a") == []

    async def test_ids_that_join_alike_do_not_collide(self, work_index: WorkIndex) -> None:
        for tenant, run_id in JOIN_ALIKE_IDS:
            assert await work_index.submit(tenant, run_id, agent=A, input=b"x")
        assert len(await work_index.due(limit=100)) == len(JOIN_ALIKE_IDS)

    async def test_done_of_an_unknown_run_is_a_no_op(self, work_index: WorkIndex) -> None:
        await work_index.done(T, "nobody")
        assert await work_index.items() == []
        assert await work_index.submit(T, "nobody", agent=A, input=b"") is True

    async def test_finding_work_sends_as_many_requests_however_many_runs_there_are(
        self, work_index: WorkIndex, request: pytest.FixtureRequest
    ) -> None:
        trips = await round_trips_of(request)
        await work_index.want(T, "r0", agent=A)
        await work_index.due(limit=5)  # a first use may check the server once
        before = trips.count
        await work_index.due(limit=5)
        few = trips.count - before
        for n in range(1, 60):
            await work_index.want(T, f"r{n}", agent=A)
        before = trips.count
        assert len(await work_index.due(limit=5)) == 5
        many = trips.count - before
        assert few >= 1, "round_trips saw nothing sent: it is not wired to the driver"
        assert many == few, f"with 60 runs due sent {many} requests, with one {few}"

    async def test_a_wake_goes_on_counting_in_one_write(
        self, work_index: WorkIndex, clock: FakeClock | None
    ) -> None:
        """``WakesParked`` (optional): a parked run woken as it was read becomes due now,
        wanted, with one more attempt counted and its reason gone; its input stays."""
        if not isinstance(work_index, WakesParked):
            pytest.skip("the index does not offer WakesParked")
        await work_index.submit(T, "r1", agent=A, input=b"in")
        for _ in range(4):
            await work_index.want(T, "r1", agent=A, count=1)
        await work_index.park(T, "r1", agent=A, reason="another revision's")
        await self.let_pass(clock, 0.01)
        (parked,) = await work_index.items(T, state=WorkState.parked)
        assert parked.attempts == 4
        woken = await work_index.wake(
            T, "r1", agent=A, attempts=parked.attempts, reason=parked.reason
        )
        assert woken is True
        (item,) = await work_index.items(T)
        assert (item.state, item.attempts, item.reason, item.not_before) == (
            WorkState.wanted,
            5,
            None,
            None,
        )
        assert item.since > parked.since
        assert _ids(await work_index.due(limit=10)) == ["r1"]
        assert await work_index.input(T, "r1") == b"in"

    async def test_a_wake_writes_nothing_once_the_entry_changed(
        self, work_index: WorkIndex
    ) -> None:
        """``WakesParked`` (optional): a wake of an entry that is no longer as it was read
        writes nothing: woken already (a second sweeper, or the same wake sent again), taken
        and parked again, parked for another reason, done, of another agent, another
        tenant's, or unknown."""
        if not isinstance(work_index, WakesParked):
            pytest.skip("the index does not offer WakesParked")
        await work_index.want(T, "r1", agent=A, count=3)
        await work_index.park(T, "r1", agent=A, reason="old's")
        assert await work_index.wake(T, "r1", agent=A, attempts=3, reason="old's") is True
        # Woken already: a second wake of what was read finds it wanted.
        assert await work_index.wake(T, "r1", agent=A, attempts=3, reason="old's") is False
        (item,) = await work_index.items(T)
        assert (item.state, item.attempts) == (WorkState.wanted, 4)
        # Taken (counted) and parked again: the count read is stale.
        await work_index.want(T, "r1", agent=A, count=1)
        await work_index.park(T, "r1", agent=A, reason="old's")
        assert await work_index.wake(T, "r1", agent=A, attempts=4, reason="old's") is False
        # Parked for another reason now, or the agent or tenant is not the one read.
        await work_index.park(T, "r1", agent=A, reason="book (call_1) is in doubt")
        assert await work_index.wake(T, "r1", agent=A, attempts=5, reason="old's") is False
        assert (
            await work_index.wake(
                T, "r1", agent="refunds", attempts=5, reason="book (call_1) is in doubt"
            )
            is False
        )
        assert (
            await work_index.wake(
                "globex", "r1", agent=A, attempts=5, reason="book (call_1) is in doubt"
            )
            is False
        )
        (item,) = await work_index.items(T, state=WorkState.parked)
        assert (item.attempts, item.reason) == (5, "book (call_1) is in doubt")
        # Done, or never known: nothing revived, nothing made up.
        await work_index.done(T, "r1")
        assert await work_index.wake(T, "r1", agent=A, attempts=0, reason=None) is False
        assert await work_index.wake(T, "nobody", agent=A, attempts=0, reason=None) is False
        assert await work_index.items(T) == []
        assert await work_index.entry(T, "nobody") is None
