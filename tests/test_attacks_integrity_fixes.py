"""Attacks on today's two integrity fixes (README "What it guarantees" 3 and 8), by making
ordinary use fail (a false refusal pages an operator) or send a side-effecting call twice.

1. ``planning._said_never_ran``: a ``never_ran`` record must name who said so and hold no
   completion. Tried: ``tesserix resolve --never-ran`` (the CLI the console's button runs),
   a reconciler answering never_ran, the cycle never_ran -> claimed -> in doubt -> never_ran
   again -> completed, and never_ran -> claimed -> completed -> read after a crash; on
   SQLite, Redis and PostgreSQL; each record's fields as each backend leaves them.
2. ``outcomes.record_tag``: a recorded outcome names its record. Tried: a business key two
   runs share (one replays the other's outcome), ``resolve --outcome``, a reconciler's
   outcome, group writes with parallel calls, an outcome an earlier release wrote (format 2,
   no record name) by the holder and by ``resolve``, cancel requests, ``show``/``inspect``,
   tenants and keys with unicode, NUL and thousands of characters.

The oracle: the tool's side effect happens at most once, and every resume carries on (or
refuses with ``IndeterminateToolCallError`` exactly where a call is in doubt), never a
``CheckpointCorruptError`` on data the kit itself wrote. Found: no defect; everything
here held and is kept as passing tests. Not attacked here: Temporal runs (the reader there,
``temporal/steps.py`` ``_told``, tags with the step's tenant and the record's key, as the
writer does) and a group commit that fails and is redone (the redo writes the same payload).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from processes import BACKENDS
from processes import store_url as backend_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Boundary, decode_outcome, encode_outcome, record_tag
from tesserix_adk.checkpoint.planning import _said_never_ran, plan_resume
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.main import main
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.messages import Message, Role, ToolOutcome
from tesserix_adk.reconcile import Reconciled
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags
from tesserix_adk.stores.urls import open_stores

T = "acme"
TTL = 0.4


class Died(BaseException):
    """A process killed: nothing after it runs, nothing is given back."""


def _say(text: str) -> ModelResponse:
    return ModelResponse(message=Message(role=Role.assistant, content=text))


class BookModel:
    """Asks for ``calls`` (one booking each, in one turn), then answers; dies once on the
    answer while ``die_after`` holds a True (the tool's outcome is recorded, the frontier
    after it is not)."""

    def __init__(self, *flights: str, die_after: list[bool] | None = None) -> None:
        self.flights = flights or ("LH400",)
        self.die_after = die_after if die_after is not None else []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        results = [m for m in request.messages if m.role is Role.tool]
        if results:
            if self.die_after and self.die_after.pop(0):
                raise Died
            return _say("done: " + " | ".join(str(m.content) for m in results))
        calls = [
            ToolCall(id=f"c{i}", name="book", arguments={"flight": f})
            for i, f in enumerate(self.flights)
        ]
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=calls))


def _agent(
    sent: list[str],
    die: list[bool],
    *,
    key: Any = None,
    reconcile: Any = None,
    parallel: int = 1,
) -> Agent:
    options: dict[str, Any] = {}
    if key is not None:
        options["key"] = key
    if reconcile is not None:
        options["reconcile"] = reconcile

    @tool(**options)
    async def book(flight: str) -> dict[str, str]:
        """Book a seat (side-effecting, keyed)."""
        if die and die.pop(0):
            raise Died
        sent.append(flight)
        return {"booking": f"BK-{flight}"}

    return Agent("booker", "Book.", [book], parallel_tool_calls=parallel)


def _runner(stores: Any, model: Any, **options: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        model,
        stores,
        lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
        resume_claim_ttl=TTL,
        never_ran_margin=0.05,
        **options,
    )


@asynccontextmanager
async def _site(backend: str, tmp: Path) -> AsyncIterator[tuple[str, Any]]:
    async with backend_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield url, stores


def _cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix ARGV --store URL`` in this process (its own event loop, in a thread)."""
    out, err = io.StringIO(), io.StringIO()
    got: list[int] = []

    def go() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            got.append(main([*argv, "--store", url]))

    thread = threading.Thread(target=go)
    thread.start()
    thread.join(120)
    return got[0], out.getvalue(), err.getvalue()


async def acli(url: str, *argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(_cli, url, *argv)


async def _lapse(stores: Any, run_id: str, tenant: str = T) -> None:
    await asyncio.sleep(TTL + 0.15)
    assert await stores.leases.current(tenant, run_id) is None


async def _the_record(stores: Any, run_id: str, tenant: str = T) -> Any:
    [rec] = [r for r in await stores.idempotency.records(tenant, run_id) if r.tool is not None]
    # records() of some stores leave the outcome in, lookup always does.
    return (await stores.idempotency.lookup([rec.key], tenant=tenant))[rec.key]


async def _plans_cleanly(stores: Any, run_id: str, tenant: str = T) -> Any:
    cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
    assert cp is not None
    return await plan_resume(cp, stores.idempotency)


def _die_at_tool_result(runner: AgentRunner) -> None:
    """The process dies right before the ``after_tool_result`` frontier is written."""
    checkpoints = runner.checkpoints
    assert checkpoints is not None
    write = checkpoints.write

    async def watched(frontier: Any, **kw: Any) -> Any:
        if frontier.boundary is Boundary.after_tool_result:
            raise Died
        return await write(frontier, **kw)

    checkpoints.write = watched  # type: ignore[method-assign]


async def _resolve(url: str, run_id: str, *how: str, tenant: str = T) -> str:
    code, out, err = await acli(
        url, "resolve", run_id, "--tenant", tenant, "--call", "c0", *how, "--margin", "0"
    )
    assert code == 0, (code, out, err)
    return out


# --- 1. never_ran: each legitimate way a record comes to say it -----------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_never_ran_twice_by_the_cli_then_completed_is_sent_once_and_reads_back(
    backend: str, tmp_path: Path
) -> None:
    """in doubt -> resolve --never-ran -> sent, died inside again -> in doubt -> resolve
    --never-ran (another operator) -> sent and completed; then read by a resume, inspect and
    show. Nothing is refused as corrupt, and the seat is booked once."""
    async with _site(backend, tmp_path) as (url, stores):
        sent: list[str] = []
        agent = _agent(sent, [True, True])
        with pytest.raises(Died):
            await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id="r")
        await _lapse(stores, "r")
        with pytest.raises(IndeterminateToolCallError):
            await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        await _resolve(url, "r", "--never-ran", "--by", "alice")
        rec = await _the_record(stores, "r")
        assert (rec.status, rec.by, rec.outcome, rec.completed_at) == (
            RecordStatus.never_ran,
            "alice",
            None,
            None,
        )
        plan = await _plans_cleanly(stores, "r")
        assert [p.disposition for p in plan.to_dispatch] == ["never_ran"]
        with pytest.raises(Died):  # sent again and died inside it again
            await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        await _lapse(stores, "r")
        rec = await _the_record(stores, "r")
        assert (rec.status, rec.by, rec.never_ran_by, rec.outcome, rec.completed_at) == (
            RecordStatus.in_flight,
            None,
            "alice",
            None,
            None,
        )
        with pytest.raises(IndeterminateToolCallError):
            await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        await _resolve(url, "r", "--never-ran", "--by", "bob")
        rec = await _the_record(stores, "r")
        assert (rec.status, rec.by, rec.outcome, rec.completed_at) == (
            RecordStatus.never_ran,
            "bob",
            None,
            None,
        )
        run = await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        assert run.status == "completed", run
        assert sent == ["LH400"]
        rec = await _the_record(stores, "r")
        assert (rec.status, rec.by, rec.never_ran_by) == (RecordStatus.completed, None, "bob")
        for cmd in ("inspect", "show"):
            code, out, err = await acli(url, cmd, "r", "--tenant", T, "--json")
            assert code == 0, (cmd, code, err)
            json.loads(out)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_never_ran_then_completed_then_crash_replays_the_outcome(
    backend: str, tmp_path: Path
) -> None:
    """Resolved never_ran, claimed again and completed, the process dies before the next
    frontier: the resume replays the outcome (completed), the seat is booked once."""
    async with _site(backend, tmp_path) as (url, stores):
        sent: list[str] = []
        agent = _agent(sent, [True])
        with pytest.raises(Died):
            await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id="r")
        await _lapse(stores, "r")
        await _resolve(url, "r", "--never-ran", "--by", "alice")
        runner = _runner(stores, BookModel())
        _die_at_tool_result(runner)
        with pytest.raises(Died):  # the tool ran and was recorded; its frontier was not
            await runner.resume(agent, "r", tenant=T)
        await _lapse(stores, "r")
        assert (await _the_record(stores, "r")).never_ran_by == "alice"
        plan = await _plans_cleanly(stores, "r")
        assert [p.disposition for p in plan.completed] == ["completed"], plan
        assert not plan.to_dispatch and not plan.indeterminate, plan
        code, out, err = await acli(url, "inspect", "r", "--tenant", T)
        assert code == 0 and "completed" in out, (code, out, err)
        run = await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        assert run.status == "completed" and "BK-LH400" in str(run.output), run
        assert sent == ["LH400"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_reconciler_saying_never_ran_twice_carries_the_run_with_one_booking(
    backend: str, tmp_path: Path
) -> None:
    """A reconciler answering never_ran (by ``reconciler:book``), the call dying inside
    again, the reconciler asked again: the run completes; nothing refused as corrupt."""
    async with _site(backend, tmp_path) as (_url, stores):
        sent: list[str] = []
        asked: list[str] = []

        def reconcile(call: ToolCall, ctx: Any) -> Reconciled:
            asked.append(call.id)
            return Reconciled.never_ran()

        agent = _agent(sent, [True, True], reconcile=reconcile)
        with pytest.raises(Died):
            await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id="r")
        await _lapse(stores, "r")
        with pytest.raises(Died):
            await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        await _lapse(stores, "r")
        rec = await _the_record(stores, "r")
        assert rec.never_ran_by == "reconciler:book" and rec.by is None, rec
        run = await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        assert run.status == "completed", run
        assert sent == ["LH400"] and asked == ["c0", "c0"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_store_resolve_never_ran_leaves_no_completion_and_keeps_the_name(
    backend: str, tmp_path: Path
) -> None:
    """At the store: a claim resolved never_ran (a plain name, an empty one, one of unicode),
    claimed again and resolved never_ran again: each record reads as ``_said_never_ran``
    wants it (the name kept as given, no outcome, no completion time)."""
    async with _site(backend, tmp_path) as (_url, stores):
        idem = stores.idempotency
        flags = ToolFlags(side_effects=True)
        for i, by in enumerate(["ops", "", "opérateur ☎"]):
            key = f"k{i}"
            for holder in ("h1", "h2"):
                await idem.claim(
                    key,
                    holder=holder,
                    tenant=T,
                    run_id="r",
                    iteration=0,
                    tool="book",
                    call_id=f"c{i}",
                    flags=flags,
                )
                await idem.resolve(key, never_ran=True, tenant=T, by=by, holder=holder)
                rec = (await idem.lookup([key], tenant=T))[key]
                assert (rec.status, rec.by, rec.outcome, rec.completed_at) == (
                    RecordStatus.never_ran,
                    by,
                    None,
                    None,
                ), (backend, by, rec)
                _said_never_ran(rec)
            await idem.claim(
                key,
                holder="h3",
                tenant=T,
                run_id="r",
                iteration=0,
                tool="book",
                call_id=f"c{i}",
                flags=flags,
            )
            await idem.complete(key, b"x", tenant=T, holder="h3")
            rec = (await idem.lookup([key], tenant=T))[key]
            assert (rec.status, rec.by, rec.never_ran_by) == (RecordStatus.completed, None, by)


# --- 2. outcomes naming their record ------------------------------------------------------


def _order_key(**kw: Any) -> str:
    return f"order-{kw['arguments']['flight']}"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_business_key_shared_by_two_runs_replays_the_first_runs_outcome(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (_url, stores):
        sent: list[str] = []
        agent = _agent(sent, [], key=_order_key)
        first = await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id="r1")
        second = await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id="r2")
        assert first.status == second.status == "completed"
        assert "BK-LH400" in str(second.output), second
        assert sent == ["LH400"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_resolve_outcome_and_reconciler_outcome_are_replayed(
    backend: str, tmp_path: Path
) -> None:
    """``tesserix resolve --outcome`` on run r, and a reconciler's ``completed`` on run q
    (a business key), are replayed by the resume: neither refused nor sent."""
    async with _site(backend, tmp_path) as (url, stores):
        sent: list[str] = []
        agent = _agent(sent, [True])
        with pytest.raises(Died):
            await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id="r")
        await _lapse(stores, "r")
        await _resolve(url, "r", "--outcome", '{"booking": "BK-HAND"}', "--by", "ops")
        run = await _runner(stores, BookModel()).resume(agent, "r", tenant=T)
        assert run.status == "completed" and "BK-HAND" in str(run.output), run

        def reconcile(call: ToolCall, ctx: Any) -> Reconciled:
            return Reconciled.completed({"booking": "BK-RECON"})

        agent2 = _agent(sent, [True], key=_order_key, reconcile=reconcile)
        with pytest.raises(Died):
            await _runner(stores, BookModel("AF1")).run(agent2, "book", tenant=T, run_id="q")
        await _lapse(stores, "q")
        run = await _runner(stores, BookModel("AF1")).resume(agent2, "q", tenant=T)
        assert run.status == "completed" and "BK-RECON" in str(run.output), run
        assert sent == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_group_writes_parallel_calls_are_replayed_by_a_run_sharing_their_keys(
    backend: str, tmp_path: Path
) -> None:
    """Three parallel calls recorded through group writes (committed with the frontier);
    a second run under the same business keys replays each outcome."""
    async with _site(backend, tmp_path) as (_url, stores):
        sent: list[str] = []
        agent = _agent(sent, [], parallel=3, key=_order_key)
        flights = ("A1", "B2", "C3")
        for run_id in ("r1", "r2"):
            run = await _runner(stores, BookModel(*flights), group_writes=True).run(
                agent, "book", tenant=T, run_id=run_id
            )
            assert run.status == "completed", run
            for f in flights:
                assert f"BK-{f}" in str(run.output), run.output
        assert sorted(sent) == list(flights)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_outcomes_an_earlier_release_wrote_are_replayed(backend: str, tmp_path: Path) -> None:
    """Format 2 (no record named): completed by the dead holder, and by an operator's
    resolve, as an earlier release wrote them: replayed, never refused."""
    async with _site(backend, tmp_path) as (url, stores):
        sent: list[str] = []
        for run_id, how in (("r", "complete"), ("s", "resolve")):
            agent = _agent(sent, [True])
            with pytest.raises(Died):
                await _runner(stores, BookModel()).run(agent, "book", tenant=T, run_id=run_id)
            rec = await _the_record(stores, run_id)
            old = encode_outcome(
                ToolOutcome(call_id="c0", content={"booking": f"BK-OLD-{how}"}), Redactor()
            )
            assert b'"record"' not in old
            if how == "complete":
                await stores.idempotency.complete(rec.key, old, tenant=T, holder=rec.holder)
            else:
                await stores.idempotency.resolve(rec.key, old, tenant=T, by="ops")
            await _lapse(stores, run_id)
            run = await _runner(stores, BookModel()).resume(agent, run_id, tenant=T)
            assert run.status == "completed" and f"BK-OLD-{how}" in str(run.output), run
            code, out, err = await acli(url, "show", run_id, "--tenant", T, "--json")
            assert code == 0 and f"BK-OLD-{how}" in out, (code, out, err)
        assert sent == []


# No NUL: a tenant or key holding one is refused on every store (tests/adapters/test_nul_text.py).
ODD_TENANTS = ["açme-☃-😀", "t\tn\x7f", "x" * 200]
ODD_KEYS = ["ordér-😀-{f}", "tab\t\x01{f}", "long-" + "k" * 1800 + "-{f}"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("odd", range(3), ids=["unicode", "control", "long"])
async def test_odd_tenants_and_keys_record_and_replay(
    backend: str, odd: int, tmp_path: Path
) -> None:
    """A tenant and a business key of unicode, control or many characters: the call is
    recorded, a crash after it replays it, ``show`` reads it, and the tag is the same one
    the writer made."""
    tenant, shape = ODD_TENANTS[odd], ODD_KEYS[odd]
    async with _site(backend, tmp_path) as (url, stores):
        sent: list[str] = []

        def key(**kw: Any) -> str:
            return shape.format(f=kw["arguments"]["flight"])

        agent = _agent(sent, [], key=key)
        runner = _runner(stores, BookModel())
        _die_at_tool_result(runner)
        with pytest.raises(Died):
            await runner.run(agent, "book", tenant=tenant, run_id="r")
        rec = await _the_record(stores, "r", tenant)
        assert rec.outcome is not None
        decode_outcome(rec.outcome, "c0", record=record_tag(tenant, rec.key))
        await _lapse(stores, "r", tenant)
        run = await _runner(stores, BookModel()).resume(agent, "r", tenant=tenant)
        assert run.status == "completed" and "BK-LH400" in str(run.output), run
        assert sent == ["LH400"]
        code, out, err = await acli(url, "show", "r", "--tenant", tenant, "--json")
        assert code == 0 and "BK-LH400" in out, (code, out, err)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancel_request_reads_back_under_its_own_record(backend: str, tmp_path: Path) -> None:
    async with _site(backend, tmp_path) as (_url, stores):
        runner = _runner(stores, BookModel())
        agent = _agent([], [True])
        with pytest.raises(Died):
            await runner.run(agent, "book", tenant=T, run_id="r")
        await _lapse(stores, "r")
        await runner.cancel("r", tenant=T, by="ops", reason="customer asked")
        found = await cancel_requested(stores.idempotency, T, "r")
        assert found is not None and found.by == "ops" and found.reason == "customer asked"
