"""What an operator types never undoes the kit's promises: notes and outcomes are redacted
before a store sees them, a resolution holds the run's lease, and a provider the command
built is closed however the command ends."""

from __future__ import annotations

import asyncio
import importlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    LeaseHeldError,
    ModelRequest,
    ModelResponse,
    ScriptedProvider,
    ToolCall,
)
from tesserix_adk.cli import ExitCode, frontier_main, resume_main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

SECRETS = (
    "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "hunter2-correct-horse",
)
PLANTED = (
    f"the key {SECRETS[0]} works again; "
    f"header Authorization: Bearer {SECRETS[1]}; "
    f"db postgresql://admin:{SECRETS[2]}@db.example/prod"
)


@pytest.fixture(params=["memory", "sqlite"])
def make_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of ``Stores`` on one backend; each call opens them afresh (the commands
    close the stores they are given)."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    if request.param == "memory":
        shared = open_stores(url)  # memory: one set, which closing leaves as it is
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


# --- redaction of what the operator types -------------------------------------------------


def test_an_approval_note_is_redacted_before_the_store(make_stores: Any) -> None:
    async def ask(stores: Stores) -> str:
        call = ToolCall(id="call_1_0", name="book_seat", arguments={"flight": "LH123"})
        return (await stores.approvals.request("acme", "r", [call], iteration=1)).id

    request = _in(make_stores(), ask)
    code = frontier_main(
        ["approve", request, "--tenant", "acme", "--by", "alice", "--note", PLANTED],
        stores=make_stores(),
        out=io.StringIO(),
        err=io.StringIO(),
    )
    assert code == ExitCode.CARRIED_ON

    async def note(stores: Stores) -> str:
        decided = await stores.approvals.get("acme", request)
        assert decided is not None and decided.note is not None
        return decided.note

    stored = _in(make_stores(), note)
    assert not [s for s in SECRETS if s in stored], stored
    assert "[redacted:" in stored and "admin" in stored


def _in_flight(make_stores: Any) -> None:
    """A run that died inside book_seat: its call is claimed in flight, nobody holds it."""

    async def go(stores: Stores) -> None:
        await stores.idempotency.claim(
            "k-1",
            holder="w-dead",
            tenant="acme",
            run_id="r",
            iteration=1,
            tool="book_seat",
            call_id="call_1_0",
            flags=None,
        )

    _in(make_stores(), go)


def _resolve(make_stores: Any, *what: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(
        ["resolve", "r", "--tenant", "acme", "--call", "call_1_0", *what, "--by", "on-call"],
        stores=make_stores(),
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def _record(make_stores: Any) -> Any:
    async def go(stores: Stores) -> Any:
        (record,) = [r for r in await stores.idempotency.records("acme", "r") if r.tool]
        return record

    return _in(make_stores(), go)


def test_a_resolution_outcome_is_redacted_before_the_store(make_stores: Any) -> None:
    _in_flight(make_stores)
    outcome = json.dumps({"booking": "BK-1", "password": "plain-pw-1", "seen": PLANTED})
    code, _, err = _resolve(make_stores, "--outcome", outcome)
    assert code == ExitCode.CARRIED_ON, err
    record = _record(make_stores)
    assert record.status is RecordStatus.completed
    stored = bytes(record.outcome).decode()
    assert not [s for s in (*SECRETS, "plain-pw-1") if s in stored], stored
    assert "BK-1" in stored


# --- resolve holds the run's lease ---------------------------------------------------------


def test_resolve_refuses_while_another_worker_holds_the_lease(make_stores: Any) -> None:
    _in_flight(make_stores)
    _in(make_stores(), lambda s: s.leases.acquire("acme", "r", "w-live", 60))
    code, _, err = _resolve(make_stores, "--never-ran")
    assert code == ExitCode.HELD
    assert "another worker holds the run" in err and "w-live" in err
    assert _record(make_stores).status is RecordStatus.in_flight


def test_no_worker_can_take_the_run_while_an_operator_resolves_it(make_stores: Any) -> None:
    """The resolution happens under the operator's own lease: a worker trying to carry the
    run at that moment is refused, and the lease is let go afterwards."""
    _in_flight(make_stores)
    stores = make_stores()
    seen: list[str] = []
    real_resolve = stores.idempotency.resolve

    async def resolve_watched(key: str, *args: Any, **kwargs: Any) -> Any:
        try:
            await stores.leases.acquire("acme", "r", "eager-worker", 60)
            seen.append("a worker took the run mid-resolution")
        except LeaseHeldError as exc:
            seen.append(f"refused: held by {exc.holder}")
        return await real_resolve(key, *args, **kwargs)

    stores.idempotency.resolve = resolve_watched  # type: ignore[method-assign]
    out = io.StringIO()
    code = frontier_main(
        ["resolve", "r", "--tenant", "acme", "--call", "call_1_0", "--never-ran", "--by", "me"],
        stores=stores,
        out=out,
        err=io.StringIO(),
    )
    assert code == ExitCode.CARRIED_ON
    assert len(seen) == 1 and seen[0].startswith("refused: held by tesserix-resolve-"), seen
    assert _record(make_stores).status is RecordStatus.never_ran
    assert _in(make_stores(), lambda s: s.leases.current("acme", "r")) is None


def test_a_resolution_is_refused_when_the_claim_was_taken_again_meanwhile(
    make_stores: Any,
) -> None:
    """Another run sharing the call's key settles it and claims it again while the operator
    resolves: the operator's word was about the claim they looked at, and lands on none."""
    _in_flight(make_stores)
    key = _record(make_stores).key
    stores = make_stores()
    real_resolve = stores.idempotency.resolve

    async def resolve_after_a_takeover(key: str, *args: Any, **kwargs: Any) -> Any:
        await real_resolve(key, never_ran=True, tenant="acme", by="other-run")
        await stores.idempotency.claim(
            key,
            holder="other-run-holder",
            tenant="acme",
            run_id="other-run",
            iteration=1,
            tool="book_seat",
            call_id="c9",
            flags=None,
        )
        return await real_resolve(key, *args, **kwargs)

    stores.idempotency.resolve = resolve_after_a_takeover  # type: ignore[method-assign]
    err = io.StringIO()
    code = frontier_main(
        ["resolve", "r", "--tenant", "acme", "--call", "call_1_0", "--never-ran", "--by", "me"],
        stores=stores,
        out=io.StringIO(),
        err=err,
    )
    assert code == ExitCode.HELD, err.getvalue()
    assert "changed while it was resolved" in err.getvalue()
    found = _in(make_stores(), lambda s: s.idempotency.lookup([key], tenant="acme"))
    record = found[key]
    assert (record.status, record.holder) == (RecordStatus.in_flight, "other-run-holder")


# --- run --resume while the lease is held elsewhere -----------------------------------------


def _interrupted(make_stores: Any, airline: Airline) -> None:
    """A run that died right after the model asked for book_seat."""

    async def go(stores: Stores) -> None:
        faulty = FaultyCheckpointStore(
            stores.checkpoints,
            crash_after=lambda b: b["boundary"] == "after_model_call" and b["iteration"] == 1,
        )
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(faulty, history=stores.history),
            ledger=stores.ledger,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")

    _in(make_stores(), go)


def _resume(make_stores: Any, airline: Airline, provider: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        ["run", "--resume", "r", "--tenant", "acme", "--agent", "booking", "--provider", provider],
        stores=make_stores(),
        agents={"booking": booking_agent(airline)},
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def test_run_resume_is_exit_3_while_another_worker_holds_the_lease(
    make_stores: Any, airline: Airline
) -> None:
    _interrupted(make_stores, airline)
    lease = _in(make_stores(), lambda s: s.leases.acquire("acme", "r", "someone-else", 60))
    code, _, err = _resume(make_stores, airline, "booking:provider")
    assert code == ExitCode.HELD and "someone-else" in err
    # When to retry, by the store's clock.
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lease.expires_at))
    assert f"lapses at {when} by the store's clock" in err, err
    assert airline.bookings == []


def test_run_resume_says_when_another_resumers_claim_lapses(
    make_stores: Any, airline: Airline
) -> None:
    _interrupted(make_stores, airline)

    async def claim(stores: Stores) -> Any:
        from tesserix_adk.run.attempt import run_claim_key

        return await stores.idempotency.claim(
            run_claim_key("acme", "r"),
            holder="resumer-elsewhere",
            tenant="acme",
            run_id="r",
            iteration=None,
            tool=None,
            call_id=None,
            flags=None,
            ttl=120,
        )

    record = _in(make_stores(), claim)
    code, _, err = _resume(make_stores, airline, "booking:provider")
    assert code == ExitCode.HELD and "resumer-elsewhere" in err
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.expires_at))
    assert f"resume claim lapses at {when}" in err, err


# --- the provider a command built is closed --------------------------------------------------

CLOSED: list[str] = []


class _Closing:
    """A scripted model with a client to close, recording when it is."""

    def __init__(self, how: str) -> None:
        self.inner = ScriptedProvider(BOOK_TURNS)
        self.how = how

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await self.inner.complete(request)


class _AsyncClosing(_Closing):
    async def aclose(self) -> None:
        CLOSED.append(self.how)


class _SyncClosing(_Closing):
    def close(self) -> None:
        CLOSED.append(self.how)


def async_closing() -> _AsyncClosing:
    """``--provider cli.test_operator_safety:async_closing``."""
    return _AsyncClosing("aclose")


def sync_closing() -> _SyncClosing:
    """``--provider cli.test_operator_safety:sync_closing``."""
    return _SyncClosing("close")


@pytest.fixture
def closed() -> Iterator[list[str]]:
    """What the providers the CLI built recorded. The CLI imports this file by its
    ``--provider`` name, which may be a second copy of the module pytest collected."""
    record: list[str] = importlib.import_module("cli.test_operator_safety").CLOSED
    record.clear()
    yield record
    record.clear()


@pytest.mark.parametrize(
    ("factory", "how"), [("async_closing", "aclose"), ("sync_closing", "close")]
)
def test_run_resume_closes_the_provider_it_built(
    make_stores: Any, airline: Airline, closed: list[str], factory: str, how: str
) -> None:
    _interrupted(make_stores, airline)
    code, out, err = _resume(make_stores, airline, f"cli.test_operator_safety:{factory}")
    assert code == ExitCode.CARRIED_ON, err
    assert "now completed" in out
    assert closed == [how]


def test_run_resume_closes_the_provider_when_the_resume_is_refused(
    make_stores: Any, airline: Airline, closed: list[str]
) -> None:
    _interrupted(make_stores, airline)
    _in(make_stores(), lambda s: s.leases.acquire("acme", "r", "someone-else", 60))
    code, _, _ = _resume(make_stores, airline, "cli.test_operator_safety:async_closing")
    assert code == ExitCode.HELD
    assert closed == ["aclose"]


def _replay(make_stores: Any, airline: Airline, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        [
            "replay",
            "r",
            "--tenant",
            "acme",
            "--agent",
            "booking",
            "--provider",
            "cli.test_operator_safety:async_closing",
            "--stub",
            "book_seat=booking:fake_booking",
            *extra,
        ],
        stores=make_stores(),
        agents={"booking": booking_agent(airline)},
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def test_replay_closes_the_provider_it_built_however_it_ends(
    make_stores: Any, airline: Airline, closed: list[str]
) -> None:
    async def finished(stores: Stores) -> None:
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer.from_stores(stores),
            ledger=stores.ledger,
        )
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")

    _in(make_stores(), finished)
    code, _, err = _replay(make_stores, airline, "--from-step", "3")
    assert code == ExitCode.CARRIED_ON, err
    assert closed == ["aclose"]
    missing = _replay(make_stores, airline, "--from-step", "99")
    assert missing[0] == ExitCode.NOTHING_CHECKPOINTED
    assert closed == ["aclose", "aclose"]


# --- never-ran waits a margin past the claimant's lease ------------------------------------


def _lapsed_claimant(make_stores: Any) -> None:
    """The claimant of call_1_0 held the run's lease, which lapsed a moment ago."""

    async def go(stores: Stores) -> None:
        lease = await stores.leases.acquire("acme", "r", "w-dead", 0.2)
        await stores.idempotency.claim(
            "k-1",
            holder="w-dead",
            tenant="acme",
            run_id="r",
            iteration=1,
            tool="book_seat",
            call_id="call_1_0",
            flags=None,
            fence=lease.fence,
        )
        await asyncio.sleep(0.3)

    _in(make_stores(), go)


def _ended_ago(make_stores: Any) -> Any:
    return _in(make_stores(), lambda s: s.leases.ended_ago("acme", "r"))


def test_never_ran_is_refused_within_the_margin_after_the_claimants_lease_ended(
    make_stores: Any,
) -> None:
    """A claimant whose lease just lapsed may have passed its last lease check a moment
    before the end and be sending the call now: it is not yet known never to have run."""
    _lapsed_claimant(make_stores)
    before = _ended_ago(make_stores)
    code, _, err = _resolve(make_stores, "--never-ran")
    assert code == ExitCode.HELD, err
    assert "lease ended" in err and "margin" in err and "never-ran" in err, err
    assert _record(make_stores).status is RecordStatus.in_flight
    # Refused without taking the lease, so the refusal does not push the margin back.
    code, _, err = _resolve(make_stores, "--never-ran")
    assert code == ExitCode.HELD, err
    assert _ended_ago(make_stores) >= before


def test_never_ran_is_recorded_once_the_margin_has_passed(make_stores: Any) -> None:
    _lapsed_claimant(make_stores)
    code, out, err = _resolve(make_stores, "--never-ran", "--margin", "0.1")
    assert code == ExitCode.CARRIED_ON, err
    assert "never ran" in out
    assert _record(make_stores).status is RecordStatus.never_ran


def test_an_outcome_needs_no_margin(make_stores: Any) -> None:
    """Recording what a call did sends nothing, so nothing can land twice."""
    _lapsed_claimant(make_stores)
    code, _, err = _resolve(make_stores, "--outcome", '{"booking": "BK-1"}')
    assert code == ExitCode.CARRIED_ON, err
    assert _record(make_stores).status is RecordStatus.completed


@pytest.mark.parametrize("margin", ["-1", "nan", "inf", "soon"])
def test_a_margin_that_is_not_a_duration_is_a_usage_error(make_stores: Any, margin: str) -> None:
    _lapsed_claimant(make_stores)
    code, _, err = _resolve(make_stores, "--never-ran", "--margin", margin)
    assert code == ExitCode.USAGE, err
    assert _record(make_stores).status is RecordStatus.in_flight
