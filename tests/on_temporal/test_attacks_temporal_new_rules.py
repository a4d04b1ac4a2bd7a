"""An attacker's look at the Temporal integration against the kit's newest rules, written
for the plain runner: odd tool results (bytes that are not UTF-8, ints past 4,300 digits,
dicts keyed by them), two tools sharing one business key, NUL characters in call ids,
business keys, tenants and run ids, a reconciler answering with bytes, an approval decided
by ``tesserix approve`` around a SIGKILLed worker, and a worker process SIGKILLed inside a
side-effecting activity whose result is bytes.

No defect found: every test here is a plain test of a promise that held (see each test's
name). Held: odd results (non-UTF-8 bytes, ints past 4,300 digits, dicts keyed by them,
NaN/Infinity, mixed keys, NUL text) recorded completed and told exactly as the kit's own
runner tells them, also when the tool activity's reply is lost and the retry replays,
on SQLite and PostgreSQL, keyed or unkeyed; a refund keyed like a charge (same run, same
turn, another live run holding the charge, a dead run's charge in doubt) answered "not
sent" at once, never told the charge's outcome, its reconciler never asked; NUL in a call
id (also under an approval decided by ``tesserix approve``), in a plain argument, in a
business key argument (refused saying why), in a tenant or run id (refused before any
workflow starts); a reconciler answering completed with bytes settles the call as the kit
does; worker processes SIGKILLed after the reply, inside the call after or before the
effect, and around an approval: the effect at most once, told alike.

Each Temporal run is a real ``AgentWorkflow`` on the session's dev server; most use an
in-process worker over a SQLite world; the crash tests run this very module as a worker
process (``python -m on_temporal.test_attacks_temporal_new_rules ADDRESS QUEUE AGENT``)
and SIGKILL it. Effects are counted in a file the tool appends to.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    TESTS,
    fast_runner,
    in_world,
    queue,
    run_id,
    store_url,
    tesserix,
    wait_for_file,
    worker_running,
    world_stores,
)
from tesserix_adk import (
    Agent,
    AgentRunner,
    Reconciled,
    ScriptedProvider,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.errors import ConfigurationError, ToolOutcomeUnknownError
from tesserix_adk.messages import Role
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.temporal import AgentActivities, AgentWorkflow, start_run
from tesserix_adk.temporal.shapes import TOOL_ACTIVITY, ToolInput, ToolResult
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
WORLD_ENV = "TESSERIX_WORLD"

HUGE = 7**6000  # about 5,070 decimal digits: past Python's 4,300 for text
NOT_UTF8 = b"\xff\xfe\x00\x80png"

ODD: dict[str, Any] = {
    "bytes_not_utf8": NOT_UTF8,
    "bytes_utf8": "grüß".encode(),
    "huge_int": HUGE,
    "list_of_odd": [NOT_UTF8, HUGE, 1],
    "dict_bytes_key": {NOT_UTF8: "v", b"k": NOT_UTF8},
    "dict_huge_int_key": {HUGE: "v", 5: HUGE},
    "nan_and_infinity": [math.nan, math.inf, -math.inf],
    "mixed_keys": {1: b"\xff", "b": -HUGE, None: 1.5},
    "nul_text": "a\x00b",
    "nul_bytes_utf8": {b"k\x00": b"\x00v"},
}


def _world() -> Path:
    return Path(os.environ[WORLD_ENV])


def _effect(line: str) -> None:
    with (_world() / "effects.txt").open("a") as f:
        f.write(line.replace("\n", " ") + "\n")


def _effects(world: Path) -> list[str]:
    path = world / "effects.txt"
    return path.read_text().splitlines() if path.exists() else []


def _wait_while(path: Path) -> None:
    while path.exists():
        time.sleep(0.02)


def _hold(name: str) -> None:
    hold = _world() / name
    if not hold.exists():
        return
    (_world() / "entered").write_text(name)
    while hold.exists():
        time.sleep(0.02)


# --- tools --------------------------------------------------------------------------------


@tool
def fetch(kind: str, ctx: ToolContext) -> Any:
    """Fetch a document of an odd kind (a side effect: it is counted)."""
    _effect(f"fetch {kind} {ctx.idempotency_key}")
    return ODD[kind]


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


@tool(key=_by_order)
async def charge(order: str, amount: int, ctx: ToolContext) -> str:
    """Charge an order once."""
    _effect(f"charge {order} {ctx.run_id}")
    if (_world() / "charge_crash").exists():
        raise SimulatedCrash("the charging process died with the call in hand")
    gate = _world() / "charge_gate"
    if gate.exists():
        (_world() / "charge_inside").touch()
        await asyncio.to_thread(_wait_while, gate)
    return f"charged {order}: {amount}"


@tool(key=_by_order)
def refund(order: str, amount: int, ctx: ToolContext) -> str:
    """Refund an order once."""
    _effect(f"refund {order} {ctx.run_id}")
    return f"refunded {order}: {amount}"


def _reconcile_bytes(call: ToolCall, ctx: ToolContext) -> Reconciled:
    for line in _effects(_world()):
        if line.endswith(ctx.idempotency_key):
            return Reconciled.completed(ODD[call.arguments["kind"]])
    return Reconciled.never_ran()


@tool(name="fetch", reconcile=_reconcile_bytes)
def fetch_lost(kind: str, ctx: ToolContext) -> Any:
    """Fetch a document; the reply is lost the first time (the effect happened)."""
    if not any(line.endswith(ctx.idempotency_key) for line in _effects(_world())):
        _effect(f"fetch {kind} {ctx.idempotency_key}")
        raise ToolOutcomeUnknownError("the reply was lost after the request was sent")
    raise AssertionError("sent twice")  # pragma: no cover - the defect this looks for


@tool(name="fetch", reconcile=_reconcile_bytes)
def fetch_held(kind: str, ctx: ToolContext) -> Any:
    """Fetch a document, held in place by files (for a kill)."""
    _hold("hold_before")
    _effect(f"fetch {kind} {ctx.idempotency_key}")
    _hold("hold_after")
    return ODD[kind]


@tool(name="book", requires_approval=True)
def book(flight: str, ctx: ToolContext) -> str:
    """Book a seat once a person approved it."""
    _hold("hold_before")
    _effect(f"book {flight} {ctx.idempotency_key}")
    return f"booked {flight}"


odd_agent = Agent("odd", "Fetch.", [fetch])
shop_agent = Agent("shop", "Charge and refund.", [charge, refund])
lost_agent = Agent("odd", "Fetch.", [fetch_lost])
held_agent = Agent("odd", "Fetch.", [fetch_held])
approval_agent = Agent("approve", "Book once approved.", [book])


# --- the model ----------------------------------------------------------------------------


class Told(ScriptedProvider):
    """The scripted model, keeping every request; ``ids`` rewrites each call id."""

    def __init__(self, turns: list[Any], ids: Any = None) -> None:
        super().__init__(turns)
        self.seen: list[Any] = []
        self.ids = ids

    async def complete(self, request: Any) -> Any:
        self.seen.append(request)
        response = await super().complete(request)
        if self.ids is None or not response.message.tool_calls:
            return response
        calls = [
            ToolCall(id=self.ids(c.id), name=c.name, arguments=c.arguments)
            for c in response.message.tool_calls
        ]
        message = type(response.message).assistant(response.message.text, calls)
        return type(response)(message=message, usage=response.usage, cost_micros=0)

    def told(self, rid: str) -> list[str]:
        mine = [r for r in self.seen if r.messages[0].text == f"go {rid}"]
        return [m.text for m in mine[-1].messages if m.role is Role.tool] if mine else []


class _LosingFirstReply(AgentActivities):
    """A tool activity whose first attempt's reply never reaches Temporal (after the kit
    recorded the call): the retry must replay, not send, and tell the same."""

    @activity.defn(name=TOOL_ACTIVITY)
    async def tool_call(self, call: ToolInput) -> ToolResult:
        result = await super().tool_call(call)
        if activity.info().attempt == 1:
            raise ApplicationError("the reply was lost on its way to Temporal")
        return result


class Rig:
    def __init__(self, client: Client, stores: Stores, q: str) -> None:
        self.client = client
        self.stores = stores
        self.q = q
        self.handles: list[WorkflowHandle[Any, Any]] = []

    async def start(self, agent: Agent, rid: str, **start: Any) -> WorkflowHandle[Any, Any]:
        handle = await start_run(
            self.client, agent, f"go {rid}", tenant=T, run_id=rid, task_queue=self.q, **start
        )
        self.handles.append(handle)
        return handle


@contextlib.asynccontextmanager
async def _stores(world: Path, pg: bool) -> AsyncIterator[Stores]:
    if pg:
        from adapters.services import postgres_stores

        async with postgres_stores() as stores:
            yield stores
    else:
        async with await world_stores(world) as stores:
            yield stores


@contextlib.asynccontextmanager
async def rig(
    server: DevServer,
    world: Path,
    provider: Any,
    agent: Agent,
    *,
    lose_first: bool = False,
    pg: bool = False,
) -> AsyncIterator[Rig]:
    from temporalio.worker import Worker

    with in_world(world):
        client = await Client.connect(server.address)
        async with _stores(world, pg) as stores:
            q = queue()
            r = Rig(client, stores, q)
            runner = fast_runner(provider, stores)
            if lose_first:
                acts = _LosingFirstReply(runner, [agent], heartbeat_every=0.3)
                worker: Any = Worker(
                    client,
                    task_queue=q,
                    workflows=[AgentWorkflow],
                    activities=[acts.model_turn, acts.tool_call],
                )
                ctx: Any = worker
            else:
                ctx = worker_running(client, runner, [agent], q)
            async with ctx:
                try:
                    yield r
                finally:
                    for handle in r.handles:
                        with contextlib.suppress(Exception):
                            await handle.terminate("attack test over")


async def _result(handle: WorkflowHandle[Any, Any], within: float = 30.0) -> Any:
    try:
        return await asyncio.wait_for(handle.result(), within)
    except (WorkflowFailureError, TimeoutError) as exc:
        return exc


def _failure(outcome: Any) -> str:
    cause = getattr(outcome, "cause", None)
    return f"{getattr(cause, 'type', None)}: {getattr(cause, 'message', outcome)}"


async def _kit_told(stores: Stores, agent: Agent, turns: list[Any]) -> list[str]:
    """What the kit's own runner tells the model for the same script."""
    model = Told(turns)
    rid = run_id()
    run = await fast_runner(model, stores).run(agent, f"go {rid}", tenant=T, run_id=rid)
    assert run.status.value == "completed", run
    return model.told(rid)


# --- 1. odd results: recorded completed, told as the kit tells, alike on replay -----------


def _odd_cases() -> list[Any]:
    """Every odd result with its first reply lost; at once and on PostgreSQL, two of them
    in CI and every one with ADK_SLOW=1 (a workflow each: CI keeps under 20 minutes)."""
    cases = []
    for kind in ODD:
        for lose_first, pg, how in ((False, False, "first"), (True, False, "reply_lost")):
            cases.append((kind, lose_first, pg, how))
        cases.append((kind, True, True, "reply_lost_postgres"))
    kept = {"bytes_not_utf8", "dict_huge_int_key"}
    return [
        pytest.param(
            kind,
            lose_first,
            pg,
            id=f"{kind}-{how}",
            marks=() if how == "reply_lost" or kind in kept else pytest.mark.slow,
        )
        for kind, lose_first, pg, how in cases
    ]


@pytest.mark.parametrize(("kind", "lose_first", "pg"), _odd_cases())
async def test_an_odd_result_is_recorded_completed_and_told_as_the_kit_tells_it(
    temporal_server: DevServer, tmp_path: Path, kind: str, lose_first: bool, pg: bool
) -> None:
    turns: list[Any] = [[("fetch", {"kind": kind})], "done"]
    model = Told(turns)
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, odd_agent, lose_first=lose_first, pg=pg) as w:
        outcome = await _result(await w.start(odd_agent, rid, options=FAST))
        assert getattr(outcome, "status", None) == "completed", _failure(outcome)
        ours = [e for e in _effects(tmp_path) if e.startswith("fetch")]
        assert len(ours) == 1, ours  # sent once, also when its reply was lost
        key = ours[0].rsplit(" ", 1)[1]
        rec = (await w.stores.idempotency.lookup([key], tenant=T))[key]
        assert rec.status is RecordStatus.completed
        told = model.told(rid)
        kit = await _kit_told(w.stores, odd_agent, turns)
    assert told == kit
    assert "Error" not in told[0]
    if kind == "bytes_not_utf8":
        assert told == [base64.b64encode(NOT_UTF8).decode("ascii")]


@tool(key=None)
def fetch_unkeyed(kind: str, ctx: ToolContext) -> Any:
    """Fetch without a key (a side effect: it is counted)."""
    _effect(f"fetch {kind} unkeyed")
    return ODD[kind]


@tool(name="fetch_unkeyed", key=None, side_effects=False)
def read_unkeyed(kind: str, ctx: ToolContext) -> Any:
    """Read without a key (no side effects, but counted all the same)."""
    _effect(f"read {kind} unkeyed")
    return ODD[kind]


@pytest.mark.parametrize("side_effects", [True, False], ids=["unkeyed", "read_only"])
@pytest.mark.parametrize("kind", ["list_of_odd", "dict_huge_int_key", "dict_bytes_key"])
async def test_an_odd_result_of_an_unkeyed_call_is_told_as_the_kit_tells_it(
    temporal_server: DevServer, tmp_path: Path, kind: str, side_effects: bool
) -> None:
    t = fetch_unkeyed if side_effects else read_unkeyed
    agent = Agent("odd", "Fetch.", [t])
    turns: list[Any] = [[("fetch_unkeyed", {"kind": kind})], "done"]
    model = Told(turns)
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, agent) as w:
        outcome = await _result(await w.start(agent, rid, options=FAST), within=20)
        sent = len(_effects(tmp_path))
        kit = await _kit_told(w.stores, agent, turns)
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    assert sent == 1
    assert model.told(rid) == kit


# --- 2. a charge and a refund sharing one business key ------------------------------------


@pytest.mark.parametrize("same_turn", [False, True], ids=["next_turn", "same_turn"])
async def test_a_refund_sharing_the_charges_key_is_not_sent_nor_told_the_charge(
    temporal_server: DevServer, tmp_path: Path, same_turn: bool
) -> None:
    args = {"order": "5", "amount": 10}
    turns: list[Any]
    if same_turn:
        turns = [[("charge", args), ("refund", args)], "done"]
    else:
        turns = [[("charge", args)], [("refund", args)], "done"]
    model = Told(turns)
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, shop_agent) as w:
        outcome = await _result(await w.start(shop_agent, rid, options=FAST))
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    told = model.told(rid)
    assert told[0] == "charged 5: 10"
    assert told[1].startswith("not sent: its idempotency key names a call of charge"), told
    assert [e.split(" ")[0] for e in _effects(tmp_path)] == ["charge"]


async def test_a_refund_while_another_runs_charge_holds_the_key_is_not_sent(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    args = {"order": "5", "amount": 10}
    model = Told([[("charge", args)], [("refund", args)], "done"])
    refunds = Told([[("refund", args)], "done"])
    r1, r2 = run_id(), run_id()
    (tmp_path / "charge_gate").touch()
    async with rig(temporal_server, tmp_path, refunds, shop_agent) as w:
        kit = fast_runner(model, w.stores)
        one = asyncio.ensure_future(kit.run(shop_agent, f"go {r1}", tenant=T, run_id=r1))
        await wait_for_file(tmp_path / "charge_inside", 15)
        h2 = await w.start(shop_agent, r2, options=FAST)
        # While the charge is in hand elsewhere, the refund must not be sent, and must
        # not wait on (or be refused in doubt over) another tool's call.
        early = await _result(h2, within=15)
        (tmp_path / "charge_gate").unlink()
        await asyncio.wait_for(one, 20)
    assert getattr(early, "status", None) == "completed", _failure(early)
    (answer,) = refunds.told(r2)
    assert answer.startswith("not sent: its idempotency key names a call of charge"), answer
    assert "charged" not in answer
    assert [e.split(" ")[0] for e in _effects(tmp_path)] == ["charge"]


def _refund_asked(call: ToolCall, ctx: ToolContext) -> Reconciled:
    _effect(f"asked {ctx.idempotency_key}")
    return Reconciled.completed(f"refunded {call.arguments['order']}")


@tool(name="refund", key=_by_order, reconcile=_refund_asked)
def refund_reconciled(order: str, amount: int, ctx: ToolContext) -> str:
    """Refund an order once (its reconciler asks the payment system)."""
    _effect(f"refund {order} {ctx.run_id}")
    return f"refunded {order}: {amount}"


@pytest.mark.parametrize("reconciled", [False, True], ids=["plain", "reconciled"])
async def test_a_refund_meeting_a_dead_runs_charge_in_doubt_is_not_sent_nor_settled(
    temporal_server: DevServer, tmp_path: Path, reconciled: bool
) -> None:
    args = {"order": "5", "amount": 10}
    agent = Agent(
        "shop", "Charge and refund.", [charge, refund_reconciled if reconciled else refund]
    )
    charges = Told([[("charge", args)], "done"])
    refunds = Told([[("refund", args)], "done"])
    r1, r2 = run_id(), run_id()
    (tmp_path / "charge_crash").touch()
    async with rig(temporal_server, tmp_path, refunds, agent) as w:
        with pytest.raises(SimulatedCrash):
            await fast_runner(charges, w.stores).run(agent, f"go {r1}", tenant=T, run_id=r1)
        (tmp_path / "charge_crash").unlink()
        outcome = await _result(await w.start(agent, r2, options=FAST), within=20)
        rec = (await w.stores.idempotency.lookup(["acme/order-5"], tenant=T)).get("acme/order-5")
    # The charge's claim stays in doubt for `tesserix resolve`, never settled by the
    # refund's reconciler; the refund is neither sent nor told the charge's fate.
    assert [e.split(" ")[0] for e in _effects(tmp_path)] == ["charge"]
    assert rec is not None and rec.status is RecordStatus.in_flight, rec
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    (answer,) = refunds.told(r2)
    assert answer.startswith("not sent: its idempotency key names a call of charge"), answer


# --- 3. NUL characters --------------------------------------------------------------------


@pytest.mark.parametrize("pg", [False, True], ids=["sqlite", "postgres"])
async def test_a_call_id_holding_nul_is_sent_once_and_told_its_result(
    temporal_server: DevServer, tmp_path: Path, pg: bool
) -> None:
    model = Told([[("fetch", {"kind": "bytes_utf8"})], "done"], ids=lambda i: f"c\x00{i}")
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, odd_agent, lose_first=True, pg=pg) as w:
        outcome = await _result(await w.start(odd_agent, rid, options=FAST))
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    assert model.told(rid) == ["grüß"]
    assert len(_effects(tmp_path)) == 1


@pytest.mark.parametrize("pg", [False, True], ids=["sqlite", "postgres"])
async def test_a_business_key_argument_holding_nul_is_not_sent_saying_why(
    temporal_server: DevServer, tmp_path: Path, pg: bool
) -> None:
    model = Told([[("charge", {"order": "5\x00x", "amount": 10})], "done"])
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, shop_agent, pg=pg) as w:
        outcome = await _result(await w.start(shop_agent, rid, options=FAST))
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    (answer,) = model.told(rid)
    assert answer.startswith("not sent") and "NUL" in answer, answer
    assert _effects(tmp_path) == []


@pytest.mark.parametrize("pg", [False, True], ids=["sqlite", "postgres"])
async def test_a_nul_in_a_plain_argument_goes_out_once(
    temporal_server: DevServer, tmp_path: Path, pg: bool
) -> None:
    @tool(name="note")
    def note(text: str, ctx: ToolContext) -> str:
        """Write a note."""
        _effect(f"note {ctx.idempotency_key}")
        return f"noted {len(text)}"

    agent = Agent("noter", "Note.", [note])
    model = Told([[("note", {"text": "a\x00b"})], "done"])
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, agent, lose_first=True, pg=pg) as w:
        outcome = await _result(await w.start(agent, rid, options=FAST))
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    assert model.told(rid) == ["noted 3"]
    assert len(_effects(tmp_path)) == 1


@pytest.mark.parametrize("which", ["tenant", "run_id"])
async def test_a_nul_in_the_tenant_or_run_id_is_refused_before_a_workflow_starts(
    temporal_server: DevServer, which: str
) -> None:
    client = await Client.connect(temporal_server.address)
    rid = run_id()
    tenant = T
    if which == "tenant":
        tenant = "ac\x00me"
    else:
        rid = f"{rid}\x00x"
    with pytest.raises(ConfigurationError, match="NUL"):
        await start_run(client, odd_agent, "go", tenant=tenant, run_id=rid, task_queue=queue())
    with pytest.raises(RPCError):
        await client.get_workflow_handle(rid).describe()


@pytest.mark.parametrize("deny", [False, True], ids=["approved", "denied"])
async def test_an_approval_over_a_nul_call_id_is_decided_by_the_cli_and_sent_at_most_once(
    temporal_server: DevServer, tmp_path: Path, deny: bool
) -> None:
    model = Told([[("book", {"flight": "LH1"})], "done"], ids=lambda i: f"b\x00{i}")
    rid = run_id()
    url = store_url(tmp_path)
    async with rig(temporal_server, tmp_path, model, approval_agent) as w:
        handle = await w.start(approval_agent, rid, options=FAST, approval_poll=0.2)
        request = await _pending(w.stores, rid)
        decided = await tesserix(
            "approve",
            request,
            "--tenant",
            T,
            "--by",
            "ops",
            *(["--deny", "--note", "no"] if deny else []),
            "--store",
            url,
        )
        assert decided.returncode == 0, decided.stderr
        outcome = await _result(handle)
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    told = model.told(rid)
    if deny:
        assert told == ["denied by ops: no"]
        assert _effects(tmp_path) == []
    else:
        assert told == ["booked LH1"]
        assert len(_effects(tmp_path)) == 1


# --- 4. a reconciler answering completed with bytes ---------------------------------------


@pytest.mark.parametrize(
    ("kind", "pg"),
    [
        ("bytes_not_utf8", False),
        ("dict_bytes_key", False),
        ("dict_huge_int_key", False),
        ("nul_bytes_utf8", True),
        ("mixed_keys", True),
    ],
)
async def test_a_reconciler_answering_with_bytes_settles_the_call_as_the_kit_does(
    temporal_server: DevServer, tmp_path: Path, kind: str, pg: bool
) -> None:
    turns: list[Any] = [[("fetch", {"kind": kind})], "done"]
    model = Told(turns)
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, lost_agent, pg=pg) as w:
        outcome = await _result(await w.start(lost_agent, rid, options=FAST))
        assert getattr(outcome, "status", None) == "completed", _failure(outcome)
        [line] = _effects(tmp_path)
        key = line.rsplit(" ", 1)[1]
        rec = (await w.stores.idempotency.lookup([key], tenant=T))[key]
        assert rec.status is RecordStatus.completed
        assert rec.by == "reconciler:fetch"
        told = model.told(rid)
        kit = await _kit_told(w.stores, odd_agent, turns)
    assert told == kit


# --- 5 and 6. worker processes SIGKILLed ---------------------------------------------------


class WorkerProc:
    """This module as a Temporal worker in an OS process of its own, ended by its pid."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, address: str, q: str, agent: str, script: str) -> WorkerProc:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "on_temporal.test_attacks_temporal_new_rules",
            address,
            q,
            agent,
            script,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
        except TimeoutError:
            line = b""
        if line.strip() != b"ready":
            proc.kill()
            _, err = await proc.communicate()
            raise AssertionError(f"the worker did not start: {line!r} {err.decode()[-2000:]}")
        return cls(proc)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()


SCRIPTS: dict[str, list[Any]] = {
    "bytes": [[("fetch", {"kind": "bytes_not_utf8"})], "done"],
    "dict": [[("fetch", {"kind": "dict_bytes_key"})], "done"],
    "book": [[("book", {"flight": "LH1"})], "done"],
}


class _Holding(AgentActivities):
    @activity.defn(name=TOOL_ACTIVITY)
    async def tool_call(self, call: ToolInput) -> ToolResult:
        result = await super().tool_call(call)
        if (_world() / "hold_reply").exists():
            (_world() / "entered").write_text("hold_reply")
            await asyncio.to_thread(_wait_while, _world() / "hold_reply")
        return result


async def _serve(address: str, q: str, agent_attr: str, script: str) -> None:
    from datetime import timedelta

    from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

    agent = globals()[agent_attr]
    client = await Client.connect(address)
    async with await world_stores(_world()) as stores:
        acts = _Holding(fast_runner(Told(SCRIPTS[script]), stores), [agent], heartbeat_every=0.3)
        worker = Worker(
            client,
            task_queue=q,
            workflows=[AgentWorkflow],
            activities=[acts.model_turn, acts.tool_call],
            sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
            workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(2),
            activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1),
        )
        async with worker:
            print("ready", flush=True)
            await asyncio.Event().wait()


# Each point of death once in CI, on one of the two results; every pair with ADK_SLOW=1.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("script", "hold"),
    [
        ("bytes", "hold_reply"),
        ("dict", "hold_after"),
        ("bytes", "hold_before"),
        pytest.param("dict", "hold_reply", marks=_SLOW),
        pytest.param("bytes", "hold_after", marks=_SLOW),
        pytest.param("dict", "hold_before", marks=_SLOW),
    ],
)
async def test_a_worker_killed_inside_an_odd_result_call_makes_it_once_and_tells_it_alike(
    temporal_server: DevServer, tmp_path: Path, hold: str, script: str
) -> None:
    rid = run_id()
    q = queue()
    with in_world(tmp_path):
        async with await world_stores(tmp_path) as stores:
            kit = await _kit_told(stores, odd_agent, SCRIPTS[script])
        for f in _effects(tmp_path):
            assert f.startswith("fetch")
        (tmp_path / "effects.txt").unlink()
        (tmp_path / hold).touch()
        client = await Client.connect(temporal_server.address)
        first = await WorkerProc.start(temporal_server.address, q, "held_agent", script)
        try:
            handle = await start_run(
                client, held_agent, f"go {rid}", tenant=T, run_id=rid, task_queue=q, options=FAST
            )
            await wait_for_file(tmp_path / "entered")
        finally:
            await first.kill()
        (tmp_path / hold).unlink()
        second = await WorkerProc.start(temporal_server.address, q, "held_agent", script)
        try:
            outcome = await _result(handle, within=60)
        finally:
            await second.kill()
        assert getattr(outcome, "status", None) == "completed", _failure(outcome)
        assert len(_effects(tmp_path)) == 1, _effects(tmp_path)
        async with await world_stores(tmp_path) as stores:
            runner = AgentRunner.from_stores(ScriptedProvider(SCRIPTS[script]), stores)
            assert runner.checkpoints is not None
            cp = await runner.checkpoints.latest(T, rid)
            assert cp is not None
            transcript = await runner.checkpoints.messages(cp)
        told = [m.text for m in transcript if m.role is Role.tool]
    assert told == kit


async def _pending(stores: Stores, rid: str) -> str:
    runner = AgentRunner.from_stores(ScriptedProvider([]), stores)
    assert runner.checkpoints is not None
    async with asyncio.timeout(30):
        while True:
            cp = await runner.checkpoints.latest(T, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("kill", ["before_approve", "inside_the_call"])
async def test_an_approval_decided_by_the_cli_around_a_sigkilled_worker_books_at_most_once(
    temporal_server: DevServer, tmp_path: Path, kill: str
) -> None:
    rid = run_id()
    q = queue()
    url = store_url(tmp_path)
    with in_world(tmp_path):
        async with await world_stores(tmp_path) as stores:
            client = await Client.connect(temporal_server.address)
            first = await WorkerProc.start(temporal_server.address, q, "approval_agent", "book")
            try:
                handle = await start_run(
                    client,
                    approval_agent,
                    f"go {rid}",
                    tenant=T,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.2,
                )
                request = await _pending(stores, rid)
                if kill == "before_approve":
                    await first.kill()
                else:
                    (tmp_path / "hold_before").touch()
                approved = await tesserix(
                    "approve", request, "--tenant", T, "--by", "ops", "--store", url
                )
                assert approved.returncode == 0, approved.stderr
                if kill == "inside_the_call":
                    await wait_for_file(tmp_path / "entered")
            finally:
                await first.kill()
            (tmp_path / "hold_before").unlink(missing_ok=True)
            second = await WorkerProc.start(temporal_server.address, q, "approval_agent", "book")
            try:
                outcome = await _result(handle, within=60)
            finally:
                await second.kill()
    effects = _effects(tmp_path)
    if kill == "before_approve":
        assert getattr(outcome, "status", None) == "completed", _failure(outcome)
        assert len(effects) == 1, effects
    else:
        # Killed inside the call before the effect, with no reconciler: never guessed.
        assert isinstance(outcome, WorkflowFailureError), outcome
        assert "IndeterminateToolCallError" in _failure(outcome)
        assert effects == []
    shown = await tesserix("inspect", rid, "--tenant", T, "--store", url)
    assert shown.returncode == 0, shown.stderr


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]))
