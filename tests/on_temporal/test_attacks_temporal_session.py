"""An attacker's look at what this session changed in code the Temporal path shares: call
ids holding a secret replaced as the model's answer comes in (``run/screening.py``, also
called by ``temporal/steps.py``), a model's own ``call_masked_`` id replaced too, the
stale-attempt guard (``run/holding.py`` ``_told_while_held``), and calls named by their
place in a turn (``CallRef``/``ToolInput``/``ToolResult``). Each run is a real
``AgentWorkflow`` on the session's dev server with an in-process worker over SQLite; the
history is fetched with the Temporal client and searched raw, and so is every byte and row
of the SQLite file.

Defects, found as strict xfails and fixed (markers removed): ``_translated`` redacts a kit
error's text and drops its chain before it crosses into Temporal; ``submit`` says "held,
try again" (``ResumeConflictError``) while the run's lease is live instead of refusing its
calls in doubt; ``resolve --call`` finds a call by its raw secret id without echoing it.


1. (MEDIUM) ``test_a_secret_in_a_retryable_model_error_never_reaches_temporals_history``:
   ``activities._translated`` builds the ``ApplicationError`` from ``str(exc)`` unredacted
   (and chains the kit error as its cause), and ``loop._call_model`` re-raises a retryable
   provider error as it came (only a non-retryable one is redacted). A credential a
   provider's 5xx text echoes lands in Temporal's history (the next attempt's
   ``last_failure``) and in the worker's log.
2. (LOW-MEDIUM) ``test_submit_does_not_refuse_as_in_doubt_a_call_its_live_holder_is_sending``:
   ``commands.submit`` plans from the run's records without looking at its lease: right
   after a terminate, while the closed workflow's activity still holds the lease inside a
   sync tool, it refuses the call as in doubt ("claimed in flight by ... nobody can say
   whether it ran", exit 4) and pages an operator, where the kit's resume says "held, come
   back later". The call then completes and is recorded; nothing is sent twice.
3. (LOW-MEDIUM) ``test_a_call_in_doubt_under_a_replaced_id_is_resolved_by_it_and_carried_on
   [True]``: ``tesserix resolve --call`` is read as given, so an operator naming the call
   by the model's own (secret) id is told "has no call 'sk-proj-...' on record": the
   secret printed back. ``--by`` is masked as it is read; ``--call`` is not.

What held (plain tests): a secret call id through a Temporal run (one call, twins under
one secret id, identical or not, a model echoing the replacement beside the secret id, an
approval over it, a kit run given a transcript with secret ids waiting on a person and
handed over with ``carry_on_run``): nothing of the secret is in any execution's history or
in the SQLite file, each call is sent once and each told its own outcome under the replaced
id; a call in doubt fails the workflow naming the replaced id, ``resolve --call <replaced>``
settles it and ``submit --temporal`` carries the run on to completion without sending it
again. The Temporal start path takes only text (``Message.user``), so no call id of a
run's input crosses into history there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

from on_temporal.conftest import DevServer
from on_temporal.helpers import FAST, fast_runner, queue, run_id, worker_running, world_stores
from run.helpers import Asks as HelpersAsks
from tesserix_adk import Agent, AgentRunner, ToolCall, ToolContext, tool
from tesserix_adk.errors import IndeterminateToolCallError, ProviderError
from tesserix_adk.messages import Message, Role
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.temporal import RunOutcome, carry_on_run, start_run
from test_attacks_secrets import sqlite_everything

T = "acme"
SECRET_ID = "sk-proj-QZSECRETIDQZaaaaaaaaaaaaaaaaaaaaaa1"
NEEDLE = b"QZSECRETIDQZ"


def replaced(call_id: str) -> str:
    return "call_masked_" + hashlib.sha256(call_id.encode()).hexdigest()[:24]


class Asks(HelpersAsks):
    """``run.helpers.Asks``, telling what the model was told last."""

    def last_told(self) -> list[tuple[str | None, str]]:
        """(tool_call_id, text) of each tool result in the last request."""
        last = self.requests[-1]
        return [(m.tool_call_id, m.text) for m in last.messages if m.role is Role.tool]

    def last_asked_ids(self) -> list[str]:
        last = self.requests[-1]
        return [c.id for m in last.messages for c in m.tool_calls]


class Shop:
    def __init__(self) -> None:
        self.charged: list[tuple[str, int]] = []
        self.wired: list[str] = []

    def agent(self) -> Agent:
        @tool
        async def charge(order: str, amount: int, ctx: ToolContext) -> str:
            """Charge an order once."""
            self.charged.append((order, amount))
            return f"charged {order}: {amount}"

        @tool(requires_approval=True)
        async def wire(order: str, ctx: ToolContext) -> str:
            """Wire money for an order, once a person approved it."""
            self.wired.append(order)
            return f"wired {order}"

        return Agent("shop", "Charge.", [charge, wire])


def call(call_id: str, name: str, **arguments: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


@contextlib.asynccontextmanager
async def worker(
    server: DevServer, world: Path, provider: Any, agent: Agent
) -> AsyncIterator[tuple[Client, Stores, str]]:
    client = await Client.connect(server.address)
    async with await world_stores(world) as stores:
        q = queue()
        async with worker_running(client, fast_runner(provider, stores), [agent], q):
            yield client, stores, q


async def result(handle: WorkflowHandle[Any, Any], within: float = 20.0) -> Any:
    try:
        return await asyncio.wait_for(handle.result(), within)
    except (WorkflowFailureError, TimeoutError) as exc:
        with contextlib.suppress(Exception):
            await handle.terminate("attack test over")
        return exc


def failure(outcome: Any) -> str:
    cause = getattr(outcome, "cause", None)
    return f"{getattr(cause, 'type', None)}: {getattr(cause, 'message', outcome)}"


async def raw_history(client: Client, rid: str) -> bytes:
    """Every event of every execution of the workflow ``rid``, serialized."""
    out = bytearray()
    async for execution in client.list_workflows(f"WorkflowId = '{rid}'"):
        history = await client.get_workflow_handle(rid, run_id=execution.run_id).fetch_history()
        out += b"".join(e.SerializeToString() for e in history.events)
    if not out:
        history = await client.get_workflow_handle(rid).fetch_history()
        out += b"".join(e.SerializeToString() for e in history.events)
    return bytes(out)


async def run_on_temporal(
    server: DevServer, world: Path, model: Asks, agent: Agent, **start: Any
) -> tuple[Any, bytes]:
    rid = run_id()
    async with worker(server, world, model, agent) as (client, _, q):
        handle = await start_run(
            client, agent, f"go {rid}", tenant=T, run_id=rid, task_queue=q, options=FAST, **start
        )
        outcome = await result(handle)
        raw = await raw_history(client, rid)
    return outcome, raw


# --- a secret call id through a Temporal run ----------------------------------------------


async def test_a_secret_call_id_reaches_neither_history_nor_store_on_temporal(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    model = Asks([call(SECRET_ID, "charge", order="5", amount=10)], "done")
    outcome, raw = await run_on_temporal(temporal_server, tmp_path, model, shop.agent())
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert shop.charged == [("5", 10)]
    assert NEEDLE not in raw
    assert replaced(SECRET_ID).encode() in raw  # the id that crossed is the replacement
    assert NEEDLE not in sqlite_everything(tmp_path / "adk.sqlite3")
    # The model's call and its result still pair, under the replaced id.
    assert model.last_asked_ids() == [replaced(SECRET_ID)]
    assert model.last_told() == [(replaced(SECRET_ID), "charged 5: 10")]


@pytest.mark.parametrize("twins", ["identical", "different"])
async def test_twins_under_one_secret_id_are_each_sent_once_on_temporal(
    temporal_server: DevServer, tmp_path: Path, twins: str
) -> None:
    shop = Shop()
    second = "5" if twins == "identical" else "6"
    model = Asks(
        [
            call(SECRET_ID, "charge", order="5", amount=10),
            call(SECRET_ID, "charge", order=second, amount=10),
        ],
        "done",
    )
    outcome, raw = await run_on_temporal(temporal_server, tmp_path, model, shop.agent())
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert shop.charged == [("5", 10), (second, 10)]
    assert model.last_told() == [
        (replaced(SECRET_ID), "charged 5: 10"),
        (replaced(SECRET_ID), f"charged {second}: 10"),
    ]
    assert NEEDLE not in raw
    assert NEEDLE not in sqlite_everything(tmp_path / "adk.sqlite3")


async def test_a_model_echoing_the_replacement_of_a_secret_id_beside_it_is_two_calls(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    echo = replaced(SECRET_ID)
    model = Asks(
        [
            call(SECRET_ID, "charge", order="5", amount=10),
            call(echo, "charge", order="6", amount=20),
        ],
        "done",
    )
    outcome, raw = await run_on_temporal(temporal_server, tmp_path, model, shop.agent())
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert shop.charged == [("5", 10), ("6", 20)]
    ids = model.last_asked_ids()
    assert ids == [echo, replaced(echo)] and len(set(ids)) == 2
    assert model.last_told() == [(echo, "charged 5: 10"), (replaced(echo), "charged 6: 20")]
    assert NEEDLE not in raw


async def test_an_approval_on_temporal_over_a_secret_call_id(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    model = Asks(
        [call(SECRET_ID, "wire", order="7"), call(SECRET_ID, "charge", order="7", amount=1)],
        "done",
    )
    agent = shop.agent()
    rid = run_id()
    async with worker(temporal_server, tmp_path, model, agent) as (client, stores, q):
        handle = await start_run(
            client,
            agent,
            f"go {rid}",
            tenant=T,
            run_id=rid,
            task_queue=q,
            options=FAST,
            approval_poll=0.2,
        )
        request = None
        async with asyncio.timeout(20):
            while request is None:
                cp = await AgentRunner.from_stores(model, stores).checkpoints.latest(T, rid)  # type: ignore[union-attr]
                if cp is not None and cp.pending_approval is not None:
                    request = cp.pending_approval
                await asyncio.sleep(0.05)
        assert list(request.calls) == [replaced(SECRET_ID)]
        assert shop.wired == []
        await stores.approvals.decide(T, request.id, approved=True, by="ops")
        outcome = await result(handle)
        raw = await raw_history(client, rid)
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert shop.wired == ["7"] and shop.charged == [("7", 1)]
    assert model.last_told() == [
        (replaced(SECRET_ID), "wired 7"),
        (replaced(SECRET_ID), "charged 7: 1"),
    ]
    assert NEEDLE not in raw
    assert NEEDLE not in sqlite_everything(tmp_path / "adk.sqlite3")


async def test_a_kit_run_over_a_secret_id_handed_to_temporal_keeps_it_out_of_history(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    """A kit run given a transcript whose call ids hold a secret, waiting on a person,
    handed over (``carry_on_run``), approved and finished by the workflow."""
    shop = Shop()
    agent = shop.agent()
    earlier = [
        Message.user("go"),
        Message(
            role="assistant",
            content="",
            tool_calls=(call(SECRET_ID, "charge", order="1", amount=1),),
        ),
        Message(role="tool", content="charged 1: 1", tool_call_id=SECRET_ID),
        Message.user("now wire order 7"),
    ]
    model = Asks(
        "",  # turn 1 is in the transcript already
        [call(SECRET_ID, "wire", order="7")],
        "done",
    )
    rid = run_id()
    async with worker(temporal_server, tmp_path, model, agent) as (client, stores, q):
        kit = AgentRunner.from_stores(model, stores)
        waiting = await kit.run(agent, earlier, tenant=T, run_id=rid)
        assert waiting.status == "waiting_approval", waiting.status
        cp = await kit.checkpoints.latest(T, rid)  # type: ignore[union-attr]
        assert cp is not None and cp.pending_approval is not None
        handle = await carry_on_run(
            client,
            agent,
            cp,
            spent_micros=await stores.ledger.spent(T, rid),
            task_queue=q,
            options=FAST,
            approval_poll=0.2,
        )
        await stores.approvals.decide(T, cp.pending_approval.id, approved=True, by="ops")
        outcome = await result(handle)
        raw = await raw_history(client, rid)
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert shop.wired == ["7"] and shop.charged == []
    told = model.last_told()
    assert told == [(replaced(SECRET_ID), "charged 1: 1"), (replaced(SECRET_ID), "wired 7")]
    assert NEEDLE not in raw
    assert NEEDLE not in sqlite_everything(tmp_path / "adk.sqlite3")


# --- submit --temporal reading a live holder's claim ---------------------------------------


async def test_submit_does_not_refuse_as_in_doubt_a_call_its_live_holder_is_sending(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    from tesserix_adk.temporal.commands import submit

    entered, release = threading.Event(), threading.Event()
    sent: list[str] = []

    @tool
    def charge(order: str, ctx: ToolContext) -> str:
        """Charge an order once (slowly, in a thread)."""
        entered.set()
        release.wait(20)
        sent.append(order)
        return f"charged {order}"

    agent = Agent("shop", "Charge.", [charge])
    model = Asks([call("c1", "charge", order="5")], "done")
    rid = run_id()
    refused: BaseException | None = None
    try:
        async with worker(temporal_server, tmp_path, model, agent) as (client, stores, q):
            handle = await start_run(
                client, agent, f"go {rid}", tenant=T, run_id=rid, task_queue=q, options=FAST
            )
            assert await asyncio.to_thread(entered.wait, 20)
            # An operator ends the stuck-looking workflow and submits the run again at once;
            # the closed workflow's activity still holds the run's lease, in the call.
            await handle.terminate("operator")
            assert await runner_lease_held(stores, rid)
            try:
                await submit(
                    temporal_server.address,
                    "default",
                    agent,
                    "go again",
                    tenant=T,
                    run_id=rid,
                    task_queue=q,
                    stores=stores,
                )
            except Exception as exc:
                refused = exc
            release.set()
            async with asyncio.timeout(20):
                while not sent:  # noqa: ASYNC110 - a thread appends
                    await asyncio.sleep(0.05)
            with contextlib.suppress(Exception):
                await client.get_workflow_handle(rid).terminate("attack test over")
    finally:
        release.set()
    assert sent == ["5"]
    assert not isinstance(refused, IndeterminateToolCallError), refused
    assert refused is None or getattr(refused, "retryable", False), refused


async def runner_lease_held(stores: Stores, rid: str) -> bool:
    assert stores.leases is not None
    return await stores.leases.current(T, rid) is not None


# --- a retryable error's text in Temporal's history ----------------------------------------

ECHOED = "Bearer QZECHOQZ0123456789abcdefghijklmnop"


class FlakyEcho(Asks):
    """A model whose first answer is a retryable error echoing a credential (an upstream
    5xx page repeating the request's headers), then answers."""

    def __init__(self, *turns: list[ToolCall] | str) -> None:
        super().__init__(*turns)
        self.failed = False

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if not self.failed:
            self.failed = True
            raise ProviderError(
                f"upstream 503: bad gateway (request headers: Authorization: {ECHOED})",
                retryable=True,
            )
        return await super().complete(request)


async def test_a_secret_in_a_retryable_model_error_never_reaches_temporals_history(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    model = FlakyEcho([call("c1", "charge", order="5", amount=10)], "done")
    outcome, raw = await run_on_temporal(temporal_server, tmp_path, model, shop.agent())
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert model.failed and shop.charged == [("5", 10)]
    assert b"QZECHOQZ" not in raw


# --- a call in doubt under a replaced id, resolved, carried on -----------------------------


@pytest.mark.parametrize("by_secret_id", [False, True])
async def test_a_call_in_doubt_under_a_replaced_id_is_resolved_by_it_and_carried_on(
    temporal_server: DevServer, tmp_path: Path, by_secret_id: bool
) -> None:
    from tesserix_adk.cli.main import main as cli_main
    from tesserix_adk.temporal.commands import submit

    entered = asyncio.Event()
    sent: list[str] = []

    @tool
    async def charge(order: str, ctx: ToolContext) -> str:
        """Charge an order once; hangs after sending."""
        sent.append(order)
        entered.set()
        await asyncio.sleep(60)
        return f"charged {order}"

    agent = Agent("shop", "Charge.", [charge])
    model = Asks([call(SECRET_ID, "charge", order="5")], "done")
    rid = run_id()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def submitted() -> BaseException | None:
        try:
            await submit(
                temporal_server.address,
                "default",
                agent,
                "go again",
                tenant=T,
                run_id=rid,
                task_queue=q,
                stores=stores,
            )
        except Exception as exc:
            return exc
        return None

    def cli(*argv: str) -> str:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(list(argv))
        return f"exit {code}\n{out.getvalue()}\n{err.getvalue()}"

    async with worker(temporal_server, tmp_path, model, agent) as (client, stores, q):
        handle = await start_run(
            client, agent, f"go {rid}", tenant=T, run_id=rid, task_queue=q, options=FAST
        )
        await asyncio.wait_for(entered.wait(), 20)
        await handle.terminate("operator")
        async with asyncio.timeout(20):  # the cancelled attempt lets go of the run
            while await runner_lease_held(stores, rid):  # noqa: ASYNC110 - the store says
                await asyncio.sleep(0.05)
        refused = await submitted()
        assert isinstance(refused, IndeterminateToolCallError), refused
        assert replaced(SECRET_ID) in str(refused) and "QZSECRETIDQZ" not in str(refused)
        if by_secret_id:
            # An operator naming the call by the model's own id (from the provider's
            # logs) is never told it back, found or not.
            told = await asyncio.to_thread(
                cli, "resolve", rid, "--tenant", T, "--call", SECRET_ID,
                "--outcome", '"charged 5 (checked)"', "--by", "ops", "--store", url,
            )  # fmt: skip
            assert "QZSECRETIDQZ" not in told, told
            return
        resolved = await asyncio.to_thread(
            cli, "resolve", rid, "--tenant", T, "--call", replaced(SECRET_ID),
            "--outcome", '"charged 5 (checked)"', "--by", "ops", "--store", url,
        )  # fmt: skip
        assert resolved.startswith("exit 0"), resolved
        assert await submitted() is None
        outcome = await result(client.get_workflow_handle(rid, result_type=RunOutcome))
        raw = await raw_history(client, rid)
    assert getattr(outcome, "status", None) == "completed", failure(outcome)
    assert sent == ["5"]
    assert model.last_told() == [(replaced(SECRET_ID), "charged 5 (checked)")]
    assert NEEDLE not in raw
    assert NEEDLE not in sqlite_everything(tmp_path / "adk.sqlite3")
