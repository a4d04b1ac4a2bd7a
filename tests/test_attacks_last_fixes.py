"""Attacks on the last three commits: ``tesserix run --resume`` starting a run submitted and
parked before its first checkpoint (``cli/resuming.py``), the worker's too-many park on the
entry as it stands (``worker_parking.py``), and the Temporal translation of kit errors.

Four defects were found as strict xfails and are fixed (markers removed): the start ran
the submission with whatever agent ``--agent`` named (now refused, exit 2, nothing sent);
a second operator was told "a worker starts it" while the first held the start (now exit 3,
held); a run cancelled before it started was promised to a worker (now said cancelled);
and ``--json`` gave no fence for a start (now the lease's fence; a start names no holder,
as the README says: the attacker's test asked for one, and is changed to that design).
What held passes."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from cli.test_attacks_operator_night import _one_sentence, acli, proc
from processes import store_url as backend_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    Carried,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    Worker,
    tool,
)
from tesserix_adk.messages import Message, Role
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.stores.urls import open_stores

T = "acme"
TTL = 0.5
FAST = Backoff(base=0.01, cap=0.02)


class Died(BaseException):
    """A process killed inside a tool: nothing after it runs, nothing is given back."""


class BookModel:
    """Asks for one booking, then answers with what it got."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if any(m.role is Role.tool for m in request.messages):
            return ModelResponse(message=Message(role=Role.assistant, content="booked"))
        call = ToolCall(id="c1", name="book", arguments={"flight": "LH400"})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


def _agent(name: str, sent: list[str], die: list[bool] | None = None) -> Agent:
    @tool
    async def book(flight: str) -> dict[str, str]:
        """Book a seat (side-effecting, keyed)."""
        if die and die.pop():
            raise Died
        sent.append(flight)
        return {"booking": f"BK-{flight}"}

    return Agent(name, "Book.", [book])


MODULE = '''
from pathlib import Path

from tesserix_adk import Agent, ModelResponse, ToolCall, tool
from tesserix_adk.messages import Message, Role

SENT = Path({sent!r})


@tool
async def book(flight: str) -> dict:
    """Book a seat (side-effecting, keyed)."""
    with SENT.open("a") as f:
        f.write({name!r} + ":" + flight + "\\n")
    return {{"booking": "BK-" + flight}}


class BookModel:
    async def complete(self, request):
        import asyncio

        await asyncio.sleep({slow!r})
        if {fail!r}:
            key = "sk-proj-AbCdEfGhIjKlMnOp" + "QrStUvWxYz0123456789abcd"
            raise RuntimeError("the model is down, key " + key)
        if any(m.role is Role.tool for m in request.messages):
            return ModelResponse(message=Message(role=Role.assistant, content="booked"))
        call = ToolCall(id="c1", name="book", arguments={{"flight": "LH400"}})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


agent = Agent({name!r}, "Book.", [book])
PROVIDER = BookModel()
'''


def _module(tmp: Path, name: str, *, fail: bool = False, slow: float = 0.0) -> tuple[str, Path]:
    """An agent module for ``--agent``; its tool appends to a file (seen across threads)."""
    mod = f"lastfix_{uuid.uuid4().hex[:12]}"
    sent = tmp / f"{mod}.sent"
    sent.write_text("")
    (tmp / f"{mod}.py").write_text(MODULE.format(sent=str(sent), name=name, fail=fail, slow=slow))
    return f"{tmp / mod}.py:agent", sent


def _runner(stores: Any, model: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        model,
        stores,
        lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
        resume_claim_ttl=TTL,
        never_ran_margin=0.05,
    )


@asynccontextmanager
async def _site(tmp: Path, backend: str = "sqlite") -> AsyncIterator[tuple[str, Any]]:
    async with backend_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield url, stores


async def _parked_before_start(stores: Any, name: str = "booker") -> Agent:
    """A submitted run two dead takes counted, parked (too many) before its first frontier."""
    agent = _agent(name, [])
    await _runner(stores, BookModel()).submit(agent, "book", tenant=T, run_id="r")
    await stores.work.want(T, "r", agent=agent.name, count=2)
    worker = Worker(
        _runner(stores, BookModel()),
        [agent],
        max_attempts=2,
        exit_when_idle=True,
        poll_interval=0.01,
        backoff=FAST,
    )
    await asyncio.wait_for(worker.run(), 30)
    assert [h for _, h in worker.carried] == [Carried.parked]
    (item,) = await stores.work.items(T, state=WorkState.parked)
    assert item.run_id == "r"
    return agent


def _sent(path: Path) -> list[str]:
    return path.read_text().splitlines()


# --- 1. run --resume starts a run parked before its first checkpoint -----------------------


async def test_start_refuses_an_agent_other_than_the_one_submitted(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores, "booker")
        other, sent = _module(tmp_path, "mailer")  # another agent, with its own tools
        code, _out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", other)
        assert _sent(sent) == [], "the other agent's side-effecting tool was sent"
        assert code != 0
        _one_sentence(err)
        assert await stores.checkpoints.latest(T, "r") is None


async def test_start_json_reports_the_lease_it_took(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker")
        code, out, err = await acli(
            url, "run", "--resume", "r", "--tenant", T, "--agent", module, "--json"
        )
        assert code == 0, err
        shown = json.loads(out)
        assert shown["status"] == "completed" and shown["carried_on"] is True
        assert _sent(sent) == ["booker:LH400"]
        # The lease's fence; a start names no holder (``runner.run`` reports none), and
        # the README says so.
        assert shown["fence"] is not None and shown["holder"] is None, shown


async def test_start_then_the_entry_is_done_and_not_listed_stuck(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        agent = await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker")
        code, out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", module)
        assert code == 0, err
        assert "now completed" in out
        assert _sent(sent) == ["booker:LH400"]
        assert await stores.work.items(T) == []
        code, out, err = await acli(url, "runs", "--tenant", T, "--stuck", "--json")
        assert code == 0, err and json.loads(out)["runs"] == []
        # A worker finds nothing to do, and a second run --resume only describes it.
        worker = Worker(
            _runner(stores, BookModel()), [agent], exit_when_idle=True, poll_interval=0.01
        )
        await asyncio.wait_for(worker.run(), 30)
        assert worker.carried == []
        code, out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", module)
        assert code == 0 and "nothing was done" in out, (code, out, err)
        assert _sent(sent) == ["booker:LH400"]


async def test_two_operators_starting_it_at_once_send_once(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker")
        argv = ("run", "--resume", "r", "--tenant", T, "--agent", module)
        # Two processes: redirect_stderr in two threads at once would mix their outputs.
        got = await asyncio.gather(proc(url, *argv), proc(url, *argv))
        assert _sent(sent) == ["booker:LH400"]
        for code, _out, err in got:
            assert code in (0, 1, 3), (code, err)
            if code:
                _one_sentence(err)
        assert 0 in [c for c, _, _ in got]
        assert await stores.work.items(T) == []


async def test_second_operator_while_the_first_holds_the_start_is_told_held(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker", slow=1.0)
        argv = ("run", "--resume", "r", "--tenant", T, "--agent", module)
        first = asyncio.ensure_future(acli(url, *argv))
        for _ in range(200):
            if await stores.leases.current(T, "r") is not None:
                break
            await asyncio.sleep(0.01)
        assert await stores.leases.current(T, "r") is not None
        code, _out, err = await acli(url, *argv)
        code1, _out1, err1 = await first
        assert code1 == 0, err1
        assert _sent(sent) == ["booker:LH400"]
        _one_sentence(err)
        assert code == 3, (code, err)


async def test_cancelled_meanwhile_is_not_started(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker")
        code, _out, err = await acli(url, "cancel", "r", "--tenant", T, "--by", "ops")
        assert code == 0, err
        code, _out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", module)
        assert code != 0
        _one_sentence(err)
        assert _sent(sent) == []
        assert await stores.checkpoints.latest(T, "r") is None


async def test_cancelled_before_start_is_not_promised_to_a_worker(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        agent = await _parked_before_start(stores)
        module, _sent_path = _module(tmp_path, "booker")
        code, _out, err = await acli(url, "cancel", "r", "--tenant", T, "--by", "ops")
        assert code == 0, err
        code, _out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", module)
        _one_sentence(err)
        worker = Worker(
            _runner(stores, BookModel()), [agent], exit_when_idle=True, poll_interval=0.01
        )
        await asyncio.wait_for(worker.run(), 30)
        assert worker.carried == []  # no worker starts it...
        assert "worker` starts it" not in err, err  # ...so it must not be said


async def test_cancel_racing_the_start_ends_it_cancelled_sending_nothing(tmp_path: Path) -> None:
    """The operator read it parked; a cancel lands before the start takes the lease."""
    from tesserix_adk.cli import resuming

    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker")
        real = resuming.parked_item

        async def then_cancelled(s: Any, tenant: str, run_id: str) -> Any:
            found = await real(s, tenant, run_id)
            await _runner(s, BookModel()).cancel(run_id, tenant=tenant, by="ops")
            return found

        resuming.parked_item = then_cancelled  # type: ignore[assignment]
        try:
            code, out, err = await acli(
                url, "run", "--resume", "r", "--tenant", T, "--agent", module
            )
        finally:
            resuming.parked_item = real  # type: ignore[assignment]
        assert _sent(sent) == []
        assert code == 0 and "now cancelled" in out, (code, out, err)
        assert await stores.work.items(T) == []


async def test_a_start_that_fails_at_once_is_one_redacted_sentence_and_kept(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker", fail=True)
        code, out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", module)
        assert "Traceback" not in err + out
        assert code == 4, (code, out, err)
        assert _sent(sent) == []
        _one_sentence(err)
        assert "sk-proj" not in err + out, err
        # Not forgotten: back in the workers' hands (as a resume from parked leaves it).
        (item,) = await stores.work.items(T)
        assert item.run_id == "r" and item.state in (WorkState.wanted, WorkState.parked)


async def test_accept_revision_on_a_parked_submission_is_one_sentence(tmp_path: Path) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_before_start(stores)
        module, sent = _module(tmp_path, "booker")
        code, _out, err = await acli(
            url, "run", "--resume", "r", "--tenant", T, "--agent", module,
            "--accept-revision", "--by", "ops",
        )  # fmt: skip
        assert code == 1, (code, err)
        _one_sentence(err)
        assert _sent(sent) == []
        (item,) = await stores.work.items(T, state=WorkState.parked)
        assert item.run_id == "r"


class DyingModel:
    """Every take dies asking the model: the "process" goes, its lease lapses."""

    asked = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        DyingModel.asked += 1
        raise Died


# --- 2. a poison run (every take dies) is parked, several workers polling -----------------


async def test_a_poison_run_is_parked_with_several_workers(tmp_path: Path) -> None:
    async with _site(tmp_path) as (_url, stores):
        sent: list[str] = []
        agent = _agent("booker", sent)
        await _runner(stores, BookModel()).submit(agent, "book", tenant=T, run_id="r")
        DyingModel.asked = 0
        for _ in range(12):
            workers = [
                Worker(
                    _runner(stores, DyingModel()),
                    [agent],
                    max_attempts=3,
                    exit_when_idle=True,
                    poll_interval=0.01,
                    backoff=FAST,
                )
                for _ in range(3)
            ]
            got = await asyncio.gather(
                *(asyncio.wait_for(w.run(), 30) for w in workers), return_exceptions=True
            )
            assert not [g for g in got if isinstance(g, Exception)], got
            if await stores.work.items(T, state=WorkState.parked):
                break
            await asyncio.sleep(TTL + 0.1)  # the dead take's lease lapses
        parked = await stores.work.items(T, state=WorkState.parked)
        assert [i.run_id for i in parked] == ["r"], await stores.work.items(T)
        assert DyingModel.asked == 3, DyingModel.asked  # max_attempts takes, no more
        assert sent == []


async def test_a_poison_run_is_parked_with_workers_polling_all_along(tmp_path: Path) -> None:
    """Three workers poll the whole time while each take dies (its lease left to lapse)."""
    async with _site(tmp_path) as (_url, stores):
        agent = _agent("booker", [])
        await _runner(stores, BookModel()).submit(agent, "book", tenant=T, run_id="r")
        DyingModel.asked = 0
        workers = [
            Worker(
                _runner(stores, DyingModel()),
                [agent],
                max_attempts=3,
                poll_interval=0.02,
                backoff=FAST,
            )
            for _ in range(3)
        ]
        running = [asyncio.ensure_future(w.run()) for w in workers]
        try:
            for _ in range(300):  # up to about 15 s; a few lease ttls suffice
                if await stores.work.items(T, state=WorkState.parked):
                    break
                await asyncio.sleep(0.05)
        finally:
            for w in workers:
                w.drain()
            await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
        parked = await stores.work.items(T, state=WorkState.parked)
        assert [i.run_id for i in parked] == ["r"], await stores.work.items(T)
        assert "taken 3 times" in (parked[0].reason or ""), parked[0].reason
        assert DyingModel.asked == 3, DyingModel.asked
