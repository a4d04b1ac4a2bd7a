"""Attacks by an on-call engineer at 3 a.m. on the operator's path end to end: a real
``tesserix`` CLI (``tesserix_adk.cli.main.main`` in process), real ``Worker``s and the
real console (Starlette TestClient), over a SQLite file, the test Redis and PostgreSQL.

Defects, found as strict xfails and fixed (markers removed): ``run --resume`` starts a run
submitted and parked before its first checkpoint (``cli/resuming.py``), ``inspect`` and
``show`` say so instead of promising a worker (``cli/reasons.py``), and ``resolve --call``
finds a call by the model's raw id under the id kept in its place, never echoing it
(``cli/commands.py``, ``screening.id_as_kept``). The held test that pinned the raw id's
refusal now pins that it is found.
- a submitted run parked (``too_many_attempts``) before its first frontier: ``inspect``,
  ``show`` and ``run --resume`` say "a running `tesserix worker` starts it", none does;
  ``run --resume`` is exit 1 and a second ``submit`` leaves it parked: only a cancel acts.
- ``resolve --call`` given the model's raw id (one holding a secret) says the run has "no
  call ... on record" (exit 1) without naming the ``call_masked_`` id it is recorded under.

Held: a call in doubt parked, listed by ``runs --stuck`` and the console's stuck filter,
resolved by the replaced id (CLI and console button), refused the second time (exit 4),
carried on once and unlisted; two operators approving at once (one decider named, one
call sent); approve and deny at once (one wins, the other exit 4); wrong request ids and
tenants (exit 1, one sentence); a cancel of a parked run in doubt (listed until resolved,
then not, never woken); ``run --resume`` of a run with a frontier parked for too many
attempts (finished, unlisted, not taken again).
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
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
    Backoff,
    Carried,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    Worker,
    tool,
)
from tesserix_adk.cli.main import main
from tesserix_adk.messages import Message, Role
from tesserix_adk.stores.urls import open_stores

T = "acme"
TTL = 0.5
FAST = Backoff(base=0.01, cap=0.02)
SECRET_ID = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"


class Died(BaseException):
    """A process killed inside a tool: nothing after it runs, nothing is given back."""


def _say(text: str) -> ModelResponse:
    return ModelResponse(message=Message(role=Role.assistant, content=text))


class BookModel:
    """Asks for one booking under ``call_id``, then answers with what it got."""

    def __init__(self, call_id: str = "c1") -> None:
        self.call_id = call_id

    async def complete(self, request: ModelRequest) -> ModelResponse:
        results = [m for m in request.messages if m.role is Role.tool]
        if results:
            return _say(f"done: {results[-1].content}")
        call = ToolCall(id=self.call_id, name="book", arguments={"flight": "LH400"})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


def _book_agent(sent: list[str], die: list[bool]) -> Agent:
    @tool
    async def book(flight: str) -> dict[str, str]:
        """Book a seat (side-effecting, keyed)."""
        if die and die.pop():
            raise Died
        sent.append(flight)
        return {"booking": f"BK-{flight}"}

    return Agent("booker", "Book.", [book])


def _runner(stores: Any, model: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        model,
        stores,
        lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
        resume_claim_ttl=TTL,
        never_ran_margin=0.05,
    )


@asynccontextmanager
async def _site(backend: str, tmp: Path) -> AsyncIterator[tuple[str, Any]]:
    async with backend_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield url, stores


def cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix ARGV --store URL`` in this process (its own event loop, in a thread)."""
    import contextlib
    import io
    import threading

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
    return await asyncio.to_thread(cli, url, *argv)


_TESSERIX = Path(sys.executable).with_name("tesserix")


async def proc(url: str, *argv: str) -> tuple[int, str, str]:
    """The ``tesserix`` entry point as a subprocess (two of them may run at once)."""
    child = await asyncio.create_subprocess_exec(
        str(_TESSERIX),
        *argv,
        "--store",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode is not None
    return child.returncode, out.decode(), err.decode()


def _one_sentence(err: str) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert "Traceback" not in err


async def _stuck(url: str) -> list[dict[str, Any]]:
    code, out, err = await acli(url, "runs", "--tenant", T, "--stuck", "--json")
    assert code == 0, err
    return json.loads(out)["runs"]


async def _in_doubt(stores: Any, call_id: str = "c1") -> tuple[list[str], Agent]:
    """A run whose carrier died inside its one keyed call; its lease lapsed."""
    sent: list[str] = []
    agent = _book_agent(sent, [True])
    runner = _runner(stores, BookModel(call_id))
    with pytest.raises(Died):
        await runner.run(agent, "book LH400", tenant=T, run_id="r")
    await asyncio.sleep(TTL + 0.2)
    assert await stores.leases.current(T, "r") is None
    return sent, agent


async def _worker_once(stores: Any, agent: Agent, model: Any) -> Worker:
    worker = Worker(
        _runner(stores, model), [agent], exit_when_idle=True, poll_interval=0.01, backoff=FAST
    )
    await asyncio.wait_for(worker.run(), 30)
    return worker


# --- a call in doubt: parked, paged, resolved with the id `show` prints, carried on -------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_parked_in_doubt_resolved_by_the_shown_id_is_carried_and_unpaged(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (url, stores):
        sent, agent = await _in_doubt(stores, SECRET_ID)
        first = await _worker_once(stores, agent, BookModel(SECRET_ID))
        assert [h for _, h in first.carried] == [Carried.parked]
        stuck = await _stuck(url)
        assert [r["run_id"] for r in stuck] == ["r"] and stuck[0]["parked"]
        code, out, err = await acli(url, "show", "r", "--tenant", T, "--json")
        assert code == 0, err
        assert "sk-proj" not in out
        shown = json.loads(out)
        ids = {c["call_id"] for c in _calls(shown)}
        assert len(ids) == 1 and next(iter(ids)).startswith("call_masked_"), ids
        (masked,) = ids
        # The raw id (from the tool's own logs) finds the call under the id kept in its
        # place, and is never echoed.
        code, out, err = await acli(
            url,
            "resolve",
            "r",
            "--tenant",
            T,
            "--call",
            SECRET_ID,
            "--outcome",
            '{"booking": "BK-LH400"}',
            "--by",
            "ops",
        )
        assert code == 0, err
        assert "a worker carries the run on" in out, out
        assert "sk-proj" not in out + err
        # Twice: refused as already settled, exit 4, nothing more recorded.
        code, _out2, err = await acli(
            url,
            "resolve",
            "r",
            "--tenant",
            T,
            "--call",
            masked,
            "--outcome",
            '{"booking": "BK-OTHER"}',
            "--by",
            "bob",
        )
        assert code == 4 and "not in flight" in err, (code, err)
        _one_sentence(err)
        second = await _worker_once(stores, agent, BookModel(SECRET_ID))
        assert [h for _, h in second.carried] == [Carried.finished]
        assert sent == []  # the resolved outcome replayed, never sent again
        assert await _stuck(url) == []
        code, out, err = await acli(url, "show", "r", "--tenant", T, "--json")
        assert json.loads(out)["status"] == "completed"


def _calls(shown: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "call_id" in x and "tool" in x:
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(shown)
    return found


async def test_resolve_with_the_raw_secret_id_names_the_id_it_is_recorded_under(
    tmp_path: Path,
) -> None:
    async with _site("sqlite", tmp_path) as (url, stores):
        await _in_doubt(stores, SECRET_ID)
        code, out, err = await acli(url, "inspect", "r", "--tenant", T, "--json")
        (masked,) = {c["call_id"] for c in _calls(json.loads(out))}
        code, out, err = await acli(
            url,
            "resolve",
            "r",
            "--tenant",
            T,
            "--call",
            SECRET_ID,
            "--never-ran",
            "--by",
            "ops",
            "--margin",
            "0",
        )
        # The call is on record: either it is found, or the sentence says under which id.
        assert code == 0 or masked in err, (code, err)
        if code:
            _one_sentence(err)


# --- approvals: twice, from two operators at once, the wrong id, after a cancel ----------


class PayModel:
    """Asks for one approved payment, then answers."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if any(m.role is Role.tool for m in request.messages):
            return _say("paid")
        call = ToolCall(id="p1", name="pay", arguments={"amount": 5})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


def _pay_agent(sent: list[int]) -> Agent:
    @tool(requires_approval=True)
    async def pay(amount: int) -> dict[str, int]:
        """Pay an amount (needs a person's approval)."""
        sent.append(amount)
        return {"paid": amount}

    return Agent("payer", "Pay.", [pay])


async def _waiting(url: str, stores: Any) -> tuple[list[int], Agent, str]:
    """A run submitted and taken by a worker, now waiting on a person; its request id."""
    sent: list[int] = []
    agent = _pay_agent(sent)
    await _runner(stores, PayModel()).submit(agent, "pay 5", tenant=T, run_id="r")
    worker = await _worker_once(stores, agent, PayModel())
    assert [h for _, h in worker.carried] == [Carried.waiting]
    code, out, err = await acli(url, "inspect", "r", "--tenant", T, "--json")
    assert code == 0, err
    request = json.loads(out)["approval"]["id"]
    return sent, agent, request


@pytest.mark.parametrize("backend", BACKENDS)
async def test_two_operators_approving_at_once_send_the_call_once(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (url, stores):
        sent, agent, request = await _waiting(url, stores)
        assert await _stuck(url) == []  # waiting on a person is not a page
        # Wrong ids first: the run id instead of the request, another tenant.
        code, _out, err = await acli(url, "approve", "r", "--tenant", T, "--by", "ops")
        assert code == 1, (code, err)
        _one_sentence(err)
        code, _out, err = await acli(url, "approve", request, "--tenant", "other", "--by", "ops")
        assert code == 1, (code, err)
        _one_sentence(err)
        got = await asyncio.gather(
            proc(url, "approve", request, "--tenant", T, "--by", "alice", "--json"),
            proc(url, "approve", request, "--tenant", T, "--by", "bob", "--json"),
        )
        assert [g[0] for g in got] == [0, 0], got
        deciders = {json.loads(g[1])["by"] for g in got}
        assert len(deciders) == 1, f"two operators each told they decided: {deciders}"
        worker = await _worker_once(stores, agent, PayModel())
        assert [h for _, h in worker.carried] == [Carried.finished]
        assert sent == [5]
        # A deny after the approve conflicts: exit 4, one sentence.
        code, _out, err = await acli(url, "approve", request, "--tenant", T, "--by", "c", "--deny")
        assert code == 4, (code, err)
        _one_sentence(err)
        assert await _stuck(url) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_approve_and_deny_at_once_one_wins_and_the_other_is_refused(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (url, stores):
        sent, agent, request = await _waiting(url, stores)
        got = await asyncio.gather(
            proc(url, "approve", request, "--tenant", T, "--by", "alice"),
            proc(url, "approve", request, "--tenant", T, "--by", "bob", "--deny"),
        )
        codes = sorted(g[0] for g in got)
        assert codes == [0, 4], got
        won = next(g for g in got if g[0] == 0)
        worker = await _worker_once(stores, agent, PayModel())
        assert [h for _, h in worker.carried] == [Carried.finished]
        assert sent == ([5] if "approved" in won[1] else []), (won, sent)


# --- cancel and resume of parked runs -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancelling_a_parked_run_in_doubt_keeps_the_page_until_resolved(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (url, stores):
        sent, agent = await _in_doubt(stores)
        await _worker_once(stores, agent, BookModel())
        code, out, err = await acli(url, "cancel", "r", "--tenant", T, "--by", "ops", "--json")
        assert code == 0, err
        assert json.loads(out)["state"] == "cancelled", out
        code, out, err = await acli(url, "cancel", "r", "--tenant", T, "--by", "bob", "--json")
        assert code == 0 and json.loads(out)["by"] == "ops", (out, err)
        stuck = await _stuck(url)
        assert [(r["run_id"], r["status"], r["in_flight"]) for r in stuck] == [
            ("r", "cancelled", 1)
        ], stuck
        code, out, err = await acli(
            url,
            "resolve",
            "r",
            "--tenant",
            T,
            "--call",
            "c1",
            "--never-ran",
            "--by",
            "ops",
            "--margin",
            "0",
        )
        assert code == 0, err
        assert "a worker carries" not in out, out  # it ended: nothing carries it on
        assert await _stuck(url) == []
        worker = await _worker_once(stores, agent, BookModel())
        assert worker.carried == [] and sent == []


class DiesAfterTheTool(BookModel):
    """Asks for the booking, then dies as the model is asked again (a frontier written)."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if any(m.role is Role.tool for m in request.messages):
            raise Died
        return await super().complete(request)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_resuming_a_run_parked_for_too_many_attempts_clears_the_page(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (url, stores):
        name = f"night_booker_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(BOOK_MODULE)
        sent: list[str] = []
        agent = _book_agent(sent, [])
        with pytest.raises(Died):
            await _runner(stores, DiesAfterTheTool()).run(agent, "book", tenant=T, run_id="r")
        await asyncio.sleep(TTL + 0.2)
        await stores.work.want(T, "r", agent=agent.name, count=2)  # two takes died too
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
        assert [r["run_id"] for r in await _stuck(url)] == ["r"]
        code, out, err = await acli(
            url,
            "run",
            "--resume",
            "r",
            "--tenant",
            T,
            "--agent",
            f"{tmp_path / name}.py:agent",
            "--json",
        )
        assert code == 0, err
        assert json.loads(out)["status"] == "completed", out
        assert sent == ["LH400"]
        assert await _stuck(url) == []
        again = await _worker_once(stores, agent, BookModel())
        assert again.carried == [] and sent == ["LH400"]


BOOK_MODULE = '''
from tesserix_adk import Agent, ModelResponse, ToolCall, tool
from tesserix_adk.messages import Message, Role


@tool
async def book(flight: str) -> dict:
    """Book a seat (side-effecting, keyed)."""
    return {"booking": "BK-" + flight}


class BookModel:
    async def complete(self, request):
        if any(m.role is Role.tool for m in request.messages):
            return ModelResponse(message=Message(role=Role.assistant, content="booked"))
        call = ToolCall(id="c1", name="book", arguments={"flight": "LH400"})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


agent = Agent("booker", "Book.", [book])
PROVIDER = BookModel()
'''


async def _parked_before_start(url: str, stores: Any, tmp: Path) -> tuple[Agent, str]:
    """A submitted run two dead takes counted, parked before its first frontier."""
    name = f"night_booker_{uuid.uuid4().hex[:12]}"
    (tmp / f"{name}.py").write_text(BOOK_MODULE)
    agent = _book_agent([], [])
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
    assert [r["run_id"] for r in await _stuck(url)] == ["r"]
    return agent, f"{tmp / name}.py:agent"


@pytest.mark.parametrize("command", ["inspect", "show"])
async def test_a_run_parked_before_it_started_is_not_said_to_be_started_by_a_worker(
    command: str, tmp_path: Path
) -> None:
    async with _site("sqlite", tmp_path) as (url, stores):
        agent, _ = await _parked_before_start(url, stores, tmp_path)
        _code, _out, err = await acli(url, command, "r", "--tenant", T)
        _one_sentence(err)
        again = await _worker_once(stores, agent, BookModel())
        assert again.carried == []  # what the sentence promises does not happen...
        assert "worker` starts it" not in err, err  # ...so it must not be promised


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_operator_can_carry_on_a_run_parked_before_it_started(
    backend: str, tmp_path: Path
) -> None:
    async with _site(backend, tmp_path) as (url, stores):
        agent, module = await _parked_before_start(url, stores, tmp_path)
        code, _out, err = await acli(url, "run", "--resume", "r", "--tenant", T, "--agent", module)
        code2, _out2, err2 = await acli(
            url, "submit", "--agent", module, "--tenant", T, "--input", "book", "--run-id", "r"
        )
        assert code2 == 0, err2
        worker = await _worker_once(stores, agent, BookModel())
        finished = code == 0 or [h for _, h in worker.carried] == [Carried.finished]
        assert finished, (
            f"resume: {code} {err.strip()!r}; a second submit then a worker: {worker.carried}; "
            f"still listed stuck: {[r['parked'] for r in await _stuck(url)]}"
        )


# --- the console: the page before and after, a resolve button with the shown id ------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_console_pages_the_parked_run_and_its_resolve_is_carried(
    backend: str, tmp_path: Path
) -> None:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    base = "http://127.0.0.1:8765"
    async with _site(backend, tmp_path) as (url, stores):
        sent, agent = await _in_doubt(stores, SECRET_ID)
        await _worker_once(stores, agent, BookModel(SECRET_ID))
        _code, out, _err = await acli(url, "inspect", "r", "--tenant", T, "--json")
        (masked,) = {c["call_id"] for c in _calls(json.loads(out))}

        def browse() -> tuple[str, str, str]:
            with TestClient(create_app(url), base_url=base) as client:
                before = client.get(f"/t/{T}/runs", params={"stuck": "1"}).text
                client.get(f"/t/{T}/runs/r")
                csrf = client.cookies.get("tesserix_csrf")
                done = client.post(
                    f"/t/{T}/runs/r/resolve",
                    data={
                        "csrf": csrf,
                        "call": masked,
                        "by": "ops",
                        "what": "outcome",
                        "outcome": '{"booking": "BK-LH400"}',
                    },
                    headers={"origin": base},
                    follow_redirects=True,
                )
                return before, done.text, str(done.status_code)

        before, said, status = await asyncio.to_thread(browse)
        assert ">r</a>" in before, before[-2000:]
        assert "sk-proj" not in before and "sk-proj" not in said
        assert status == "200" and "recorded" in said, said[-2000:]
        worker = await _worker_once(stores, agent, BookModel(SECRET_ID))
        assert [h for _, h in worker.carried] == [Carried.finished] and sent == []

        def after() -> str:
            with TestClient(create_app(url), base_url=base) as client:
                return client.get(f"/t/{T}/runs", params={"stuck": "1"}).text

        assert ">r</a>" not in await asyncio.to_thread(after)
