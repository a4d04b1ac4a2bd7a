"""Attacks on lean frontiers (5bdd2a4): an observation entry the transcript holds word for
word is written as ``content_at`` (its position there) instead of a copy.

What must hold: what ``Checkpointer.observation``, a resume and a replay read back is what
an inline (redacted) copy would have given, on every backend, at every step, after a crash
at every boundary, from a replay and a replay of a replay; a secret never reaches a store
by the new path; a position that is not that call's result is corrupt (never read as
another's); a frontier stays the same size however long the run. Three defects found
here (an earlier turn's result of a reused id read as this one's, a mistyped error flag read
as given, named entries written as format 2 that the previous release read without them)
are fixed; their tests pass now.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Checkpoint,
    CheckpointStatus,
    decode_checkpoint,
    decode_message,
    encode_checkpoint,
    encode_message,
    resolve_observation,
    seal,
    unseal,
)
from tesserix_adk.checkpoint.payload.redacting import _redacted_observation
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, HistoryUnavailableError
from tesserix_adk.messages import Message, ToolCall, ToolOutcome
from tesserix_adk.providers.base import ModelResponse
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle, chained
from tesserix_adk.stores.urls import open_stores

T = "acme"
SECRET = "sk-proj-" + "Zx9Yw8Vu" * 6
SECRET2 = "ghp_" + "a1B2c3D4e5" * 4
RESULT = "seat is held until noon; fare class Y; " * 6


class Died(BaseException):
    """A crash: nothing in the kit catches it."""


# --- the world ----------------------------------------------------------------------------


class Shop:
    """Tools whose side effects are counted: a side-effecting call sent twice is a defect."""

    def __init__(self) -> None:
        self.held: list[str] = []

    def agent(self, *, approval: bool = False) -> Agent:
        @tool(requires_approval=approval)
        def hold(seat: str) -> str:
            """Hold a seat (side-effecting); the result carries a secret."""
            self.held.append(seat)
            return f"{RESULT}{seat} api key {SECRET}"

        @tool(side_effects=False)
        def look(q: str) -> dict[str, Any]:
            """Read (structured result: not held word for word in the transcript)."""
            return {"q": q, "token": SECRET2, "password": "hunter2-hunter2"}

        @tool(side_effects=False)
        def fail(q: str) -> str:
            """Always fails (an error result)."""
            raise RuntimeError(f"no such thing as {q}")

        @tool(side_effects=False)
        def same(q: str) -> str:
            """The same text every time (identical results across turns)."""
            return "ok"

        return Agent("shop", "Hold seats.", [hold, look, fail, same], parallel_tool_calls=3)


SCRIPT: list[Any] = [
    ScriptedTurn(calls=[("hold", {"seat": "12A"}), ("look", {"q": "a"}), ("same", {"q": "x"})]),
    ScriptedTurn(calls=[("fail", {"q": "b"}), ("hold", {"seat": "12B"}), ("same", {"q": "y"})]),
    ScriptedTurn(calls=[("hold", {"seat": "12C"})]),
    ScriptedTurn(calls=[("same", {"q": "z"}), ("same", {"q": "w"})]),
    "done",
]
SEATS = ["12A", "12B", "12C"]


class ReusingIds(ScriptedProvider):
    """A provider that numbers calls per turn (``call_0`` every turn), as some do."""

    async def complete(self, request: Any) -> ModelResponse:
        r = await super().complete(request)
        calls = [
            ToolCall(id=f"call_{j}", name=c.name, arguments=dict(c.arguments))
            for j, c in enumerate(r.message.tool_calls)
        ]
        return ModelResponse(message=Message.assistant(r.message.text, calls), usage=r.usage)


Oracle = dict[tuple[str, int], Any]


def watch(runner: AgentRunner, oracle: Oracle, *, die_after: int | None = None) -> None:
    """Record, for each frontier the store took, its observation as an inline copy would
    have stored it (redacted, through JSON); ``die_after``: crash after that many."""
    checkpoints = runner.checkpoints
    assert checkpoints is not None
    write = checkpoints.write
    written = 0

    async def watched(frontier: Checkpoint, *, cursor: Any, off_loop: Any = None) -> bool:
        nonlocal written
        ok = await write(frontier, cursor=cursor, off_loop=off_loop)
        if ok:
            inline = _redacted_observation(frontier.observation, checkpoints.redactor)
            oracle[(frontier.run_id, frontier.step)] = json.loads(json.dumps(inline))
            written += 1
            if die_after is not None and written == die_after:
                raise Died
        return ok

    checkpoints.write = watched  # type: ignore[method-assign]


async def read_back(checkpoints: Checkpointer, run_id: str) -> dict[int, Any]:
    seen = {}
    for step in await checkpoints.steps(T, run_id):
        snap = await checkpoints.at(T, run_id, step)
        assert snap is not None
        seen[step] = await checkpoints.observation(snap)
    latest = await checkpoints.latest(T, run_id)
    assert latest is not None
    seen[latest.step] = await checkpoints.observation(latest)
    return seen


def expected(oracle: Oracle, run_id: str) -> dict[int, Any]:
    return {step: obs for (rid, step), obs in oracle.items() if rid == run_id}


async def stored_bytes(stores: Stores, run_id: str) -> bytes:
    blobs: list[bytes] = []
    for step in await raw(stores).steps(T, run_id):
        snap = await raw(stores).at(T, run_id, step)
        if snap is not None:
            blobs.append(snap.payload)
    latest = await stores.checkpoints.latest(T, run_id)
    if latest is not None:
        blobs.append(latest.payload)
    frontier = await Checkpointer.from_stores(stores).latest(T, run_id)
    if frontier is not None and frontier.history_handle is not None:
        blobs += await stores.history.fetch(frontier.history_handle)
    return b"\n".join(blobs)


def raw(stores: Stores) -> Any:
    """The checkpoint store with its step history (every backend here keeps one)."""
    return stores.checkpoints


def named(payload: bytes) -> list[int]:
    body, _ = unseal(payload, what="test")
    obs = body.get("observation")
    if not isinstance(obs, list):
        return []
    return [e["content_at"] for e in obs if isinstance(e, dict) and "content_at" in e]


# --- backends -----------------------------------------------------------------------------


_TESTS = str(Path(__file__).resolve().parents[1])


@contextlib.asynccontextmanager
async def backend(kind: str, tmp_path: Path) -> AsyncIterator[Stores]:
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    services: Any = importlib.import_module("adapters.services")

    if kind == "memory":
        stores = open_stores("memory://")
        try:
            yield stores
        finally:
            await stores.aclose()
    elif kind == "sqlite":
        os.makedirs(tmp_path, exist_ok=True)
        stores = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
        await stores.create_schema()
        try:
            yield stores
        finally:
            await stores.aclose()
    elif kind == "redis":
        async with services.redis_stores() as stores:
            yield stores
    else:
        async with services.postgres_stores() as stores:
            yield stores


BACKENDS = ["memory", "sqlite", "redis", "postgres"]


# --- what holds: real runs ----------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
async def test_every_step_reads_back_its_inline_copy_replays_and_keeps_secrets(
    kind: str, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    oracle: Oracle = {}
    async with backend(kind, tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        watch(runner, oracle)
        run = await runner.run(agent, "go", tenant=T, run_id="r")
        assert run.status == "completed"
        assert shop.held == SEATS
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        assert await read_back(checkpoints, "r") == expected(oracle, "r")
        # The lean path was taken: str results are named, not copied.
        payloads = [(await raw(stores).at(T, "r", s)) for s in await raw(stores).steps(T, "r")]
        assert any(named(p.payload) for p in payloads if p is not None)
        assert RESULT.encode() not in b"".join(p.payload for p in payloads if p is not None)
        blob = await stored_bytes(stores, "r")
        assert SECRET.encode() not in blob and SECRET2.encode() not in blob

        # Replay from every step, and a replay of each replay from its first step.
        stub_calls: list[str] = []

        def stub(seat: str) -> str:
            stub_calls.append(seat)
            return f"stubbed {seat}"

        steps = await checkpoints.steps(T, "r")
        for step in steps:
            snap = await checkpoints.at(T, "r", step)
            assert snap is not None
            replayed = await runner.replay(
                agent, "r", tenant=T, from_step=step, stubs={"hold": stub}, new_run_id=f"x{step}"
            )
            if snap.status.finished:
                continue
            assert replayed.status == "completed"
            assert await read_back(checkpoints, f"x{step}") == expected(oracle, f"x{step}")
            if snap.boundary is Boundary.after_tool_result:
                # The replay's first frontier (after its model call) observes the step's turn.
                first = min(s for (rid, s) in oracle if rid == f"x{step}")
                assert oracle[(f"x{step}", first)] == oracle[("r", step)]
            again_from = (await checkpoints.steps(T, f"x{step}"))[0]
            again = await checkpoints.at(T, f"x{step}", again_from)
            assert again is not None
            if again.status.finished:
                continue
            twice = await runner.replay(
                agent,
                f"x{step}",
                tenant=T,
                from_step=again_from,
                stubs={"hold": stub},
                new_run_id=f"y{step}",
            )
            assert twice.status == "completed"
            assert await read_back(checkpoints, f"y{step}") == expected(oracle, f"y{step}")
        assert shop.held == SEATS  # replays never reached the real tool


async def _crash_and_resume(
    stores: Stores,
    die_after: int,
    *,
    provider: type[ScriptedProvider] = ScriptedProvider,
    group_writes: bool = False,
) -> None:
    shop = Shop()
    agent = shop.agent()
    oracle: Oracle = {}
    first = AgentRunner.from_stores(provider(SCRIPT), stores, group_writes=group_writes)
    watch(first, oracle, die_after=die_after)
    with pytest.raises(Died):
        await first.run(agent, "go", tenant=T, run_id="r")
    second = AgentRunner.from_stores(provider(SCRIPT), stores, group_writes=group_writes)
    watch(second, oracle)
    run = await second.resume(agent, "r", tenant=T)
    assert run.status == "completed"
    assert shop.held == SEATS, f"crash after frontier {die_after}: held {shop.held}"
    checkpoints = second.checkpoints
    assert checkpoints is not None
    assert await read_back(checkpoints, "r") == expected(oracle, "r")
    blob = await stored_bytes(stores, "r")
    assert SECRET.encode() not in blob and SECRET2.encode() not in blob


@pytest.mark.parametrize("die_after", range(1, 10))
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_crash_after_every_frontier_resumes_to_the_same_observations(
    kind: str, die_after: int, tmp_path: Path
) -> None:
    async with backend(kind, tmp_path) as stores:
        await _crash_and_resume(stores, die_after)


@pytest.mark.parametrize("kind", ["redis", "postgres"])
async def test_a_crash_mid_run_resumes_to_the_same_observations_on_servers(
    kind: str, tmp_path: Path
) -> None:
    for die_after in (2, 5):
        async with backend(kind, tmp_path) as stores:
            await _crash_and_resume(stores, die_after)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_grouped_writes_name_and_resume_the_same(kind: str, tmp_path: Path) -> None:
    for die_after in (2, 3, 6):
        async with backend(kind, tmp_path / str(die_after)) as stores:
            await _crash_and_resume(stores, die_after, group_writes=True)


@pytest.mark.parametrize("die_after", [2, 3, 4, 5, 6])
async def test_call_ids_reused_every_turn_read_back_their_own_turn(
    die_after: int, tmp_path: Path
) -> None:
    async with backend("sqlite", tmp_path) as stores:
        await _crash_and_resume(stores, die_after, provider=ReusingIds)


# --- approvals, cancellation, an accepted revision ----------------------------------------

APPROVAL_SCRIPT: list[Any] = [
    ScriptedTurn(calls=[("same", {"q": "x"}), ("fail", {"q": "b"})]),
    ScriptedTurn(calls=[("hold", {"seat": "12A"}), ("same", {"q": "y"})]),
    ScriptedTurn(calls=[("same", {"q": "z"})]),
    "done",
]


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis", "postgres"])
async def test_a_before_approval_frontier_names_the_turn_before_and_resumes(
    kind: str, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent(approval=True)
    oracle: Oracle = {}
    async with backend(kind, tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(APPROVAL_SCRIPT), stores)
        watch(runner, oracle)
        waiting = await runner.run(agent, "go", tenant=T, run_id="r")
        assert waiting.pending_approval is not None and shop.held == []
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        latest = await checkpoints.latest(T, "r")
        assert latest is not None and latest.boundary is Boundary.before_approval
        assert named((await raw(stores).latest(T, "r")).payload)
        assert await checkpoints.observation(latest) == oracle[("r", latest.step)]
        assert [e["call_id"] for e in await checkpoints.observation(latest)] == [
            "call_0_0",
            "call_0_1",
        ]
        await stores.approvals.decide(T, waiting.pending_approval.id, approved=True, by="ops")
        again = AgentRunner.from_stores(ScriptedProvider(APPROVAL_SCRIPT), stores)
        watch(again, oracle)
        assert (await again.resume(agent, "r", tenant=T)).status == "completed"
        assert shop.held == ["12A"]
        assert await read_back(checkpoints, "r") == expected(oracle, "r")


@pytest.mark.parametrize("die_after", [2, 3, 4, 5])
async def test_a_cancelled_frontier_carries_the_observation_it_was_cancelled_at(
    die_after: int, tmp_path: Path
) -> None:
    async with backend("sqlite", tmp_path) as stores:
        shop = Shop()
        oracle: Oracle = {}
        runner = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        watch(runner, oracle, die_after=die_after)
        with pytest.raises(Died):
            await runner.run(shop.agent(), "go", tenant=T, run_id="r")
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        before = await checkpoints.latest(T, "r")
        assert before is not None
        fresh = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        ended = await fresh.cancel("r", tenant=T, by="ops", reason="stop")
        assert ended is not None and ended.status == "cancelled"
        after = await checkpoints.latest(T, "r")
        assert after is not None and after.status is CheckpointStatus.cancelled
        assert await checkpoints.observation(after) == oracle[("r", before.step)]
        # A second resume of the cancelled run changes nothing and sends nothing.
        held = list(shop.held)
        await fresh.resume(shop.agent(), "r", tenant=T)
        assert shop.held == held


@pytest.mark.parametrize("die_after", [2, 3])
async def test_an_accepted_revision_carries_the_observation_and_resumes(
    die_after: int, tmp_path: Path
) -> None:
    from tesserix_adk.run.upgrade import accept_revision

    async with backend("sqlite", tmp_path) as stores:
        shop = Shop()
        oracle: Oracle = {}
        runner = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        watch(runner, oracle, die_after=die_after)
        with pytest.raises(Died):
            await runner.run(shop.agent(), "go", tenant=T, run_id="r")
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        before = await checkpoints.latest(T, "r")
        assert before is not None
        old = shop.agent()
        changed = Agent(
            "shop", "Hold seats, politely.", list(old.tools.values()), parallel_tool_calls=3
        )
        assert changed.revision != old.revision
        fresh = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        assert await accept_revision(fresh, changed, "r", tenant=T, by="ops") is not None
        after = await checkpoints.latest(T, "r")
        assert after is not None and after.step == before.step + 1
        assert await checkpoints.observation(after) == oracle[("r", before.step)]
        watch(fresh, oracle)
        assert (await fresh.resume(changed, "r", tenant=T)).status == "completed"
        assert shop.held == SEATS
        assert {
            s: o for s, o in (await read_back(checkpoints, "r")).items() if s != after.step
        } == expected(oracle, "r")


# --- crafted payloads (valid checksums: sha256 is no MAC) ---------------------------------


def _resealed(payload: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    body, _ = unseal(payload, what="test")
    change(body)
    return seal(body)


async def _reused_ids_run(stores: Stores) -> AgentRunner:
    """A completed run whose provider numbers calls ``call_0`` every turn; ``hold`` results
    differ by seat (turn 0: 12A at position 2, turn 1: 12B, turn 2: 12C)."""
    script: list[Any] = [[("hold", {"seat": s})] for s in SEATS] + ["done"]
    runner = AgentRunner.from_stores(ReusingIds(script), stores)
    assert (await runner.run(Shop().agent(), "go", tenant=T, run_id="r")).status == "completed"
    return runner


async def _last_after_tool_result(runner: AgentRunner, stores: Stores) -> tuple[bytes, int]:
    checkpoints = runner.checkpoints
    assert checkpoints is not None
    for step in reversed(await checkpoints.steps(T, "r")):
        cp = await checkpoints.at(T, "r", step)
        if cp is not None and cp.boundary is Boundary.after_tool_result:
            stored = await raw(stores).at(T, "r", step)
            assert stored is not None
            return stored.payload, step
    raise AssertionError("no after_tool_result step")


async def test_reused_call_ids_each_turn_read_back_as_their_own_turn(tmp_path: Path) -> None:
    async with backend("memory", tmp_path) as stores:
        runner = await _reused_ids_run(stores)
        payload, _ = await _last_after_tool_result(runner, stores)
        assert named(payload) == [6]
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        (entry,) = await checkpoints.observation(decode_checkpoint(payload, tenant=T, run_id="r"))
        assert entry["call_id"] == "call_0" and "12C" in entry["content"]


async def test_a_position_at_an_earlier_turns_result_of_a_reused_id_is_corrupt(
    tmp_path: Path,
) -> None:
    async with backend("memory", tmp_path) as stores:
        runner = await _reused_ids_run(stores)
        payload, _ = await _last_after_tool_result(runner, stores)
        # Turn 0's result of ``call_0`` (seat 12A) instead of turn 2's (12C).
        bad = _resealed(payload, lambda b: b["observation"][0].update(content_at=2))
        cp = decode_checkpoint(bad, tenant=T, run_id="r")
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        # Not another call's result read under this call's name.
        with pytest.raises(CheckpointCorruptError, match="observation"):
            await checkpoints.observation(cp)


def test_a_named_entry_whose_error_flag_is_not_a_bool_is_corrupt() -> None:
    messages = [
        Message.user("go"),
        Message.assistant("", [ToolCall(id="c1", name="hold", arguments={})]),
        Message.tool_result(ToolOutcome(call_id="c1", content=RESULT, is_error=True)),
    ]
    redactor = Redactor()
    entries = [encode_message(m, redactor) for m in messages]
    handle = HistoryHandle(
        tenant=T, run_id="r", count=3, digest=chained(EMPTY_HISTORY_DIGEST, entries)
    )
    frontier = Checkpoint(
        tenant=T,
        run_id="r",
        agent_name="a",
        step=3,
        boundary=Boundary.after_tool_result,
        status=CheckpointStatus.running,
        iteration=1,
        fence=1,
        messages=tuple(messages),
        observation=[{"call_id": "c1", "tool": "hold", "content": RESULT, "is_error": True}],
    )
    payload = encode_checkpoint(frontier, redactor, history=handle)
    assert named(payload) == [2]
    bad = _resealed(payload, lambda b: b["observation"][0].update(is_error=1))
    read = [decode_message(e) for e in entries]
    with pytest.raises(CheckpointCorruptError, match="observation"):
        cp = decode_checkpoint(bad, tenant=T, run_id="r")
        resolve_observation(cp.observation, read)


_MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "position-past-end": lambda e: e.update(content_at=10**6),
    "position-huge-int": lambda e: e.update(content_at=10**400),
    "position-list": lambda e: e.update(content_at=[6]),
    "position-dict": lambda e: e.update(content_at={"at": 6}),
    "position-negative": lambda e: e.update(content_at=-1),
    "position-of-assistant": lambda e: e.update(content_at=5),
    "position-of-user": lambda e: e.update(content_at=0),
    "call-id-list": lambda e: e.update(call_id=["call_0"]),
    "call-id-null": lambda e: e.update(call_id=None),
    "call-id-other": lambda e: e.update(call_id="call_9"),
    "error-flag-flipped": lambda e: e.update(is_error=True),
    "error-flag-null": lambda e: e.update(is_error=None),
    "missing-tool": lambda e: e.pop("tool"),
    "missing-call-id": lambda e: e.pop("call_id"),
    "extra-key": lambda e: e.update(extra=1),
    "content-too": lambda e: e.update(content="x"),
}


@pytest.mark.parametrize("mutation", sorted(_MUTATIONS))
async def test_a_crafted_named_entry_is_corrupt_on_every_reading_path(
    mutation: str, tmp_path: Path
) -> None:
    async with backend("memory", tmp_path) as stores:
        runner = await _reused_ids_run(stores)
        payload, step = await _last_after_tool_result(runner, stores)
        bad = _resealed(payload, lambda b: _MUTATIONS[mutation](b["observation"][0]))
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        try:
            cp = decode_checkpoint(bad, tenant=T, run_id="r")
        except CheckpointCorruptError:
            return
        with pytest.raises(CheckpointCorruptError):
            await checkpoints.observation(cp)
        # A resume from it (and a replay of it) refuses the same way, and sends nothing.
        fence: int = (await raw(stores).latest(T, "r")).fence
        await stores.checkpoints.put(T, "r", bad, step=step + 100, fence=fence)
        shop = Shop()
        with pytest.raises(CheckpointCorruptError):
            await runner.resume(shop.agent(), "r", tenant=T)
        await stores.checkpoints.put(T, "r", bad, step=step, fence=fence + 1)
        with pytest.raises(CheckpointCorruptError):
            await runner.replay(
                shop.agent(), "r", tenant=T, from_step=step, stubs={"hold": lambda seat: "s"}
            )
        assert shop.held == []


async def test_a_resume_from_a_frontier_whose_transcript_was_rewritten_refuses(
    tmp_path: Path,
) -> None:
    """A later snapshot names a transcript the history store no longer holds (the run went
    on from an earlier frontier, appending after it): its observation is refused with the
    transcript's error, never read from the entries now at its positions."""
    async with backend("memory", tmp_path) as stores:
        runner = await _reused_ids_run(stores)
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        payload, _ = await _last_after_tool_result(runner, stores)
        cp = decode_checkpoint(payload, tenant=T, run_id="r")
        assert cp.history_handle is not None
        # Rewind the history to 3 entries and append other ones in place of the rest.
        three = await stores.history.fetch(
            HistoryHandle(
                tenant=T,
                run_id="r",
                count=3,
                digest=chained(
                    EMPTY_HISTORY_DIGEST, (await stores.history.fetch(cp.history_handle))[:3]
                ),
            )
        )
        redactor = Redactor()
        base = HistoryHandle(
            tenant=T, run_id="r", count=3, digest=chained(EMPTY_HISTORY_DIGEST, three)
        )
        other = [
            Message.assistant("", [ToolCall(id="call_0", name="hold", arguments={"seat": "9Z"})]),
            Message.tool_result(ToolOutcome(call_id="call_0", content="other")),
            Message.assistant("", [ToolCall(id="call_0", name="hold", arguments={"seat": "9Y"})]),
            Message.tool_result(ToolOutcome(call_id="call_0", content="other 2")),
        ]
        await stores.history.append(
            T,
            "r",
            [encode_message(m, redactor) for m in other],
            fence=(await raw(stores).latest(T, "r")).fence,
            after=base,
        )
        with pytest.raises(HistoryUnavailableError):
            await checkpoints.observation(cp)


# --- secrets by the new path --------------------------------------------------------------


class SecretIds(ScriptedProvider):
    """A provider whose call ids look like keys (redaction masks them in an observation)."""

    async def complete(self, request: Any) -> ModelResponse:
        r = await super().complete(request)
        calls = [
            ToolCall(id=f"{SECRET}{j}", name=c.name, arguments=dict(c.arguments))
            for j, c in enumerate(r.message.tool_calls)
        ]
        return ModelResponse(message=Message.assistant(r.message.text, calls), usage=r.usage)


async def test_a_call_id_holding_a_secret_is_replaced_and_its_result_named(
    tmp_path: Path,
) -> None:
    """Ids holding a secret were once masked here, so the observation copied their results
    (two masked ids would name one result). Since the kit replaces such an id as the
    model's answer comes in (``run/screening.py``, a digest of it), no id holds a secret,
    and each result is named by position like any other."""
    async with backend("sqlite", tmp_path) as stores:
        shop = Shop()
        runner = AgentRunner.from_stores(
            SecretIds([[("hold", {"seat": "12A"}), ("same", {"q": "x"})], "done"]), stores
        )
        assert (await runner.run(shop.agent(), "go", tenant=T, run_id="r")).status == "completed"
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        observed = 0
        for step in await checkpoints.steps(T, "r"):
            snap = await checkpoints.at(T, "r", step)
            stored = await raw(stores).at(T, "r", step)
            assert snap is not None and stored is not None
            assert SECRET.encode() not in stored.payload
            if snap.observation is None:
                continue
            observed += 1
            assert len(named(stored.payload)) == 2
            read = await checkpoints.observation(snap)
            ids = [e["call_id"] for e in read]
            assert len(set(ids)) == 2 and all(i.startswith("call_masked_") for i in ids), ids
            assert "[redacted:" in read[0]["content"] and read[1]["content"] == "ok"
        assert observed


@pytest.mark.parametrize("redact", [True, False])
async def test_named_results_hold_what_the_transcript_holds_whatever_the_redaction(
    redact: bool, tmp_path: Path
) -> None:
    """With ``extra_patterns`` (or redaction off), a named entry reads back as the inline
    copy the same Checkpointer would have written."""
    async with backend("memory", tmp_path) as stores:
        oracle: Oracle = {}
        shop = Shop()
        runner = AgentRunner.from_stores(
            ScriptedProvider(SCRIPT), stores, redact=redact, extra_patterns=(r"fare class \w",)
        )
        watch(runner, oracle)
        assert (await runner.run(shop.agent(), "go", tenant=T, run_id="r")).status == "completed"
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        seen = await read_back(checkpoints, "r")
        assert seen == expected(oracle, "r")
        texts = json.dumps(seen)
        assert ("fare class Y" in texts) is not redact
        assert (SECRET in texts) is not redact


# --- size: a frontier does not grow with the run ------------------------------------------


async def test_a_frontier_stays_the_same_size_at_turn_200_as_at_turn_5(tmp_path: Path) -> None:
    turns = 200
    script: list[Any] = [[("hold", {"seat": f"{i:03d}"})] for i in range(turns)] + ["done"]
    async with backend("memory", tmp_path) as stores:
        shop = Shop()
        runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
        agent = Agent("shop", "Hold.", list(shop.agent().tools.values()), max_iterations=turns + 5)
        assert (await runner.run(agent, "go", tenant=T, run_id="r")).status == "completed"
        sizes = {}
        for step in await raw(stores).steps(T, "r"):
            stored = await raw(stores).at(T, "r", step)
            assert stored is not None
            body, _ = unseal(stored.payload, what="test")
            if body["boundary"] == "after_tool_result":
                assert named(stored.payload), step
                sizes[body["iteration"]] = len(stored.payload)
        early, late = sizes[5], sizes[turns - 1]
        assert late - early < 64, (early, late)  # a few digits more, never the transcript
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        latest = await checkpoints.latest(T, "r")
        assert latest is not None
        (entry,) = await checkpoints.observation(latest)
        assert entry["content"].startswith(RESULT) and f"{turns - 1:03d}" in entry["content"]


# --- mixed versions: the release before 5bdd2a4 (84713da) ---------------------------------

_PREVIOUS = "84713da"
_REPO = Path(__file__).resolve().parents[2]

_SHARED_AGENT = '''
import os
from typing import Any
from tesserix_adk import Agent, tool

SECRET = "sk-proj-" + "Zx9Yw8Vu" * 6
RESULT = "seat is held until noon; fare class Y; " * 6


def agent(log: str) -> Agent:
    @tool
    def hold(seat: str) -> str:
        """Hold a seat (side-effecting); the result carries a secret."""
        with open(log, "a") as f:
            f.write(seat + "\\n")
        return f"{RESULT}{seat} api key {SECRET}"

    @tool(side_effects=False)
    def same(q: str) -> str:
        """The same text every time."""
        return "ok"

    return Agent("mixed", "Hold seats.", [hold, same])


SCRIPT: list[Any] = [
    [("hold", {"seat": "12A"}), ("same", {"q": "x"})],
    [("hold", {"seat": "12B"})],
    [("hold", {"seat": "12C"})],
    "done",
]
'''


@pytest.fixture(scope="module")
def previous_kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source tree of the release before the change, extracted (read-only git)."""
    where = tmp_path_factory.mktemp("previous")
    try:
        archive = subprocess.run(
            ["git", "-C", str(_REPO), "archive", _PREVIOUS, "src"],
            check=True,
            capture_output=True,
            timeout=30,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"the previous release cannot be extracted: {exc}")
    return where / "src"


def _on_previous_kit(kit: Path, work: Path, code: str) -> str:
    (work / "shared_agent.py").write_text(_SHARED_AGENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(kit), str(work)])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(kit) in done.stdout.splitlines()[0], "the previous kit was not the one imported"
    return "\n".join(done.stdout.splitlines()[1:])


def _shared(work: Path) -> Any:
    import importlib.util

    (work / "shared_agent.py").write_text(_SHARED_AGENT)
    spec = importlib.util.spec_from_file_location("shared_agent_here", work / "shared_agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_a_run_the_previous_release_began_resumes_and_reads_back(
    previous_kit: Path, tmp_path: Path
) -> None:
    """Inline (format 2) observations the previous release wrote still read, and a resume
    on this release carries the run on: each seat held once, each step's observation whole."""
    db = tmp_path / "adk.sqlite3"
    log = tmp_path / "held.log"
    _on_previous_kit(
        previous_kit,
        tmp_path,
        f"""
        import asyncio, tesserix_adk
        print(tesserix_adk.__file__)
        from tesserix_adk import AgentRunner, ScriptedProvider
        from tesserix_adk.stores.urls import open_stores
        from shared_agent import SCRIPT, agent

        class Died(BaseException):
            pass

        class Dies(ScriptedProvider):
            async def complete(self, request):
                if sum(1 for m in request.messages if m.role == "assistant") == 2:
                    raise Died
                return await super().complete(request)

        async def main():
            stores = open_stores("sqlite:///{db}")
            await stores.create_schema()
            try:
                runner = AgentRunner.from_stores(Dies(SCRIPT), stores)
                try:
                    await runner.run(agent({str(log)!r}), "go", tenant="{T}", run_id="r")
                except Died:
                    pass
            finally:
                await stores.aclose()

        asyncio.run(main())
        """,
    )
    assert log.read_text().split() == ["12A", "12B"]
    shared = _shared(tmp_path)
    stores = open_stores(f"sqlite:///{db}")
    # The README's upgrade: `tesserix schema apply` migrates a store an earlier kit wrote
    # (a later schema version), keeping every row.
    await stores.create_schema()
    try:
        old_steps = await raw(stores).steps(T, "r")
        assert old_steps and not any(
            named(s.payload) for s in [await raw(stores).at(T, "r", x) for x in old_steps] if s
        )
        oracle: Oracle = {}
        runner = AgentRunner.from_stores(ScriptedProvider(shared.SCRIPT), stores)
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        for step in old_steps:
            snap = await checkpoints.at(T, "r", step)
            assert snap is not None
            oracle[("r", step)] = snap.observation
        watch(runner, oracle)
        agent = shared.agent(str(log))
        assert (await runner.resume(agent, "r", tenant=T)).status == "completed"
        assert log.read_text().split() == SEATS
        assert await read_back(checkpoints, "r") == expected(oracle, "r")
        new_steps = [s for s in await raw(stores).steps(T, "r") if s not in old_steps]
        assert any(
            named(s.payload) for s in [await raw(stores).at(T, "r", x) for x in new_steps] if s
        )
    finally:
        await stores.aclose()


async def test_the_previous_release_refuses_or_reads_whole_what_this_one_writes(
    previous_kit: Path, tmp_path: Path
) -> None:
    db = tmp_path / "adk.sqlite3"
    shared = _shared(tmp_path)
    stores = open_stores(f"sqlite:///{db}")
    await stores.create_schema()
    try:
        runner = AgentRunner.from_stores(ScriptedProvider(shared.SCRIPT), stores)
        run = await runner.run(shared.agent(str(tmp_path / "log")), "go", tenant=T, run_id="r")
        assert run.status == "completed"
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        here = await read_back(checkpoints, "r")
    finally:
        await stores.aclose()
    out = _on_previous_kit(
        previous_kit,
        tmp_path,
        f"""
        import asyncio, json, tesserix_adk
        print(tesserix_adk.__file__)
        from tesserix_adk.checkpoint.checkpointer import Checkpointer
        from tesserix_adk.errors import AdkError
        from tesserix_adk.stores.urls import open_stores

        async def main():
            stores = open_stores("sqlite:///{db}")
            c = Checkpointer.from_stores(stores)
            seen = {{}}
            try:
                for step in await c.steps("{T}", "r"):
                    try:
                        seen[step] = (await c.at("{T}", "r", step)).observation
                    except AdkError as exc:
                        seen[step] = "refused: " + type(exc).__name__
            except AdkError as exc:
                seen = {{"store": "refused: " + str(exc)}}
            finally:
                await stores.aclose()
            print(json.dumps(seen))

        asyncio.run(main())
        """,
    )
    seen = json.loads(out)
    if "store" in seen:
        # A store of a later schema version is refused whole, saying to upgrade the kit.
        assert seen["store"].startswith("refused: ") and "upgrade" in seen["store"], seen
        return
    there = {int(k): v for k, v in seen.items()}
    for step, observation in there.items():
        refused = isinstance(observation, str) and observation.startswith("refused: ")
        assert refused or observation == here[step], (step, observation, here[step])


# --- the Temporal path, its activities driven by hand (no server) -------------------------


async def test_temporal_activities_fold_name_and_restore_the_observation(tmp_path: Path) -> None:
    from tesserix_adk.temporal.shapes import ModelStep, StepKind, ToolInput
    from tesserix_adk.temporal.steps import model_turn, tool_call

    async with backend("sqlite", tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        oracle: Oracle = {}
        runner = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        watch(runner, oracle)

        def step(iteration: int, **more: Any) -> ModelStep:
            return ModelStep(
                tenant=T,
                run_id="r",
                agent_name=agent.name,
                agent_revision=agent.revision,
                iteration=iteration,
                **more,
            )

        result = await model_turn(runner, agent, step(0, input="go"), "h")
        iteration = 0
        while result.kind is StepKind.calls:
            # A retried model activity (its turn open): restores the frontier, names the
            # previous turn's results again, never asks the model twice.
            again = await model_turn(
                runner, agent, step(iteration, history=result.history), "h-retry"
            )
            assert again.kind is StepKind.calls and again.calls == result.calls
            results = [
                await tool_call(
                    runner,
                    agent,
                    ToolInput(
                        tenant=T,
                        run_id="r",
                        agent_name=agent.name,
                        agent_revision=agent.revision,
                        iteration=iteration,
                        call_id=c.call_id,
                    ),
                    "h",
                    retried=False,
                )
                for c in result.calls
            ]
            iteration += 1
            result = await model_turn(
                runner, agent, step(iteration, results=results, history=result.history), "h"
            )
        assert result.kind is StepKind.finished and result.status == "completed"
        assert shop.held == SEATS
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        assert await read_back(checkpoints, "r") == expected(oracle, "r")
        payloads = [await raw(stores).at(T, "r", s) for s in await checkpoints.steps(T, "r")]
        assert any(named(p.payload) for p in payloads if p is not None)
        blob = await stored_bytes(stores, "r")
        assert SECRET.encode() not in blob and SECRET2.encode() not in blob


# --- a transcript appended past the frontier (crash between the two writes) ---------------


@pytest.mark.parametrize("die_at_put", range(2, 10))
async def test_a_crash_between_the_transcript_append_and_the_frontier_rewinds_cleanly(
    die_at_put: int, tmp_path: Path
) -> None:
    """On memory stores the transcript is appended first, then the frontier put: a crash
    in between leaves entries past the frontier, which the resume appends over (``after``).
    Every position any kept step names still reads that step's own results."""
    async with backend("memory", tmp_path) as stores:
        puts = 0
        put = stores.checkpoints.put

        async def dying_put(*args: Any, **kwargs: Any) -> Any:
            nonlocal puts
            puts += 1
            if puts == die_at_put:
                raise Died
            return await put(*args, **kwargs)

        stores.checkpoints.put = dying_put  # type: ignore[method-assign]
        shop = Shop()
        agent = shop.agent()
        oracle: Oracle = {}
        first = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        watch(first, oracle)
        with pytest.raises(Died):
            await first.run(agent, "go", tenant=T, run_id="r")
        checkpoints = first.checkpoints
        assert checkpoints is not None
        latest = await checkpoints.latest(T, "r")
        assert latest is not None and latest.history_handle is not None
        kept = stores.history._runs[(T, "r")].items  # type: ignore[attr-defined]
        assert len(kept) > latest.history_handle.count  # entries past the frontier
        second = AgentRunner.from_stores(ScriptedProvider(SCRIPT), stores)
        watch(second, oracle)
        assert (await second.resume(agent, "r", tenant=T)).status == "completed"
        assert shop.held == SEATS
        assert await read_back(checkpoints, "r") == expected(oracle, "r")


# --- fuzz: any sealed observation decodes and resolves, or is corrupt ----------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FUZZ_MESSAGES = [
    Message.user("go"),
    Message.assistant("", [ToolCall(id="c1", name="hold", arguments={})]),
    Message.tool_result(ToolOutcome(call_id="c1", content="one")),
    Message.assistant("", [ToolCall(id="c2", name="hold", arguments={})]),
    Message.tool_result(ToolOutcome(call_id="c2", content="two", is_error=True)),
]
_FUZZ_REDACTOR = Redactor()
_FUZZ_ENTRIES = [encode_message(m, _FUZZ_REDACTOR) for m in _FUZZ_MESSAGES]
_FUZZ_READ = [decode_message(e) for e in _FUZZ_ENTRIES]
_FUZZ_PAYLOAD = encode_checkpoint(
    Checkpoint(
        tenant=T,
        run_id="r",
        agent_name="a",
        step=3,
        boundary=Boundary.after_tool_result,
        status=CheckpointStatus.running,
        iteration=1,
        fence=1,
        messages=tuple(_FUZZ_MESSAGES),
        observation=[{"call_id": "c2", "tool": "hold", "content": "two", "is_error": True}],
    ),
    _FUZZ_REDACTOR,
    history=HistoryHandle(
        tenant=T, run_id="r", count=5, digest=chained(EMPTY_HISTORY_DIGEST, _FUZZ_ENTRIES)
    ),
)

_scalar = st.none() | st.booleans() | st.integers(-3, 8) | st.sampled_from(["c1", "c2", "x", ""])
_json = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "content", "content_at"]), inner, max_size=2)
    ),
    max_leaves=6,
)
_entry = st.fixed_dictionaries(
    {"content_at": _scalar},
    optional={"call_id": _scalar, "tool": _json, "is_error": _scalar, "content": _json, "x": _json},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_entry | _json, max_size=4) | _json)
def test_any_sealed_observation_reads_as_the_transcript_or_is_corrupt(observation: Any) -> None:
    body, _ = unseal(_FUZZ_PAYLOAD, what="test")
    body["observation"] = observation
    try:
        cp = decode_checkpoint(seal(body), tenant=T, run_id="r")
        read = resolve_observation(cp.observation, _FUZZ_READ)
    except CheckpointCorruptError:
        return
    if not isinstance(observation, list):
        assert read == observation
        return
    for raw, got in zip(observation, read, strict=True):
        if isinstance(raw, dict) and "content_at" in raw:
            m = _FUZZ_READ[raw["content_at"]]
            assert m.tool_call_id == got["call_id"] and m.content == got["content"]
            assert got["is_error"] == m.is_error
        else:
            assert got == raw
