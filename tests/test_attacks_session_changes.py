"""This session's changes (a4e3fb8..HEAD), attacked end to end on SQLite in ``tmp_path``.

Attacked: ``run/result_data`` (dataclasses walked as the dict of their fields, deques and
iterators read once, ``_read_once``, ``_key_name``) and the one bounded walker
``checkpoint/payload/weighing.weighed`` behind ``text_weight``, ``_least_bytes`` and
``_items``, with container subclasses whose ``__iter__``/``items`` raise, cycles through
lists, endless iterators; ``AgentRunner.cancel`` of runs that ended (completed, failed,
tombstoned, a replay) and of one waiting for approval; ``run/ids.check_worker`` against the
names a ``Worker``, ``tesserix worker --worker`` and ``Resumer.resume`` take.

Found, and fixed (their tests pass now: the shared walker reads plain containers only, as the
three it replaced did; ``check_cancel_request`` before a cancel looks at the run):

* LOW ``test_one_odd_container_leaves_the_rest_of_the_result_json``: a list subclass whose
  ``__iter__`` raises, or a dict subclass whose ``items`` raises, anywhere in a result makes
  ``weighing.weighed`` (now reading subclasses by their own iteration) raise inside
  ``result_data._items``, so the whole result is written as one ``repr`` text, where
  a4e3fb8 wrote it as JSON (``{'rows': [1, 2, 3], 'odd': {'a': 1}}``).
* LOW ``test_a_too_long_by_is_refused_for_a_run_that_ended_too``: ``AgentRunner.cancel`` of a
  run that ended returns before ``request_cancel`` checks ``by``/``reason``, so a ``by`` past
  512 characters is accepted there (README: refused, ``ConfigurationError``).

Held: such odd containers' secrets stay masked in the SQLite bytes (the repr text is
redacted); a plain dataclass's ``password`` field and a deque's ``api_key`` are masked; a
generator that raises keeps its pages, says how it stopped, and a password in its error is
masked; the walkers stop on a cycle through lists; a list subclass whose ``__iter__`` raises
is not weighed light; cancel of a completed, failed or finished-replay run returns it and
records nothing, takes no lease; cancel of a run waiting for approval cancels it, recorded;
cancel of a tombstoned run raises ``CheckpointTooLargeError`` with the request recorded; a
cancel racing a run inside a keyed tool returns ``None`` and the run ends cancelled, the call
made once; worker names the CLI's ``_named`` accepts (512 bytes, non-ASCII, ``replay``,
``tesserix-cancel``) are accepted by ``AgentRunner``; NUL and surrogate names are refused
(``Resumer.resume`` too, no lease taken); ``worker=""`` is now refused (it used to mean
``"worker"``), a ``ConfigurationError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, tool
from tesserix_adk.checkpoint.checkpointer import OFF_LOOP_BYTES, text_weight
from tesserix_adk.checkpoint.payload import decode_outcome
from tesserix_adk.checkpoint.payload.weighing import weighed
from tesserix_adk.errors import CheckpointTooLargeError, ConfigurationError, ProviderError
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.result_data import result_content
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores

T = "sess"
PW = "hunter2-zq8w-plain"


def _sqlite_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(tmp_path.glob("adk.sqlite3*")))


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


async def run_on_sqlite(tmp_path: Path, make: Any) -> tuple[Any, Any, bytes]:
    """One run whose one keyed call returns ``make()``: the run, the record's content and
    the SQLite file's bytes."""

    @tool(key=lambda **kw: "fetch-1")
    def fetch(what: str) -> Any:
        """Fetch a thing (a side effect, keyed)."""
        return make()

    provider = ScriptedProvider([[("fetch", {"what": "x"})], "ok"])
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(provider, stores)
        run = await runner.run(Agent("a", "x", [fetch]), "go", tenant=T, run_id="r")
        [rec] = list(await stores.idempotency.records(T, "r"))
        assert rec.status is RecordStatus.completed
        content = decode_outcome(rec.outcome, "c").content
    return run, content, _sqlite_bytes(tmp_path)


# --- container subclasses a walker reads otherwise than pydantic --------------------------


class ItemsRaise(dict):
    """A dict subclass whose ``items`` refuses (a lazy or guarded mapping)."""

    def items(self) -> Any:
        raise RuntimeError("items() is not available here")


class IterRaise(list):
    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("iteration is not available here")


async def test_a_dict_subclass_whose_items_raise_keeps_its_password_masked(
    tmp_path: Path,
) -> None:
    run, content, raw = await run_on_sqlite(
        tmp_path, lambda: {"rows": [1, 2], "conn": ItemsRaise(password=PW, user="u")}
    )
    assert run.status is RunStatus.completed
    assert PW.encode() not in raw, content


async def test_a_list_subclass_whose_iter_raises_keeps_a_password_beside_it_masked(
    tmp_path: Path,
) -> None:
    run, content, raw = await run_on_sqlite(
        tmp_path, lambda: {"password": PW, "rows": IterRaise([1, 2])}
    )
    assert run.status is RunStatus.completed
    assert PW.encode() not in raw, content


@pytest.mark.parametrize("odd", [ItemsRaise(a=1), IterRaise([1])], ids=["items", "iter"])
def test_one_odd_container_leaves_the_rest_of_the_result_json(odd: Any) -> None:
    out = result_content({"rows": [1, 2, 3], "odd": odd})
    assert isinstance(out, dict) and out["rows"] == [1, 2, 3], out


async def test_a_plain_dataclass_field_named_password_is_masked_in_sqlite(
    tmp_path: Path,
) -> None:
    @dataclasses.dataclass
    class Conn:
        user: str
        password: str
        more: Any = None

    run, content, raw = await run_on_sqlite(
        tmp_path, lambda: Conn("u", PW, deque([{"api_key": PW + "-k"}]))
    )
    assert run.status is RunStatus.completed
    assert PW.encode() not in raw
    assert content["user"] == "u" and content["password"] != PW


async def test_a_generator_that_raises_keeps_its_pages_and_masks_them(tmp_path: Path) -> None:
    def pages() -> Iterator[Any]:
        yield {"page": 1, "token": PW}
        yield {"page": 2}
        raise ConnectionError(f"page 3 failed: GET /p?password={PW}")

    run, content, raw = await run_on_sqlite(tmp_path, pages)
    assert run.status is RunStatus.completed
    assert PW.encode() not in raw
    assert [p["page"] for p in content[:2]] == [1, 2]
    assert "ConnectionError: page 3 failed" in content[2] and PW not in content[2]


def test_a_cycle_through_lists_is_written_and_the_walkers_stop() -> None:
    a: list[Any] = [1]
    a.append(a)
    assert weighed(a, lambda _: 1, past=100) > 100  # bounded, not endless
    assert text_weight(a) > OFF_LOOP_BYTES


def test_weighing_a_list_subclass_whose_iter_raises_does_not_undercount() -> None:
    """A value the walker cannot read is not weighed as light (it would be redacted on the
    event loop): it either counts as heavy, or the walk says so by raising."""
    big = IterRaise(["x" * 1000] * 100)
    try:
        w = text_weight(big)
    except RuntimeError:
        return
    assert w > OFF_LOOP_BYTES, w


# --- cancel of a run that ended -----------------------------------------------------------


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


@tool(requires_approval=True, key=lambda **kw: "pay-1")
def pay(amount: int) -> str:
    """Pay (needs approval)."""
    return "paid"


async def test_cancel_of_a_completed_run_records_nothing_and_takes_no_lease(
    tmp_path: Path,
) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores)
        await runner.run(Agent("a", "x", [echo]), "go", tenant=T, run_id="r")
        run = await runner.cancel("r", tenant=T, by="ops", reason="late")
        assert run is not None and run.status is RunStatus.completed
        assert await cancel_requested(stores.idempotency, T, "r") is None
        assert await stores.leases.current(T, "r") is None
        again = await runner.resume(Agent("a", "x", [echo]), "r", tenant=T)
        assert again.status is RunStatus.completed


async def test_a_too_long_by_is_refused_for_a_run_that_ended_too(tmp_path: Path) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider(["done", "done"]), stores)
        await runner.run(Agent("a", "x", [echo]), "go", tenant=T, run_id="r")
        with pytest.raises(ConfigurationError):
            await runner.cancel("nobody", tenant=T, by="b" * 600)  # the rule, where it applies
        with pytest.raises(ConfigurationError):
            await runner.cancel("r", tenant=T, by="b" * 600, reason="r" * 60_000)


async def test_cancel_of_a_run_waiting_for_approval_cancels_it(tmp_path: Path) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        agent = Agent("a", "x", [pay])
        runner = AgentRunner.from_stores(ScriptedProvider([[("pay", {"amount": 3})], "ok"]), stores)
        waiting = await runner.run(agent, "go", tenant=T, run_id="r")
        assert waiting.status is RunStatus.waiting_approval
        run = await runner.cancel("r", tenant=T, by="ops", reason="no")
        assert run is not None and run.status is RunStatus.cancelled
        req = await cancel_requested(stores.idempotency, T, "r")
        assert req is not None and req.by == "ops"
        again = await runner.resume(agent, "r", tenant=T)
        assert again.status is RunStatus.cancelled


async def test_cancel_of_a_failed_run_records_nothing(tmp_path: Path) -> None:
    class Boom:
        async def complete(self, request: Any) -> Any:
            raise ProviderError("bad request: model refused", retryable=False)

    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(Boom(), stores)
        try:
            first = await runner.run(Agent("a", "x", [echo]), "go", tenant=T, run_id="r")
        except Exception:
            first = None
        cp = await runner.checkpoints.latest(T, "r")
        if cp is None or not cp.status.finished:
            pytest.skip(f"no failed frontier here ({first})")
        run = await runner.cancel("r", tenant=T, by="ops")
        assert run is not None and run.status.value == cp.status.value
        assert await cancel_requested(stores.idempotency, T, "r") is None


async def test_cancel_of_a_finished_replay_records_nothing(tmp_path: Path) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        agent = Agent("a", "x", [echo])
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("echo", {"text": "hi"})], "ok", [("echo", {"text": "hi"})], "ok"]),
            stores,
        )
        await runner.run(agent, "go", tenant=T, run_id="r")
        rep = await runner.replay(
            agent, "r", tenant=T, from_step=1, stubs={"echo": lambda text: text}, new_run_id="rep"
        )
        assert rep.status is RunStatus.completed
        run = await runner.cancel("rep", tenant=T, by="ops")
        assert run is not None and run.status is RunStatus.completed
        assert await cancel_requested(stores.idempotency, T, "rep") is None
        assert await cancel_requested(stores.idempotency, T, "r") is None


async def test_cancel_of_a_tombstoned_run_is_recorded_and_says_so(tmp_path: Path) -> None:
    @tool
    def report(size: int) -> str:
        """A report too large for any frontier."""
        return "R" * size

    agent = Agent("a", "x", [report])
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("report", {"size": 30_000})], "Done."]), stores, max_bytes=20_000
        )
        await runner.run(agent, "go", tenant=T, run_id="r")
        cp = await runner.checkpoints.latest(T, "r")
        assert cp is not None and cp.is_tombstone
        with pytest.raises(CheckpointTooLargeError):
            await runner.cancel("r", tenant=T, by="ops")
        assert await cancel_requested(stores.idempotency, T, "r") is not None
        assert await stores.leases.current(T, "r") is None


async def test_cancel_racing_a_run_in_a_tool_cancels_it_and_the_call_is_made_once(
    tmp_path: Path,
) -> None:
    entered, go = asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    @tool(key=lambda **kw: "send-1")
    async def send(text: str) -> str:
        """Send (a side effect)."""
        sent.append(text)
        entered.set()
        await go.wait()
        return "sent"

    agent = Agent("a", "x", [send])
    turns: list[Any] = [[("send", {"text": "hi"})], [("send", {"text": "again"})], "ok"]
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        task = asyncio.create_task(runner.run(agent, "go", tenant=T, run_id="r"))
        await entered.wait()
        other = AgentRunner.from_stores(ScriptedProvider([]), stores, worker="ops-console")
        assert await other.cancel("r", tenant=T, by="ops") is None  # the holder will
        go.set()
        run = await task
        assert run.status is RunStatus.cancelled
        assert sent == ["hi"]
        again = await other.cancel("r", tenant=T, by="ops2")
        assert again is not None and again.status is RunStatus.cancelled
        req = await cancel_requested(stores.idempotency, T, "r")
        assert req is not None and req.by == "ops"


# --- worker names -------------------------------------------------------------------------


async def test_worker_names_the_cli_and_workers_take_are_accepted(tmp_path: Path) -> None:
    from tesserix_adk.cli.commands import _named
    from tesserix_adk.resumer import Resumer

    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        with pytest.raises(ConfigurationError):
            AgentRunner.from_stores(ScriptedProvider(["x"]), stores, worker="")  # was "worker"
        for name in ["laptop", "web-1", "héllo wörld", "a" * 512, "tesserix-cancel", "replay"]:
            assert _named(name) == name
            AgentRunner.from_stores(ScriptedProvider(["x"]), stores, worker=name)
        AgentRunner.from_stores(ScriptedProvider(["x"]), stores)  # the default, "worker"
        with pytest.raises(ConfigurationError):
            AgentRunner.from_stores(ScriptedProvider(["x"]), stores, worker="a\x00b")
        with pytest.raises(ConfigurationError):
            await Resumer.from_stores(stores).resume("r", tenant=T, worker="\ud800")
        assert await stores.leases.current(T, "r") is None
