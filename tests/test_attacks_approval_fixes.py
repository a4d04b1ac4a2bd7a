"""An attack on the approval fixes of 9994f88: the Redis request completing its own
dangling id pointer (and its script never making a request pending again), and
``take_decision`` refusing a request row of another run or turn, or one that is gone.

The oracle: a decision a person made stands and is acted on once, by the run it was made
for; a stale attempt never resets it, never deletes it from under the run, never sends on
it; a damaged or gone request is refused as damage (exit 4, one sentence) and nothing is
sent. Tests marked ``xfail(strict=True)`` are defects of the code they were written against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    tool,
)
from tesserix_adk.cli import ExitCode, frontier_main, resume_main
from tesserix_adk.cli.failures import exit_code_for
from tesserix_adk.errors import AdkError, CheckpointCorruptError, StaleFenceError
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import ApprovalStatus, WorkState
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker import Worker

T = "acme"
LH1 = [ToolCall(id="c1", name="book", arguments={"flight": "LH1"})]
BOOK_LH1: list[Any] = [[("book", {"flight": "LH1"})], "done"]


class Airline:
    """The outside world: every real dispatch, with the exact arguments it got."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def agent(self) -> Agent:
        airline = self

        @tool(requires_approval=True)
        def book(flight: str, ctx: ToolContext) -> dict[str, str]:
            """Book one seat (needs a person)."""
            airline.sent.append(("book", {"flight": flight}))
            return {"booking": f"BK-{flight}"}

        return Agent("booking", "Book.", [book])


def _runner(stores: Stores, turns: list[Any], ttl: float = 5.0) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns)),
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2.5),
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
    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _cli_resume(url: str, airline: Airline, run_id: str = "r") -> tuple[int, str, str]:
    """``tesserix run --resume`` in-process against ``url`` (a thread of its own)."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = resume_main(
            ["run", "--resume", run_id, "--tenant", T, "--agent", "booking"],
            stores=open_stores(url),
            agents={"booking": airline.agent()},
            provider=ScriptedProvider(list(BOOK_LH1)),
            out=out,
            err=err,
        )
        return code, out.getvalue(), err.getvalue()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _one_sentence(err: str) -> bool:
    return "Traceback" not in err and err.strip().count("\n") == 0 and err.strip() != ""


# --- 1. Redis: a stale attempt racing a fresh one under the same id ----------------------


@pytest.mark.redis
@pytest.mark.parametrize("pointer", ["set by the stale attempt", "left by a dead attempt"])
async def test_a_stale_attempt_refused_never_unhooks_the_fresh_attempts_decided_request(
    tmp_path: Path, pointer: str
) -> None:
    """Attempt A (fence 1) asks under the turn's id; before its script reaches the server,
    attempt B (fence 2, the run's new holder) asks under the same id and writes the
    request, and the operator approves it. A's script is then refused as stale: the
    operator's approval must still be found under its id."""
    async with (
        store_url("redis", tmp_path) as url,
        _opened(url) as old,
        _opened(url) as new,
    ):
        rid = "req-race"
        if pointer == "left by a dead attempt":
            # An attempt died between the SET NX and the script.
            store = old.approvals
            await store._client.set(  # type: ignore[attr-defined]
                store._keys.approval_index(rid),  # type: ignore[attr-defined]
                store._keys.tag(T, "r"),  # type: ignore[attr-defined]
            )
        script = old.approvals._request  # type: ignore[attr-defined]

        async def fresh_attempt_first(*args: Any, **kwargs: Any) -> Any:
            made = await new.approvals.request(T, "r", LH1, iteration=0, fence=2, id=rid)
            assert made.status is ApprovalStatus.pending
            await new.approvals.decide(T, rid, approved=True, by="alice")
            return await script(*args, **kwargs)

        old.approvals._request = fresh_attempt_first  # type: ignore[attr-defined]
        with pytest.raises(StaleFenceError):
            await old.approvals.request(T, "r", LH1, iteration=0, fence=1, id=rid)
        found = await new.approvals.get(T, rid)
        assert found is not None, "the operator's approval is no longer found under its id"
        assert found.status is ApprovalStatus.approved and found.by == "alice"


# --- 2. the asking path takes a row of another run ----------------------------------------


async def _asked_then_died(url: str, airline: Airline, run_id: str) -> str:
    """The run records its request and dies before its ``before_approval`` frontier."""
    async with _opened(url) as stores:
        asked: list[str] = []
        ask = stores.approvals.request

        async def ask_then_die(*args: Any, **kwargs: Any) -> Any:
            made = await ask(*args, **kwargs)
            asked.append(made.id)
            raise SimulatedCrash("died before the before_approval frontier")

        stores.approvals.request = ask_then_die  # type: ignore[method-assign]
        with pytest.raises(SimulatedCrash):
            await _runner(stores, BOOK_LH1, ttl=0.5).run(
                airline.agent(), "go", tenant=T, run_id=run_id
            )
    [made] = asked
    return made


async def _waiting(url: str, airline: Airline, run_id: str) -> str:
    async with _opened(url) as stores:
        run = await _runner(stores, BOOK_LH1).run(airline.agent(), "go", tenant=T, run_id=run_id)
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    return run.pending_approval.id


async def test_a_run_asking_again_never_acts_on_another_runs_row_under_its_id(
    tmp_path: Path,
) -> None:
    """Run a records its request and dies before its frontier names it; run b waits on the
    same call. The operator denies a and approves b; the two rows are then swapped in the
    store. Run a, resumed, asks again under its id and finds b's approved row there: it
    must refuse it as damage, as ``take_decision`` does, and send nothing."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    req_a = await _asked_then_died(url, airline, "a")
    req_b = await _waiting(url, airline, "b")
    assert _cli(url, "approve", req_a, "--tenant", T, "--by", "alice", "--deny")[0] == 0
    assert _cli(url, "approve", req_b, "--tenant", T, "--by", "alice")[0] == 0
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        db.execute("UPDATE adk_approvals SET id = 'swap' WHERE id = ?", (req_a,))
        db.execute("UPDATE adk_approvals SET id = ? WHERE id = ?", (req_a, req_b))
        db.execute("UPDATE adk_approvals SET id = ? WHERE id = 'swap'", (req_b,))
        db.commit()
    await asyncio.sleep(0.7)  # a's lease lapses
    async with _opened(url) as stores:
        try:
            outcome: Any = await _runner(stores, BOOK_LH1).resume(airline.agent(), "a", tenant=T)
        except AdkError as exc:
            outcome = exc
    assert airline.sent == [], "run a, denied by the operator, sent on run b's approval"
    assert isinstance(outcome, CheckpointCorruptError), outcome


# --- 3. a request gone from under a waiting run (Redis): CLI, worker -----------------------


async def _gone_on_redis(url: str, airline: Airline, *, cli: bool = False) -> str:
    """Run r waits; the operator approves; the request's hash is then lost (its id pointer
    stays): a store restored apart from the checkpoints, or a key evicted."""
    async with _opened(url) as stores:
        run = await _runner(stores, BOOK_LH1).run(airline.agent(), "go", tenant=T, run_id="r")
        assert run.pending_approval is not None
        rid = run.pending_approval.id
        if cli:
            assert _cli(url, "approve", rid, "--tenant", T, "--by", "alice")[0] == 0
        else:
            await stores.approvals.decide(T, rid, approved=True, by="alice")
        store = stores.approvals
        tag = store._keys.tag(T, "r")  # type: ignore[attr-defined]
        assert await store._client.delete(store._request_key(tag, rid)) == 1  # type: ignore[attr-defined]
    return rid


@pytest.mark.redis
async def test_a_gone_redis_request_is_exit_4_in_one_sentence_and_sends_nothing(
    tmp_path: Path,
) -> None:
    airline = Airline()
    async with store_url("redis", tmp_path) as url:
        rid = await _gone_on_redis(url, airline)
        code, _, err = _cli_resume(url, airline)
        assert code == ExitCode.MUST_NOT_CARRY_ON, (code, err)
        assert _one_sentence(err) and rid in err, err
        async with _opened(url) as stores:
            with pytest.raises(CheckpointCorruptError) as refused:
                await _runner(stores, BOOK_LH1).resume(airline.agent(), "r", tenant=T)
        assert exit_code_for(refused.value) is ExitCode.MUST_NOT_CARRY_ON
    assert airline.sent == []


@pytest.mark.redis
async def test_a_worker_parks_a_run_whose_request_is_gone_naming_it_and_never_spins(
    tmp_path: Path,
) -> None:
    """The operator approves (waking the run for a worker), then the request is lost: the
    worker parks the run once, with a reason naming the request and that it is gone."""
    airline = Airline()
    async with store_url("redis", tmp_path) as url:
        rid = await _gone_on_redis(url, airline, cli=True)
        async with _opened(url) as stores:
            runner = AgentRunner.from_stores(
                ScriptedProvider(list(BOOK_LH1)),
                stores,
                lease_policy=LeasePolicy(ttl=5.0, renew_within=2.0),
                resume_claim_ttl=0.2,
            )
            worker = Worker(runner, [airline.agent()], exit_when_idle=True, poll_interval=0.01)
            await asyncio.wait_for(worker.run(), 20)
            assert stores.work is not None
            [item] = await stores.work.items(T)
    assert item.state is WorkState.parked, item
    assert item.reason is not None and rid in item.reason and "gone" in item.reason, item
    assert item.attempts <= 1, item
    assert airline.sent == []


@pytest.mark.redis
async def test_inspect_of_a_run_whose_request_is_gone_says_it_is_gone(tmp_path: Path) -> None:
    """``tesserix inspect`` is what an operator reads first: a run whose request is gone
    must not read as one merely waiting on a person (a resume refuses it, exit 4)."""
    airline = Airline()
    async with store_url("redis", tmp_path) as url:
        rid = await _gone_on_redis(url, airline)
        code, out, err = _cli(url, "inspect", "r", "--tenant", T)
    assert "Traceback" not in err
    assert rid in out + err and "gone" in (out + err), (code, out, err)


# --- 4. a pointer left by another tenant or another run (Redis) ---------------------------


@pytest.mark.redis
@pytest.mark.parametrize("owner", [("other", "r"), (T, "someone-else")])
async def test_a_pointer_of_another_tenant_or_run_is_refused_typed_and_sends_nothing(
    tmp_path: Path, owner: tuple[str, str]
) -> None:
    """Run r asked and died before its frontier; its request's id pointer now names another
    tenant's or another run's request (a store restored or merged apart): the resume must
    refuse in the kit's words (typed), never a raw ``ValueError``, and send nothing."""
    airline = Airline()
    async with store_url("redis", tmp_path) as url:
        rid = await _asked_then_died(url, airline, "r")
        async with _opened(url) as stores:
            store = stores.approvals
            keys = store._keys  # type: ignore[attr-defined]
            await store._client.delete(store._request_key(keys.tag(T, "r"), rid))  # type: ignore[attr-defined]
            await store._client.set(keys.approval_index(rid), keys.tag(*owner))  # type: ignore[attr-defined]
        await asyncio.sleep(0.7)
        code, _, err = _cli_resume(url, airline)
    assert airline.sent == []
    assert code != ExitCode.CARRIED_ON and _one_sentence(err), (code, err)
    assert code == ExitCode.MUST_NOT_CARRY_ON, (code, err)


# --- 5. a stale attempt asking again under a decided id -----------------------------------


@pytest.mark.redis
async def test_a_stale_attempt_asking_under_a_decided_id_is_refused_stale(tmp_path: Path) -> None:
    """The run's new holder (fence 2) asked and the operator approved; the old holder
    (fence 1), paused until now, asks under the same id. Memory and SQLite refuse it as
    stale before they look; Redis returns the approval, which the old attempt then takes
    as its grant and goes on to dispatch with."""
    async with store_url("redis", tmp_path) as url, _opened(url) as stores:
        await stores.approvals.request(T, "r", LH1, iteration=0, fence=2, id="req-s")
        await stores.approvals.decide(T, "req-s", approved=True, by="alice")
        with pytest.raises(StaleFenceError):
            await stores.approvals.request(T, "r", LH1, iteration=0, fence=1, id="req-s")
        found = await stores.approvals.get(T, "req-s")
        assert found is not None and found.status is ApprovalStatus.approved


# --- 6. the console's page of a run whose request is gone ---------------------------------


async def test_the_console_run_page_names_a_gone_request(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app
    from tesserix_adk.console.pages import tenant_path

    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    rid = await _waiting(url, airline, "r")
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        db.execute("DELETE FROM adk_approvals WHERE id = ?", (rid,))
        db.commit()

    def page() -> tuple[int, str]:
        base = "http://127.0.0.1:8765"
        with TestClient(create_app(url), base_url=base, raise_server_exceptions=False) as c:
            got = c.get(tenant_path(T, "runs", "r"))
            return got.status_code, got.text

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        status, text = pool.submit(page).result()
    assert status == 200 and "Traceback" not in text
    assert rid in text and "gone" in text, "the run page says nothing of the gone request"
