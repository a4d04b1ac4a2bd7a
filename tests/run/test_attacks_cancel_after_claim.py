"""An attacker's tries at fbb8639: every call looks at the cancel once its claim is durable
(in the claim's transaction, the group's COMMIT sent along; an unkeyed call just before it
goes out), the post-answer check kept only for a last answer and an approval turn, and
``grouping.grouped()`` dropping the claims of a group still open when an attempt fails.

Attacked: a cancel landing while the model thinks, during a sequential call (keyed and
unkeyed), before a parallel call's claim, during an approval turn, while a resumed turn
replays a recorded call, while the group naming an unkeyed call commits, and while a run
resumed past its frontier thinks; twins under one business key beside a lost reply; a look
that fails after the claim (unavailable, reply lost, the task cancelled) on every backend,
grouped and not, and a store outage that also fails the release; a death (in process, and a
real SIGKILL) after the look found the cancel; whether ``grouped()`` drops a claim of a
call that went out; and PostgreSQL round trips per turn for unkeyed and parallel turns.

Defects (all but the third fixed, their tests passing now: the post-answer check also runs
before a resumed run past its frontier is refused as diverged; a resume reads the cancel
before it refuses anything, so a cancelled run ends cancelled with its calls in doubt left
as they are; an unkeyed call's look carries the group's COMMIT; an attempt's own claim
still in flight under a key it sent a call under is in doubt, never sent again nor dropped.
The third stays a strict xfail, a window the README names):

- a run resumed past its frontier, cancelled while the model thinks, raises
  DivergedRunError instead of ending cancelled (regression: the post-answer check that
  ended it now runs only for a last answer or an approval turn, loop.py ``run_loop``);
- a death between the look that found the cancel and ``release_unsent`` leaves a claim that
  never went out, and the resume refuses it as in doubt (IndeterminateToolCallError, exit 4)
  rather than ending the run cancelled (regression: the cancel used to be found before any
  claim), shown in process on every backend and with a real SIGKILL;
- on an ungrouped backend (SQLite, Redis, PostgreSQL) a store outage at the new look, with
  the release failing too, leaves a never-sent call in doubt on resume (new window: no store
  round trip stood between a claim and its send before);
- an unkeyed call still goes out after a cancel acknowledged while the group holding the
  frontier that names it commits: its look comes before that commit (as it did before);
- a parallel twin under one business key, after its sibling lost its reply, takes the
  sibling's in-flight claim for its own: with a cancel acknowledged, its look drops that
  claim, so the record of a call that went out vanishes and a later run under the same key
  sends it again; without a cancel it is sent a second time at once (pre-existing).

Held: a cancel acknowledged before a call's claim stops it on every backend, grouped or
not, sequential or side by side, keyed or unkeyed, with the transcript answering "not sent"
and the run ending ``cancelled`` (a resume after says so again, sending nothing); an
approval turn cancelled while the model thought ends cancelled before asking; a resumed
turn replays what ran and sends nothing claimed after the cancel; a look that fails or is
cancelled after the claim drops that claim only (never the earlier call's, whose outcome
commits), and the resume sends it once; an attempt failing after a call went out never
drops its claim (the resume refuses it as in doubt, never sends it again); per-turn round
trips for parallel (11) turns are what they were before the change, and an unkeyed call's
turn is one fewer (5, was 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.errors import (
    IndeterminateToolCallError,
    StoreUnavailableError,
    ToolOutcomeUnknownError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus

T = "acme"

DURABLE = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
ALL = [pytest.param("memory", id="memory"), *DURABLE]


@asynccontextmanager
async def _opened(backend: str, tmp: Path) -> AsyncIterator[Stores]:
    if backend == "memory":
        async with open_stores("memory://") as stores:
            yield stores
        return
    async with store_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores


async def _cancel(stores: Stores, run_id: str) -> Any:
    """An operator's ``tesserix cancel``, from outside the run's attempt (its own context,
    so none of its writes joins the run's write group)."""
    runner = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
    return await asyncio.create_task(
        runner.cancel(run_id, tenant=T, by="ops"), context=contextvars.Context()
    )


async def _in_flight(stores: Stores, run_id: str) -> list[Any]:
    return [
        r
        for r in await stores.idempotency.records(T, run_id)
        if r.tool is not None and r.status is RecordStatus.in_flight
    ]


class _Desk:
    """What really went out, per argument."""

    def __init__(self) -> None:
        self.sent: list[str] = []


def _crash_before_claim_of(stores: Stores, call_id: str) -> None:
    from tesserix_adk.testing.faults import SimulatedCrash

    real = stores.idempotency.claim

    async def claim(key: str, **kwargs: Any) -> Any:
        if kwargs.get("call_id") == call_id:
            raise SimulatedCrash
        return await real(key, **kwargs)

    stores.idempotency.claim = claim  # type: ignore[method-assign]


class _CancelWhileThinking:
    """A scripted model; while it thinks at ``iteration`` an operator cancels the run."""

    def __init__(self, stores: Stores, run_id: str, turns: list[Any], iteration: int) -> None:
        self.inner = ScriptedProvider(turns)
        self.stores, self.run_id, self.iteration = stores, run_id, iteration
        self.acknowledged: list[Any] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if request.iteration == self.iteration and not self.acknowledged:
            self.acknowledged.append(await _cancel(self.stores, self.run_id))
        response: ModelResponse = await self.inner.complete(request)
        return response


async def test_a_cancel_while_a_resumed_run_past_its_frontier_thinks_ends_it_cancelled(
    tmp_path: Path,
) -> None:
    from tesserix_adk import CheckpointPolicy
    from tesserix_adk.checkpoint.payload import Boundary
    from tesserix_adk.testing.faults import SimulatedCrash

    desk = _Desk()

    @tool
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [
        [("book", {"flight": "A"})],
        [("book", {"flight": "B"}), ("book", {"flight": "C"})],
        "done",
    ]
    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
    async with _opened("sqlite", tmp_path) as stores:
        real = stores.idempotency.claim
        _crash_before_claim_of(stores, "call_1_1")
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(ScriptedProvider(turns), stores, policy=policy).run(
                agent, "go", tenant=T, run_id="d"
            )
        stores.idempotency.claim = real  # type: ignore[method-assign]
        assert desk.sent == ["A", "B"]
        # Resumed: the model, asked again at iteration 1 while the operator cancels, asks
        # for C alone (B ran there already).
        diverged: list[Any] = [turns[0], [("book", {"flight": "C"})], "done"]
        provider = _CancelWhileThinking(stores, "d", diverged, iteration=1)
        run = await AgentRunner.from_stores(provider, stores, policy=policy).resume(
            agent, "d", tenant=T
        )
    assert provider.acknowledged == [None]
    assert run.status is RunStatus.cancelled
    assert desk.sent == ["A", "B"]


def _seat_key(*, tenant: str, arguments: Any, **_: Any) -> str:
    """A key naming the business object: one seat, whichever call or run asks for it."""
    return f"seat:{tenant}:{arguments['seat']}"


async def _twins_after_a_lost_reply(
    tmp_path: Path, *, cancel: bool
) -> tuple[list[str], list[Any], list[str]]:
    """Two calls side by side under one business key (one seat); the first goes out and
    loses its reply (``ToolOutcomeUnknownError``: in doubt, its claim must stay in flight),
    with the operator's cancel acknowledged meanwhile if ``cancel``. Then another run asks
    for the same seat. What went out in the first run, what is left in flight after it, and
    everything that went out."""
    desk = _Desk()

    @tool(key=_seat_key)
    async def book(seat: str, note: str) -> str:
        desk.sent.append(f"{seat}/{note}")
        if len(desk.sent) == 1:
            if cancel:
                await _cancel(stores, "tw")
            raise ToolOutcomeUnknownError("the airline's reply was lost")
        return f"booked {seat}"

    agent = Agent("booker", "Book.", [book], parallel_tool_calls=2)
    turn = [("book", {"seat": "1A", "note": "x"}), ("book", {"seat": "1A", "note": "y"})]
    async with _opened("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider([turn, "done"]), stores)
        with pytest.raises(ToolOutcomeUnknownError):
            await runner.run(agent, "go", tenant=T, run_id="tw")
        first = list(desk.sent)
        left = await _in_flight(stores, "tw")
        later = AgentRunner.from_stores(ScriptedProvider([[turn[0]], "done"]), stores)
        with contextlib.suppress(IndeterminateToolCallError):
            await later.run(agent, "go", tenant=T, run_id="tw2")
    return first, left, desk.sent


async def test_a_parallel_twin_after_its_sibling_lost_the_reply_is_not_sent_again(
    tmp_path: Path,
) -> None:
    first, left, _ = await _twins_after_a_lost_reply(tmp_path, cancel=False)
    assert first == ["1A/x"], first
    assert [r.call_id for r in left] == ["call_0_0"]


async def test_a_cancelled_twin_never_drops_the_claim_of_its_sibling_that_went_out(
    tmp_path: Path,
) -> None:
    first, left, everything = await _twins_after_a_lost_reply(tmp_path, cancel=True)
    assert first == ["1A/x"], first  # the twin itself is answered "not sent"
    assert [r.call_id for r in left] == ["call_0_0"]
    assert everything == ["1A/x"], everything


class _Outage:
    """The store goes away right after a call's claim: the cancel look after it fails, and
    so does the release of the claim (the store is still away); then it is back."""

    def __init__(self, stores: Stores, tool: str) -> None:
        self.failed: list[str] = []
        idem = stores.idempotency
        claim, lookup, release = idem.claim, idem.lookup, idem.release
        claimed: list[str] = []

        async def claiming(key: str, **kwargs: Any) -> Any:
            rec = await claim(key, **kwargs)
            if kwargs.get("tool") == tool and not claimed:
                claimed.append(key)
            return rec

        async def looking(keys: Any, **kwargs: Any) -> Any:
            if (
                claimed
                and "look" not in self.failed
                and any(k.startswith("cancel1:") for k in keys)
            ):
                self.failed.append("look")
                raise StoreUnavailableError("the store went away (the test)")
            return await lookup(keys, **kwargs)

        async def releasing(key: str, **kwargs: Any) -> Any:
            if "look" in self.failed and "release" not in self.failed:
                self.failed.append("release")
                raise StoreUnavailableError("the store is still away (the test)")
            return await release(key, **kwargs)

        idem.claim = claiming  # type: ignore[method-assign]
        idem.lookup = looking  # type: ignore[method-assign]
        idem.release = releasing  # type: ignore[method-assign]


@pytest.mark.xfail(
    strict=True,
    reason=(
        "new window of fbb8639 on ungrouped backends: the cancel look is a store round trip "
        "between a durable claim and the send (dispatch.py _call_tool); when it fails and "
        "release_unsent fails too (recording.py: logged, claim left in flight), the resume "
        "refuses a call that never went out as IndeterminateToolCallError (a window the "
        "README's `tesserix cancel` row names, for `tesserix resolve --never-ran`)"
    ),
)
@pytest.mark.parametrize("backend", DURABLE)
async def test_an_outage_at_the_look_after_the_claim_leaves_no_unsent_call_in_doubt(
    tmp_path: Path, backend: str
) -> None:
    desk = _Desk()

    @tool
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [[("book", {"flight": "LH1"})], "done"]
    async with _opened(backend, tmp_path) as stores:
        outage = _Outage(stores, "book")
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        with pytest.raises(StoreUnavailableError):
            await runner.run(agent, "go", tenant=T, run_id="o")
        assert outage.failed == ["look", "release"] and desk.sent == []
        # The store is back: the resume sends the call once (it never went out).
        run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
            agent, "o", tenant=T
        )
    assert run.status is RunStatus.completed and desk.sent == ["LH1"]


@pytest.mark.postgres
async def test_an_unkeyed_call_is_not_sent_after_a_cancel_acknowledged_while_its_frontier_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tesserix_adk.adapters.postgres import grouping as pg_grouping

    desk = _Desk()

    @tool(key=None)
    def wire(amount: int) -> str:
        desk.sent.append(str(amount))
        return "wired"

    agent = Agent("payer", "Pay.", [wire])
    turns: list[Any] = [[("wire", {"amount": 5})], "done"]
    acknowledged: list[Any] = []
    async with _opened("postgres", tmp_path) as stores:
        batched = pg_grouping.batched

        async def committing(
            conn: Any, before: Any, statements: Any, *rest: Any, **named: Any
        ) -> Any:
            if "COMMIT" in (rest[0] if rest else named.get("tail", ())) and not acknowledged:
                # The operator's cancel is acknowledged just before the message that
                # commits the group holding the frontier that names the call, before the
                # call goes out.
                acknowledged.append(await _cancel(stores, "u"))
            return await batched(conn, before, statements, *rest, **named)

        monkeypatch.setattr(pg_grouping, "batched", committing)
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, group_writes=True)
        run = await runner.run(agent, "go", tenant=T, run_id="u")
    assert acknowledged == [None]
    assert run.status is RunStatus.cancelled
    assert desk.sent == [], desk.sent


@pytest.mark.parametrize(
    ("backend", "grouped"),
    [
        ("memory", False),
        ("sqlite", False),
        ("sqlite", True),
        pytest.param("redis", False, marks=pytest.mark.redis),
        pytest.param("postgres", False, marks=pytest.mark.postgres),
        pytest.param("postgres", True, marks=pytest.mark.postgres),
    ],
)
async def test_a_death_after_the_look_found_the_cancel_resumes_cancelled_not_in_doubt(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    from tesserix_adk.testing.faults import SimulatedCrash

    desk = _Desk()

    @tool
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [[("book", {"flight": "LH1"})], "done"]
    async with _opened(backend, tmp_path) as stores:
        provider = _CancelWhileThinking(stores, "k", turns, iteration=0)
        release = stores.idempotency.release

        async def dying(key: str, **kwargs: Any) -> Any:
            if not key.startswith("cancel1:"):
                raise SimulatedCrash  # the process dies before the unsent claim goes
            return await release(key, **kwargs)

        stores.idempotency.release = dying  # type: ignore[method-assign]
        runner = AgentRunner.from_stores(provider, stores, group_writes=grouped)
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "go", tenant=T, run_id="k")
        stores.idempotency.release = release  # type: ignore[method-assign]
        assert provider.acknowledged == [None] and desk.sent == []
        assert await stores.leases.current(T, "k") is None  # let go, as a death's lapses
        run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
            agent, "k", tenant=T
        )
    assert run.status is RunStatus.cancelled and desk.sent == []


_KILLED_AFTER_THE_LOOK = """
import asyncio, contextvars, os, signal, sys
from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, open_stores, tool

url, sent_file = sys.argv[1:3]

@tool
def book(flight: str) -> str:
    with open(sent_file, "a") as f:
        f.write(flight + "\\n")
    return "booked"

async def main():
    async with open_stores(url) as stores:
        await stores.create_schema()
        inner = ScriptedProvider([[("book", {"flight": "LH1"})], "done"])

        class Thinking:
            async def complete(self, request):
                canceller = AgentRunner.from_stores(inner, stores)
                told = await asyncio.create_task(
                    canceller.cancel("sk", tenant="acme", by="ops"), context=contextvars.Context()
                )
                print("ACKNOWLEDGED", told, flush=True)
                return await inner.complete(request)

        release = stores.idempotency.release

        async def dying(key, **kw):
            if not key.startswith("cancel1:"):
                os.kill(os.getpid(), signal.SIGKILL)
            return await release(key, **kw)

        stores.idempotency.release = dying
        runner = AgentRunner.from_stores(
            Thinking(), stores, group_writes=True,
            lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5),
        )
        await runner.run(Agent("booker", "Book.", [book]), "go", tenant="acme", run_id="sk")

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "backend",
    [pytest.param("sqlite", id="sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)],
)
async def test_a_process_killed_after_the_look_found_the_cancel_resumes_cancelled(
    tmp_path: Path, backend: str
) -> None:
    import subprocess
    import sys

    sent = tmp_path / "sent.txt"
    async with store_url(backend, tmp_path) as url:
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", _KILLED_AFTER_THE_LOOK, url, str(sent)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == -9, proc.stdout + proc.stderr
        assert "ACKNOWLEDGED None" in proc.stdout
        await asyncio.sleep(1.2)  # its lease lapses
        async with open_stores(url) as stores:
            left = await _in_flight(stores, "sk")
            agent = Agent("booker", "Book.", [_never_book])
            try:
                run: Any = await AgentRunner.from_stores(ScriptedProvider(["done"]), stores).resume(
                    agent, "sk", tenant=T
                )
            except IndeterminateToolCallError as exc:
                run = exc
    assert not sent.exists()
    assert [r.tool for r in left] == ["book"]  # the claim the look committed, never sent
    assert getattr(run, "status", run) is RunStatus.cancelled


@tool(name="book")
def _never_book(flight: str) -> str:
    raise AssertionError("a cancelled run's call was sent")


# =========================================================================================
# What held
# =========================================================================================

MATRIX = [
    ("memory", False),
    ("sqlite", False),
    ("sqlite", True),
    pytest.param("redis", False, marks=pytest.mark.redis),
    pytest.param("postgres", False, marks=pytest.mark.postgres),
    pytest.param("postgres", True, marks=pytest.mark.postgres),
]


async def _transcript(stores: Stores, run_id: str) -> tuple[Any, list[Any]]:
    checkpointer = Checkpointer.from_stores(stores)
    cp = await checkpointer.latest(T, run_id)
    assert cp is not None
    return cp, await checkpointer.messages(cp)


def _answers(messages: list[Any]) -> dict[str, str]:
    return {m.tool_call_id: m.text for m in messages if m.tool_call_id is not None}


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
async def test_a_cancel_during_a_sequential_call_stops_the_rest_and_leaves_nothing_in_doubt(
    tmp_path: Path, backend: str, grouped: bool, keyed: bool
) -> None:
    desk = _Desk()
    acknowledged: list[Any] = []

    async def book(flight: str) -> str:
        desk.sent.append(flight)
        if len(desk.sent) == 1:
            acknowledged.append(await _cancel(stores, "s"))
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [tool(book) if keyed else tool(key=None)(book)])
    turn = [("book", {"flight": f"LH{n}"}) for n in range(3)]
    async with _opened(backend, tmp_path) as stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([turn, "done"]), stores, group_writes=grouped
        )
        run = await runner.run(agent, "go", tenant=T, run_id="s")
        left = await _in_flight(stores, "s")
        cp, messages = await _transcript(stores, "s")
        again = await AgentRunner.from_stores(ScriptedProvider([turn, "done"]), stores).resume(
            agent, "s", tenant=T
        )
    assert acknowledged == [None]
    assert run.status is RunStatus.cancelled and run.output == "cancelled by ops"
    assert desk.sent == ["LH0"] and left == []
    # The operator sees the final cancelled frontier and what the model was told.
    assert str(cp.status) == "cancelled"
    answers = _answers(messages)
    assert answers["call_0_0"] == "booked LH0"
    assert answers["call_0_1"].startswith("not sent: the run was cancelled by ops")
    assert answers["call_0_2"].startswith("not sent: the run was cancelled by ops")
    assert again.status is RunStatus.cancelled and desk.sent == ["LH0"]


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
async def test_parallel_calls_claimed_after_the_cancel_are_never_sent(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    desk = _Desk()
    order: list[str] = []
    acknowledged: list[Any] = []

    @tool
    async def book(flight: str) -> str:
        desk.sent.append(flight)
        await asyncio.sleep(0.01)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book], parallel_tool_calls=3)
    turn = [("book", {"flight": f"LH{n}"}) for n in range(4)]
    async with _opened(backend, tmp_path) as stores:
        claim = stores.idempotency.claim

        async def claiming(key: str, **kwargs: Any) -> Any:
            if kwargs.get("call_id") == "call_0_1" and not acknowledged:
                # No group is open while calls are out side by side: the cancel lands.
                acknowledged.append(await _cancel(stores, "p"))
                order.append("ack")
            # Noted when asked, not when answered: a claim asked before the cancel was
            # acknowledged may run in the store before it, and its answer come back after
            # (a loaded machine), and such a call may rightly be sent.
            order.append(str(kwargs.get("call_id")))
            return await claim(key, **kwargs)

        stores.idempotency.claim = claiming  # type: ignore[method-assign]
        runner = AgentRunner.from_stores(
            ScriptedProvider([turn, "done"]), stores, group_writes=grouped
        )
        run = await runner.run(agent, "go", tenant=T, run_id="p")
        left = await _in_flight(stores, "p")
    assert acknowledged == [None] and run.status is RunStatus.cancelled
    after = order[order.index("ack") + 1 :]
    claimed_after = {f"LH{c[-1]}" for c in after if c.startswith("call_")}
    assert "LH1" in claimed_after
    # "a call not yet claimed when the cancel was acknowledged is answered 'not sent'"
    assert not claimed_after & set(desk.sent), (order, desk.sent)
    assert left == []


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
async def test_a_cancel_while_the_model_thinks_stops_an_approval_turn_before_it_asks(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    desk = _Desk()

    @tool(requires_approval=True)
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return "booked"

    @tool(side_effects=False)
    def look(flight: str) -> str:
        desk.sent.append(f"look {flight}")
        return "seen"

    agent = Agent("booker", "Book.", [book, look])
    turns: list[Any] = [[("look", {"flight": "LH1"}), ("book", {"flight": "LH1"})], "done"]
    async with _opened(backend, tmp_path) as stores:
        provider = _CancelWhileThinking(stores, "a", turns, iteration=0)
        runner = AgentRunner.from_stores(provider, stores, group_writes=grouped)
        run = await runner.run(agent, "go", tenant=T, run_id="a")
        left = await _in_flight(stores, "a")
    assert provider.acknowledged == [None]
    assert run.status is RunStatus.cancelled and run.pending_approval is None
    assert desk.sent == [] and left == []


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
async def test_a_cancel_while_the_model_thinks_stops_an_unkeyed_call(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    desk = _Desk()

    @tool(key=None)
    def wire(amount: int) -> str:
        desk.sent.append(str(amount))
        return "wired"

    agent = Agent("payer", "Pay.", [wire])
    turns: list[Any] = [[("wire", {"amount": 5})], "done"]
    async with _opened(backend, tmp_path) as stores:
        provider = _CancelWhileThinking(stores, "w", turns, iteration=0)
        runner = AgentRunner.from_stores(provider, stores, group_writes=grouped)
        run = await runner.run(agent, "go", tenant=T, run_id="w")
        _, messages = await _transcript(stores, "w")
    assert provider.acknowledged == [None]
    assert run.status is RunStatus.cancelled and desk.sent == []
    assert _answers(messages)["call_0_0"].startswith("not sent: the run was cancelled")


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
@pytest.mark.parametrize("how", ["unavailable", "reply-lost", "task-cancelled"])
async def test_a_look_that_fails_after_the_claim_drops_it_and_the_resume_sends_once(
    tmp_path: Path, backend: str, grouped: bool, how: str
) -> None:
    """Call 0 went out (its outcome in the open group, grouped); call 1's look at the cancel
    fails once it is claimed: nothing of call 1 went out, its claim goes (what
    ``grouped()`` drops is call 1's claim only, never call 0's), and the resume replays
    call 0 and sends call 1 once."""
    from tesserix_adk.errors import StoreReplyLostError

    desk = _Desk()

    @tool
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [[("book", {"flight": "LH0"}), ("book", {"flight": "LH1"})], "done"]
    async with _opened(backend, tmp_path) as stores:
        idem = stores.idempotency
        claim, lookup = idem.claim, idem.lookup
        claimed: list[str] = []
        failed: list[str] = []

        async def claiming(key: str, **kwargs: Any) -> Any:
            rec = await claim(key, **kwargs)
            claimed.append(str(kwargs.get("call_id")))
            return rec

        async def looking(keys: Any, **kwargs: Any) -> Any:
            if claimed[-1:] == ["call_0_1"] and not failed and keys[0].startswith("cancel1:"):
                failed.append(how)
                if how == "unavailable":
                    raise StoreUnavailableError("the store went away (the test)")
                if how == "reply-lost":
                    await lookup(keys, **kwargs)
                    raise StoreReplyLostError("the look's reply was lost (the test)")
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                await asyncio.sleep(0)
            return await lookup(keys, **kwargs)

        idem.claim = claiming  # type: ignore[method-assign]
        idem.lookup = looking  # type: ignore[method-assign]
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, group_writes=grouped)
        expected = asyncio.CancelledError if how == "task-cancelled" else StoreUnavailableError
        with pytest.raises((expected, StoreReplyLostError)):
            await asyncio.create_task(runner.run(agent, "go", tenant=T, run_id="f"))
        idem.claim, idem.lookup = claim, lookup  # type: ignore[method-assign]
        assert failed == [how] and desk.sent == ["LH0"]
        assert await _in_flight(stores, "f") == []
        await _lapsed(stores, "f")
        run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
            agent, "f", tenant=T
        )
    assert run.status is RunStatus.completed
    assert desk.sent == ["LH0", "LH1"]


async def _lapsed(stores: Stores, run_id: str) -> None:
    lease = await stores.leases.current(T, run_id)
    if lease is not None:
        await stores.leases.release(lease)


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
async def test_an_attempt_failing_after_a_call_went_out_never_drops_its_claim(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    """The call went out and its outcome cannot be recorded: the attempt fails with a
    group open (its outcome's), and ``grouped()`` drops no claim of it: the resume refuses
    it as in doubt rather than sending it again."""
    desk = _Desk()

    @tool
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [[("book", {"flight": "LH0"}), ("book", {"flight": "LH1"})], "done"]
    async with _opened(backend, tmp_path) as stores:
        idem = stores.idempotency
        complete = idem.complete

        async def failing(key: str, *args: Any, **kwargs: Any) -> Any:
            if not key.startswith("cancel1:"):
                raise StoreUnavailableError("the outcome cannot be written (the test)")
            return await complete(key, *args, **kwargs)

        idem.complete = failing  # type: ignore[method-assign]
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, group_writes=grouped)
        with pytest.raises(StoreUnavailableError):
            await runner.run(agent, "go", tenant=T, run_id="g")
        idem.complete = complete  # type: ignore[method-assign]
        left = await _in_flight(stores, "g")
        await _lapsed(stores, "g")
        with pytest.raises(IndeterminateToolCallError) as refused:
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
                agent, "g", tenant=T
            )
    assert desk.sent == ["LH0"]
    assert [r.call_id for r in left] == ["call_0_0"]
    assert [c.call_id for c in refused.value.calls] == ["call_0_0"]


@pytest.mark.parametrize(("backend", "grouped"), MATRIX)
async def test_a_resumed_turn_replays_what_ran_and_sends_nothing_claimed_after_a_cancel(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    from tesserix_adk.testing.faults import SimulatedCrash

    desk = _Desk()

    @tool
    def book(flight: str) -> str:
        desk.sent.append(flight)
        return f"booked {flight}"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [[("book", {"flight": "LH0"}), ("book", {"flight": "LH1"})], "done"]
    async with _opened(backend, tmp_path) as stores:
        claim = stores.idempotency.claim
        _crash_before_claim_of(stores, "call_0_1")
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(
                ScriptedProvider(turns), stores, group_writes=grouped
            ).run(agent, "go", tenant=T, run_id="r")
        acknowledged: list[Any] = []

        async def claiming(key: str, **kwargs: Any) -> Any:
            if kwargs.get("call_id") == "call_0_0" and not acknowledged:
                # After the resume's own check: the cancel lands as it replays call 0.
                acknowledged.append(await _cancel(stores, "r"))
            return await claim(key, **kwargs)

        stores.idempotency.claim = claiming  # type: ignore[method-assign]
        await _lapsed(stores, "r")
        run = await AgentRunner.from_stores(
            ScriptedProvider(turns), stores, group_writes=grouped
        ).resume(agent, "r", tenant=T)
        left = await _in_flight(stores, "r")
        _, messages = await _transcript(stores, "r")
    assert acknowledged == [None]
    assert run.status is RunStatus.cancelled and desk.sent == ["LH0"] and left == []
    answers = _answers(messages)
    assert answers["call_0_0"] == "booked LH0"
    assert answers["call_0_1"].startswith("not sent: the run was cancelled")


async def _waits_per_turn(url: str, wire: Any, agent: Agent, turn: Any) -> float:
    async def waits(turns: int, run_id: str) -> int:
        async with open_stores(url) as stores:
            await stores.create_schema()
            provider = ScriptedProvider([*([turn] * turns), "done"])
            runner = AgentRunner.from_stores(provider, stores, group_writes=True)
            before = wire.waits()
            run = await runner.run(agent, "go", tenant=T, run_id=run_id)
            assert run.status is RunStatus.completed
            return int(wire.waits() - before)

    return (await waits(6, "long") - await waits(2, "short")) / 4


@pytest.mark.postgres
@pytest.mark.parametrize(("kind", "per_turn"), [("unkeyed", 5), ("parallel", 11)])
async def test_a_turn_of_unkeyed_or_parallel_calls_waits_no_more_than_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, per_turn: int
) -> None:
    """Before fbb8639: an unkeyed call's turn was the charge, its frontier, the check after
    the answer, the COMMIT before it went out, the next frontier and the next check with
    its COMMIT (6); two calls side by side, the charge, the frontier, the check, the COMMIT
    before they went out, two claims, the second call's check, two outcomes, the frontier
    and the next check (11). The checks moved after the claims; the counts stay, and an
    unkeyed call's check now carries the COMMIT before it goes out (5)."""
    from adapters.wire import Wire

    @tool(key=None, side_effects=True)
    def wire_money(amount: int) -> str:
        return "wired"

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    if kind == "unkeyed":
        agent = Agent("w", "b", tools=[wire_money], max_iterations=20)
        turn: Any = [("wire_money", {"amount": 1})]
    else:
        agent = Agent("w", "b", tools=[book], max_iterations=20, parallel_tool_calls=2)
        turn = [("book", {"seat": "1A"}), ("book", {"seat": "1B"})]
    wire = Wire(monkeypatch, tmp_path)
    async with store_url("postgres", tmp_path) as url:
        assert await _waits_per_turn(url, wire, agent, turn) == per_turn
