"""Oracle attack on what the operator is shown: README "Operating it" promises that every
run needing a person is listed by ``tesserix runs --stuck`` (and the console's "stuck"
filter), and that a run listed there does need one. The oracle is ``runner.resume`` (and a
``Worker``): a run it refuses waits for a person; one it carries on by itself does not.

Found, and fixed unless marked left (``cli/reasons.left_for_a_person`` asks what a resume
asks: the plan's calls in doubt, ``run/resume.uncarriable``, the state ``carried_state``
keeps; ``carriable`` asks ``uncarriable`` too):

- MEDIUM ``test_unkeyed_side_effecting_call_in_doubt_is_listed_stuck`` (SQLite, PostgreSQL,
  Redis): a run whose unkeyed side-effecting call was in flight when its process died is
  refused by every resume (``IndeterminateToolCallError``, ``inspect`` says
  "indeterminate"), yet ``runs --stuck`` and the console leave it out: ``open_calls`` in
  ``cli/reasons.py`` counts idempotency records, and an unkeyed call has none.
- MEDIUM ``test_frontier_state_that_lost_a_secret_is_listed_stuck``: an unfinished run
  whose frontier's state lost a secret to masking (``state_redacted``) is refused
  (``StateRedactedError``, exit 4 by README) but not listed: ``blocked`` in
  ``cli/reasons.py`` never looks at ``state_redacted``.
- MEDIUM ``test_state_masked_in_a_completed_calls_record_is_listed_stuck``: the same when the
  masked state is the one the run's last completed call recorded (``carried_state`` in
  ``run/resume.py`` refuses it): not listed.
- MEDIUM ``test_inspect_says_a_state_redacted_run_cannot_be_carried_on``: ``inspect --json``
  says ``"safe": true`` of that run (``carriable`` in ``cli/reasons.py`` reads the plan
  only), while the resume refuses it; the console's "can be carried on" is the same.
- MEDIUM ``test_flagless_in_flight_record_is_listed_stuck``: a side-effecting call in flight
  whose record keeps no flags (a row of an older release: the columns are nullable) is
  refused as indeterminate by the plan (which takes the frontier's flags) yet ``open_calls``
  takes a flagless record as "sent safe" and does not count it: not listed.
- LOW ``test_inspect_does_not_call_a_failed_run_safe``: ``inspect --json`` says
  ``"safe": true`` of a run that ended ``failed``, which every resume refuses
  (``RunFailedError``): ``carriable`` asks only the (empty) plan.
- LOW (left: which tools the agent has, and so which have a reconciler, is not known to the
  CLI or the console) ``test_reconcilable_call_in_doubt_is_not_listed_stuck``: a call in
  doubt whose tool has a reconciler is listed by ``runs --stuck`` (and the console), yet
  the next worker asks the reconciler and completes the run with nobody asked.

Held:

- ``test_sampled_tool_flags_stuck_iff_resume_refuses`` (hypothesis over side effects,
  idempotent, masked arguments, approval-needing; a keyed call killed in its tool): a run is
  listed by ``runs --stuck`` and the console exactly when ``runner.resume`` refuses it, and
  after a ``Worker`` passes it is listed exactly when the worker parked it.
- ``test_crashed_run_is_listed_only_once_its_lease_lapsed``: a live lease on a run with a
  call in doubt keeps it off the list (no worker may take it meanwhile); released or lapsed,
  the run is listed, and ``show``/``inspect`` exit 0 and name the call in doubt.
- ``test_parked_unkeyed_run_is_listed_after_a_worker``: once a worker has parked the unkeyed
  run of the first defect it is listed, so the gap is before any worker polls it.
- ``test_waiting_approval_is_not_stuck_and_worker_leaves_it``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
import tempfile
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
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.cli import frontier_main
from tesserix_adk.console.reads import RunFilter, runs
from tesserix_adk.errors import (
    IndeterminateToolCallError,
    ProviderError,
    RunFailedError,
    StateRedactedError,
)
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.reconcile import Reconciled
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
SECRET = "sk-live-PLANTEDst4ckOracleSecret0123456789"
SHORT = LeasePolicy(ttl=0.3, renew_within=0.1)
CLAIM = 0.3  # a dead resumer's claim holds others off this long

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


@contextlib.asynccontextmanager
async def opened(backend: str, tmp: Path) -> AsyncIterator[tuple[Stores, str]]:
    async with store_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores, url


async def cli(url: str, *argv: str) -> tuple[int, str]:
    """A frontier command on stores of its own, in a thread (its own event loop)."""

    def call() -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue() + err.getvalue()

    return await asyncio.to_thread(call)


async def cli_stuck(url: str) -> set[str]:
    code, text = await cli(url, "runs", "--tenant", T, "--stuck", "--json")
    assert code == 0, text
    return {r["run_id"] for r in json.loads(text)["runs"]}


async def console_stuck(stores: Stores) -> set[str]:
    return {r.run_id for r in await runs(stores, T, RunFilter(stuck=True))}


async def lapsed(stores: Stores, run_id: str) -> None:
    for _ in range(200):
        if await stores.leases.current(T, run_id) is None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the lease of {run_id} never lapsed")


def crashing_runner(stores: Stores, turns: list[Any]) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns)),
        stores,
        lease_policy=SHORT,
        never_ran_margin=0.05,
        resume_claim_ttl=CLAIM,
    )


async def crash(stores: Stores, agent: Agent, turns: list[Any], run_id: str, **kw: Any) -> None:
    """Run ``agent`` until its tool kills the "process", then wait out the dead lease."""
    with pytest.raises(SimulatedCrash):
        await crashing_runner(stores, turns).run(agent, "go", tenant=T, run_id=run_id, **kw)
    await lapsed(stores, run_id)


async def both_stuck(stores: Stores, url: str) -> tuple[set[str], set[str]]:
    return await cli_stuck(url), await console_stuck(stores)


# --- defects ----------------------------------------------------------------------------


def unkeyed_agent() -> Agent:
    @tool(key=None)
    def notify(message: str) -> str:
        """Send a message (side effects, no idempotency key)."""
        raise SimulatedCrash("died while sending")

    return Agent("notifier", "Notify.", [notify])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_unkeyed_side_effecting_call_in_doubt_is_listed_stuck(
    backend: str, tmp_path: Path
) -> None:
    agent = unkeyed_agent()
    async with opened(backend, tmp_path) as (stores, url):
        await crash(stores, agent, [[("notify", {"message": "hi"})], "Sent."], "unkeyed")
        with pytest.raises(IndeterminateToolCallError):
            await crashing_runner(stores, ["Sent."]).resume(agent, "unkeyed", tenant=T)
        code, text = await cli(url, "inspect", "unkeyed", "--tenant", T)
        assert code == 0 and "indeterminate" in text, text
        cli_ids, console_ids = await both_stuck(stores, url)
        assert "unkeyed" in cli_ids and "unkeyed" in console_ids, (cli_ids, console_ids)


def state_agent() -> Agent:
    @tool
    def remember(x: str, ctx: Any) -> str:
        """Keep a token in the run's state (what README tells you not to do)."""
        ctx.state["token"] = SECRET
        return "kept"

    @tool(side_effects=False)
    def look(x: str) -> str:
        """Look something up; the process dies inside it."""
        raise SimulatedCrash("died while looking")

    return Agent("stateful", "Go.", [remember, look])


async def test_frontier_state_that_lost_a_secret_is_listed_stuck(tmp_path: Path) -> None:
    agent = state_agent()
    turns: list[Any] = [[("remember", {"x": "1"})], [("look", {"x": "2"})], "Done."]
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, turns, "masked-frontier", state={})
        with pytest.raises(StateRedactedError):
            await crashing_runner(stores, ["Done."]).resume(agent, "masked-frontier", tenant=T)
        cli_ids, console_ids = await both_stuck(stores, url)
        assert "masked-frontier" in cli_ids and "masked-frontier" in console_ids


async def test_state_masked_in_a_completed_calls_record_is_listed_stuck(tmp_path: Path) -> None:
    agent = state_agent()
    turns: list[Any] = [[("remember", {"x": "1"}), ("look", {"x": "2"})], "Done."]
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, turns, "masked-record", state={})
        with pytest.raises(StateRedactedError):
            await crashing_runner(stores, ["Done."]).resume(agent, "masked-record", tenant=T)
        cli_ids, console_ids = await both_stuck(stores, url)
        assert "masked-record" in cli_ids and "masked-record" in console_ids


async def test_inspect_says_a_state_redacted_run_cannot_be_carried_on(tmp_path: Path) -> None:
    agent = state_agent()
    turns: list[Any] = [[("remember", {"x": "1"})], [("look", {"x": "2"})], "Done."]
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, turns, "masked-inspect", state={})
        with pytest.raises(StateRedactedError):
            await crashing_runner(stores, ["Done."]).resume(agent, "masked-inspect", tenant=T)
        code, text = await cli(url, "inspect", "masked-inspect", "--tenant", T, "--json")
        assert code == 0, text
        assert json.loads(text)["safe"] is False, text


class Refusing:
    """A model whose every answer is a non-retryable error: the run fails."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise ProviderError("the model refused the request", retryable=False)


async def test_inspect_does_not_call_a_failed_run_safe(tmp_path: Path) -> None:
    agent = unkeyed_agent()
    async with opened("sqlite", tmp_path) as (stores, url):
        failed = await AgentRunner.from_stores(Refusing(), stores).run(
            agent, "go", tenant=T, run_id="failed"
        )
        assert failed.status is RunStatus.failed
        with pytest.raises(RunFailedError):
            await crashing_runner(stores, ["x"]).resume(agent, "failed", tenant=T)
        assert "failed" in await cli_stuck(url)  # listed: held
        code, text = await cli(url, "inspect", "failed", "--tenant", T, "--json")
        assert code == 0, text
        assert json.loads(text)["safe"] is False, text


async def test_flagless_in_flight_record_is_listed_stuck(tmp_path: Path) -> None:
    @tool
    def charge(amount: int) -> str:
        """Charge a card; the process dies inside it."""
        raise SimulatedCrash("died while charging")

    agent = Agent("charger", "Charge.", [charge])
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, [[("charge", {"amount": 5})], "Charged."], "flagless")
        assert url.startswith("sqlite:///")
        with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
            tables = [
                n
                for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
                if "side_effects" in {c[1] for c in db.execute(f"PRAGMA table_info('{n}')")}
            ]
            assert len(tables) == 1, tables
            changed = db.execute(
                f"UPDATE {tables[0]} SET side_effects = NULL, idempotent = NULL "
                "WHERE run_id = ? AND tool = 'charge'",
                ("flagless",),
            ).rowcount
            assert changed == 1
        records = await stores.idempotency.records(T, "flagless")
        assert [r.flags for r in records if r.tool == "charge"] == [None]
        with pytest.raises(IndeterminateToolCallError):
            await crashing_runner(stores, ["Charged."]).resume(agent, "flagless", tenant=T)
        cli_ids, console_ids = await both_stuck(stores, url)
        assert "flagless" in cli_ids and "flagless" in console_ids, (cli_ids, console_ids)


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: runs --stuck and the console list a run whose call in doubt has a "
    "reconciler, which the next worker settles and carries on with nobody asked "
    "(cli/reasons.py open_calls ignores reconcilers: nothing in the record says so)",
)
async def test_reconcilable_call_in_doubt_is_not_listed_stuck(tmp_path: Path) -> None:
    died = {"once": True}
    charged: list[int] = []

    @tool(reconcile=lambda call, ctx: Reconciled.completed("charged"))
    def charge(amount: int) -> str:
        """Charge a card; a reconciler asks the processor what happened."""
        if died["once"]:
            died["once"] = False
            raise SimulatedCrash("died while charging")
        charged.append(amount)  # never reached: the reconciler answers for the call
        return "charged"

    agent = Agent("reconciling", "Charge.", [charge])
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, [[("charge", {"amount": 5})], "Charged."], "reconcilable")
        listed = await both_stuck(stores, url)
        worker = Worker(
            crashing_runner(stores, ["Charged.", "Charged."]),
            [agent],
            exit_when_idle=True,
            poll_interval=0.01,
        )
        await asyncio.wait_for(worker.run(), 30)
        code, text = await cli(url, "inspect", "reconcilable", "--tenant", T, "--json")
        assert code == 0 and json.loads(text)["status"] == "completed", text
        assert charged == []  # the worker carried it on by itself, nobody asked
        assert listed == (set(), set()), listed


# --- held -------------------------------------------------------------------------------


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    side_effects=st.booleans(),
    idempotent=st.booleans(),
    masked=st.booleans(),
    approval=st.booleans(),
)
def test_sampled_tool_flags_stuck_iff_resume_refuses(
    side_effects: bool, idempotent: bool, masked: bool, approval: bool
) -> None:
    """A keyed call killed inside its tool, over sampled flags: listed by ``runs --stuck``
    and the console exactly when ``runner.resume`` refuses; after a worker, listed exactly
    when it parked the run. Held."""
    approval = approval and side_effects and not masked  # a masked call is never sent
    died = {"once": True}

    @tool(side_effects=side_effects, idempotent=idempotent, requires_approval=approval)
    def act(target: str, note: str | None = None) -> str:
        """Act on a target."""
        if died["once"]:
            died["once"] = False
            raise SimulatedCrash("died in the tool")
        return "done"

    agent = Agent("sampled", "Act.", [act])
    args: dict[str, Any] = {"target": "t1", **({"note": SECRET} if masked else {})}
    turns: list[Any] = [[("act", args)], "Done."]

    async def scenario(tmp: Path) -> None:
        async with opened("sqlite", tmp) as (stores, url):
            runner = crashing_runner(stores, turns)
            if approval:
                first = await runner.run(agent, "go", tenant=T, run_id="s")
                assert first.status is RunStatus.waiting_approval
                assert first.pending_approval is not None
                assert stores.approvals is not None
                await stores.approvals.decide(
                    T, first.pending_approval.id, approved=True, by="alice"
                )
                with pytest.raises(SimulatedCrash):
                    await runner.resume(agent, "s", tenant=T)
                await lapsed(stores, "s")
                await asyncio.sleep(CLAIM)  # the dead resumer's claim lapses
            else:
                await crash(stores, agent, turns, "s")
            refused = False
            try:
                await crashing_runner(stores, turns).resume(agent, "s", tenant=T)
            except IndeterminateToolCallError:
                refused = True
            cli_ids, console_ids = await both_stuck(stores, url)
            assert ("s" in cli_ids) is refused, (cli_ids, refused)
            assert ("s" in console_ids) is refused, (console_ids, refused)
            worker = Worker(
                crashing_runner(stores, turns), [agent], exit_when_idle=True, poll_interval=0.01
            )
            await asyncio.wait_for(worker.run(), 30)
            assert stores.work is not None
            parked = {i.run_id for i in await stores.work.items(T, state=WorkState.parked)}
            assert ("s" in await cli_stuck(url)) is ("s" in parked) is refused

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp)))


async def test_crashed_run_is_listed_only_once_its_lease_lapsed(tmp_path: Path) -> None:
    """A live lease: not listed (no worker may take it meanwhile); released or lapsed:
    listed, and ``show``/``inspect`` exit 0 naming the call in doubt. Held."""

    @tool
    def charge(amount: int) -> str:
        """Charge a card; the process dies inside it."""
        raise SimulatedCrash("died while charging")

    agent = Agent("charger", "Charge.", [charge])
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, [[("charge", {"amount": 5})], "x"], "live")
        # A holder carries the run now (a worker that took it over and is still sending).
        held = await stores.leases.acquire(T, "live", "worker-live", 60)
        assert "live" not in await cli_stuck(url)
        await stores.leases.release(held)
        assert "live" in await cli_stuck(url)
        await crash(stores, agent, [[("charge", {"amount": 5})], "x"], "dead")
        assert await both_stuck(stores, url) == ({"live", "dead"}, {"live", "dead"})
        code, text = await cli(url, "inspect", "dead", "--tenant", T)
        assert code == 0 and "indeterminate" in text, text
        code, text = await cli(url, "show", "dead", "--tenant", T)
        assert code == 0 and "in_flight" in text, text


async def test_parked_unkeyed_run_is_listed_after_a_worker(tmp_path: Path) -> None:
    """The unkeyed run of the first defect, once a worker parked it: listed. Held."""
    agent = unkeyed_agent()
    async with opened("sqlite", tmp_path) as (stores, url):
        await crash(stores, agent, [[("notify", {"message": "hi"})], "Sent."], "unkeyed")
        worker = Worker(
            crashing_runner(stores, ["Sent."]), [agent], exit_when_idle=True, poll_interval=0.01
        )
        await asyncio.wait_for(worker.run(), 30)
        cli_ids, console_ids = await both_stuck(stores, url)
        assert "unkeyed" in cli_ids and "unkeyed" in console_ids


async def test_waiting_approval_is_not_stuck_and_worker_leaves_it(tmp_path: Path) -> None:
    """A run waiting on a pending approval is the approver's, not stuck; a worker leaves it
    waiting. Held."""

    @tool(requires_approval=True)
    def book(flight: str) -> str:
        """Book (needs approval)."""
        return "booked"

    agent = Agent("approver", "Book.", [book])
    async with opened("sqlite", tmp_path) as (stores, url):
        run = await crashing_runner(stores, [[("book", {"flight": "LH1"})], "x"]).run(
            agent, "go", tenant=T, run_id="wait"
        )
        assert run.status is RunStatus.waiting_approval
        await asyncio.wait_for(
            Worker(
                crashing_runner(stores, ["x"]), [agent], exit_when_idle=True, poll_interval=0.01
            ).run(),
            30,
        )
        assert await both_stuck(stores, url) == (set(), set())
