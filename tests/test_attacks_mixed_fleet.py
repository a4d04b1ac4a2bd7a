"""An attack on a rolling deploy across 3dfdbc7 (a recorded outcome names its record,
format 3): workers and CLIs of the kit before it (``a576b4c``, imported beside the current
one by ``tests/archived.py`` as ``tesserix_adk_old_fleet``) and of this one share ONE SQLite
file, each with its own stores, agent and model built from its own kit.

The oracle: each business key's side effect at most once; every refusal typed (an exit code
the README names and one sentence, or a kit's own error type); no run lost (carried on by a
worker, or listed by ``tesserix runs --stuck``); a newer payload the old kit meets is left
byte for byte as it was.

Defects, found as strict xfails and fixed (markers removed): an old worker that meets a
format-3 payload (an outcome a new worker recorded, a resolution or a cancel the new CLI
recorded) parks the run ``CheckpointFormatError``, and no worker of this kit took a parked
run, so it waited for a person (``run --resume`` by hand) though this kit reads it, and a
cancel the new CLI asked was not carried out. A worker of this kit now wakes, as it starts,
the runs of its agents parked for a format (``Parking._wake_parked``).

Held: both releases open the file and share the agent revision; the old kit refuses with
its typed error, writes nothing over the records, sends nothing twice, and the run is listed
by ``runs --stuck`` and carried once by hand (or at once by a new worker when the old
refusal was an in-process resume, not a worker's park); format-2 outcomes, cancels and
in-doubt parks of the old kit are read by the new one; a new ``resolve`` of an old claim
wakes a new run parked on it; the old CLI on new records exits typed and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import io
import json
import sqlite3
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from archived import archived

T = "acme"
TTL = 0.3
OLD_COMMIT = "a576b4c"
OLD_NAME = "tesserix_adk_old_fleet"
EXIT_CODES = {0, 1, 3, 4}


class Died(BaseException):
    """The process carrying the attempt died here: nothing after it runs."""


def _business_key(*, tool: str, arguments: dict[str, Any], **_: Any) -> str:
    return f"{tool}-{arguments['key']}"


def _key(business: str) -> str:
    return f"{T}/{business}"


class World:
    """The outside systems: effects per business key, and a fault per business key."""

    def __init__(self) -> None:
        self.effects: Counter[str] = Counter()
        self.faults: dict[str, str] = {}
        self.died = asyncio.Event()
        self.hung = asyncio.Event()
        self.held = asyncio.Event()

    async def effect(self, name: str, key: str) -> dict[str, str]:
        business = f"{name}-{key}"
        fault = self.faults.pop(business, "none")
        if fault == "died_before":
            self.died.set()
            raise Died(f"died before {business}")
        self.effects[business] += 1
        if fault == "died_after":
            self.died.set()
            raise Died(f"died after {business}")
        if fault == "hold":
            self.hung.set()
            await self.held.wait()
        return {name: key}


class Kit:
    """One release of the kit: its modules, and an agent and model built from them."""

    def __init__(self, load: Callable[[str], ModuleType], label: str) -> None:
        self.load = load
        self.label = label
        self.top = load("")
        self.errors = load("errors")

    def agent(self, world: World) -> Any:
        tool = self.top.tool

        @tool(key=_business_key)
        async def book(key: str, ctx: Any) -> dict[str, str]:
            """Book under a business key (side-effecting)."""
            return await world.effect("book", key)

        return self.top.Agent("booker", "Book.", [book])

    def model(self) -> Any:
        top = self.top

        class PlanModel:
            """One turn per word of the user's message (``book:k1 book:k2``), then done."""

            async def complete(self, request: Any) -> Any:
                user = next(m for m in request.messages if m.role is top.Role.user)
                plan = str(user.content).split()
                asked = sum(1 for m in request.messages if m.role is top.Role.assistant)
                if asked >= len(plan):
                    return top.ModelResponse(
                        message=top.Message(role=top.Role.assistant, content="done")
                    )
                name, key = plan[asked].split(":")
                call = top.ToolCall(id=f"c{asked}", name=name, arguments={"key": key})
                return top.ModelResponse(
                    message=top.Message(role=top.Role.assistant, content="", tool_calls=[call])
                )

        return PlanModel()

    def cli(self, url: str, *argv: str) -> tuple[int, str, str]:
        """``tesserix ARGV --store URL`` of this release, in this process (in a thread)."""
        main = self.load("cli.main").main
        out, err = io.StringIO(), io.StringIO()
        got: list[int] = []

        def go() -> None:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                got.append(main([*argv, "--store", url]))

        thread = threading.Thread(target=go)
        thread.start()
        thread.join(60)
        assert got, f"{self.label} tesserix {argv} did not return"
        return got[0], out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    with archived(OLD_COMMIT, OLD_NAME, tmp_path_factory.mktemp("old-kit")) as load:
        yield Kit(load, "old")


@pytest.fixture(scope="module")
def new() -> Kit:
    return Kit(
        lambda m: importlib.import_module(f"tesserix_adk.{m}" if m else "tesserix_adk"), "new"
    )


class Side:
    """One release's stores over the shared file, its agent, runners and workers."""

    def __init__(self, kit: Kit, stores: Any, world: World) -> None:
        self.kit = kit
        self.stores = stores
        self.world = world
        self.agent = kit.agent(world)

    def runner(self, stores: Any = None) -> Any:
        top = self.kit.top
        return top.AgentRunner.from_stores(
            self.kit.model(),
            stores or self.stores,
            lease_policy=top.LeasePolicy(ttl=TTL, renew_within=TTL / 2),
            resume_claim_ttl=TTL,
            never_ran_margin=0.05,
        )

    async def work(self, stores: Any = None, meanwhile: Any = None) -> list[str]:
        """A worker of this release until idle (a ``Died`` ends it as a process death); a
        tool held (``hold``) waits, after its effect, until ``meanwhile()`` returned."""
        top = self.kit.top
        worker = top.Worker(
            self.runner(stores),
            [self.agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=top.Backoff(base=0.01, cap=0.05),
            drain_timeout=0.05,
        )
        self.world.died = asyncio.Event()
        self.world.hung, self.world.held = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(worker.run())
        if meanwhile is not None:
            await asyncio.wait_for(self.world.hung.wait(), 30)
            try:
                await meanwhile()
            finally:
                self.world.held.set()
        died = asyncio.ensure_future(self.world.died.wait())
        await asyncio.wait({task, died}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if died.done() and not task.done():
            task.cancel()  # the process died: its worker goes with it
        died.cancel()
        with contextlib.suppress(Died, asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        return [str(how.value if hasattr(how, "value") else how) for _, how in worker.carried]

    def dying_after_complete(self, business: str) -> Any:
        """These stores, the process dying just after the outcome of ``business`` is
        recorded (before any frontier names it)."""
        faults = self.kit.load("testing.faults")

        def hook(phase: str, op: str, key: str) -> None:
            if phase == "after" and op == "complete" and key == _key(business):
                self.world.died.set()
                raise Died(f"died after recording {business}")

        return dataclasses.replace(
            self.stores,
            idempotency=faults.FaultyIdempotencyStore(self.stores.idempotency, hook=hook),
        )

    async def submit(self, run_id: str, plan: str) -> None:
        await self.runner().submit(self.agent, plan, tenant=T, run_id=run_id)


class Fleet:
    """Both releases over ONE SQLite file, and the world their tools touch."""

    def __init__(self, url: str, path: Path, old: Side, new: Side, world: World) -> None:
        self.url = url
        self.path = path
        self.old = old
        self.new = new
        self.world = world

    def record(self, business: str) -> tuple[Any, ...] | None:
        """The record's row as the file holds it (every column)."""
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            row = conn.execute(
                "SELECT * FROM adk_idempotency WHERE tenant = ? AND key = ?",
                (T, _key(business)),
            ).fetchone()
        return None if row is None else tuple(row)

    def outcome_format(self, business: str) -> int | None:
        rec = self.record(business)
        assert rec is not None
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            (outcome,) = conn.execute(
                "SELECT outcome FROM adk_idempotency WHERE tenant = ? AND key = ?",
                (T, _key(business)),
            ).fetchone()
        return None if outcome is None else json.loads(bytes(outcome))["format"]

    async def entry(self, run_id: str) -> Any:
        return await self.new.stores.work.entry(T, run_id)

    async def cli(self, kit: Side, *argv: str) -> tuple[int, str, str]:
        return await asyncio.to_thread(kit.kit.cli, self.url, *argv)

    async def stuck(self) -> set[str]:
        code, out, err = await self.cli(self.new, "runs", "--tenant", T, "--stuck", "--json")
        assert code == 0, err
        return {r["run_id"] for r in json.loads(out)["runs"]}

    async def status(self, run_id: str) -> str:
        code, out, err = await self.cli(self.new, "inspect", run_id, "--tenant", T, "--json")
        assert code == 0, err
        return str(json.loads(out)["status"])

    async def lapse(self) -> None:
        await asyncio.sleep(TTL + 0.2)


@asynccontextmanager
async def fleet(old: Kit, new: Kit, tmp: Path) -> AsyncIterator[Fleet]:
    path = tmp / "adk.sqlite3"
    url = f"sqlite:///{path}"
    world = World()
    async with new.top.open_stores(url) as new_stores:
        await new_stores.create_schema()
        async with old.top.open_stores(url) as old_stores:
            await old_stores.verify()
            yield Fleet(
                url, path, Side(old, old_stores, world), Side(new, new_stores, world), world
            )


def _typed(code: int, err: str, what: Any) -> None:
    assert code in EXIT_CODES, (what, code, err)
    if code:
        assert "Traceback" not in err, (what, err)
        assert err.endswith("\n") and err.count("\n") == 1, (what, err)


async def _new_recorded_then_died(f: Fleet, run_id: str = "r") -> tuple[Any, ...]:
    """A new worker books k1, records its outcome (format 3) and dies before a frontier
    names it; its lease lapses. Returns the record's row."""
    await f.new.submit(run_id, "book:k1 book:k2")
    await f.new.work(f.new.dying_after_complete("book-k1"))
    assert f.world.effects == Counter({"book-k1": 1})
    assert f.outcome_format("book-k1") == 3
    row = f.record("book-k1")
    assert row is not None
    await f.lapse()
    return row


# --- the same agent, the same revision, on both releases ---------------------------------


async def test_both_releases_share_the_file_and_the_agent_revision(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.new.submit("a", "book:k1")
        assert await f.old.work() == ["finished"]
        await f.old.submit("b", "book:k2")
        assert await f.new.work() == ["finished"]
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})
        assert (await f.status("a"), await f.status("b")) == ("completed", "completed")


# --- a format-3 outcome taken by an old worker ------------------------------------------


async def test_an_old_worker_refuses_a_new_outcome_typed_and_leaves_its_record_untouched(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        row = await _new_recorded_then_died(f)
        carried = await f.old.work()
        assert carried == ["parked"], carried
        entry = await f.entry("r")
        assert entry.state.value == "parked"
        assert entry.reason.startswith("CheckpointFormatError:"), entry.reason
        assert f.record("book-k1") == row  # byte for byte, every column
        assert f.world.effects == Counter({"book-k1": 1})
        # Not lost: listed stuck.
        assert "r" in await f.stuck()


async def test_a_run_an_old_worker_refused_for_a_newer_format_is_carried_by_hand_once(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await _new_recorded_then_died(f)
        await f.old.work()
        run = await f.new.runner().resume(f.new.agent, "r", tenant=T)
        assert run.status.value == "completed"
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})
        assert "r" not in await f.stuck()


async def test_an_old_runner_resuming_by_hand_refuses_with_the_typed_format_error(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        row = await _new_recorded_then_died(f)
        with pytest.raises(old.errors.CheckpointFormatError):
            await f.old.runner().resume(f.old.agent, "r", tenant=T)
        assert f.record("book-k1") == row
        # The refusal let go of the run: a new worker carries it at once.
        assert await f.new.work() == ["finished"]
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})


async def test_a_run_an_old_worker_refused_for_a_newer_format_is_carried_by_a_new_worker(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await _new_recorded_then_died(f)
        await f.old.work()
        await f.lapse()
        await f.new.work()
        assert await f.status("r") == "completed"
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})


# --- format-2 records read by the new kit -----------------------------------------------


async def test_an_outcome_an_old_worker_recorded_is_replayed_by_a_new_worker(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.old.submit("r", "book:k1 book:k2")
        await f.old.work(f.old.dying_after_complete("book-k1"))
        assert f.outcome_format("book-k1") == 2
        row = f.record("book-k1")
        await f.lapse()
        assert await f.new.work() == ["finished"]
        assert await f.status("r") == "completed"
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})
        assert f.record("book-k1") == row  # replayed, not rewritten


# --- a cancel the new CLI recorded, read by an old worker --------------------------------


async def test_a_cancel_by_the_new_cli_stops_an_old_workers_run_sending_nothing_more(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.old.submit("r", "book:k1 book:k2")
        f.world.faults["book-k1"] = "hold"
        said: list[tuple[int, str, str]] = []

        async def cancel() -> None:
            said.append(await f.cli(f.new, "cancel", "r", "--tenant", T, "--by", "ops", "--json"))

        carried = await f.old.work(meanwhile=cancel)
        [(code, out, err)] = said
        assert code == 0 and json.loads(out)["state"] == "requested", (code, out, err)
        assert f.world.effects == Counter({"book-k1": 1})  # k2 never sent
        assert f.outcome_format("book-k1") == 2  # the old worker recorded its call
        cancel_row = _cancel_row(f, "r")
        entry = await f.entry("r")
        status = await f.status("r")
        assert status == "cancelled" or (entry is not None and "r" in await f.stuck()), (
            carried,
            status,
            entry,
        )
        assert _cancel_row(f, "r") == cancel_row
        # Whatever the old worker did, the new fleet ends it cancelled, sending nothing.
        await f.lapse()
        await f.new.work()
        if await f.status("r") != "cancelled":
            await f.new.runner().resume(f.new.agent, "r", tenant=T)
        assert await f.status("r") == "cancelled"
        assert f.world.effects == Counter({"book-k1": 1})


async def test_a_cancel_by_the_new_cli_ends_an_old_workers_run_cancelled_unaided(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.old.submit("r", "book:k1 book:k2")
        f.world.faults["book-k1"] = "hold"

        async def cancel() -> None:
            await f.cli(f.new, "cancel", "r", "--tenant", T, "--by", "ops")

        await f.old.work(meanwhile=cancel)
        await f.lapse()
        await f.new.work()
        assert await f.status("r") == "cancelled"


def _cancel_row(f: Fleet, run_id: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(f.path)) as conn:
        return [
            tuple(r)
            for r in conn.execute(
                "SELECT * FROM adk_idempotency WHERE tenant = ? AND key LIKE 'cancel%'", (T,)
            ).fetchall()
        ]


async def test_a_cancel_by_the_old_cli_stops_a_new_workers_run(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.new.submit("r", "book:k1 book:k2")
        f.world.faults["book-k1"] = "hold"

        async def cancel() -> None:
            code, _, err = await f.cli(f.old, "cancel", "r", "--tenant", T, "--by", "ops")
            assert code == 0, err

        await f.new.work(meanwhile=cancel)
        assert await f.status("r") == "cancelled"
        assert f.world.effects == Counter({"book-k1": 1})


async def test_the_old_cli_on_new_records_refuses_typed_and_writes_nothing(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.new.submit("r", "book:k1 book:k2")
        f.world.faults["book-k1"] = "hold"

        async def cancel() -> None:
            code, _, err = await f.cli(f.new, "cancel", "r", "--tenant", T, "--by", "ops")
            assert code == 0, err

        await f.new.work(meanwhile=cancel)
        assert await f.status("r") == "cancelled"
        rows = _all_rows(f)
        for argv in (
            ("inspect", "r", "--tenant", T),
            ("inspect", "r", "--tenant", T, "--json"),
            ("show", "r", "--tenant", T),
            ("runs", "--tenant", T),
            ("runs", "--tenant", T, "--stuck"),
            ("cancel", "r", "--tenant", T, "--by", "other"),
            ("resolve", "r", "--tenant", T, "--call", "c0", "--never-ran", "--by", "x"),
        ):
            code, _, err = await f.cli(f.old, *argv)
            _typed(code, err, argv)
        assert _all_rows(f) == rows


def _all_rows(f: Fleet) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(f.path)) as conn:
        return [
            tuple(r) for r in conn.execute("SELECT * FROM adk_idempotency ORDER BY key").fetchall()
        ]


# --- a call an old worker left in doubt, resolved by the new CLI ------------------------


async def _old_left_in_doubt(f: Fleet) -> None:
    """An old worker dies inside k1's booking (after it happened); another old worker
    parks the run in doubt."""
    await f.old.submit("r", "book:k1 book:k2")
    f.world.faults["book-k1"] = "died_after"
    await f.old.work()
    await f.lapse()
    assert await f.old.work() == ["parked"]
    entry = await f.entry("r")
    assert entry.reason.startswith("IndeterminateToolCallError:"), entry.reason
    assert "r" in await f.stuck()


async def _resolve_completed(f: Fleet) -> None:
    code, out, err = await f.cli(
        f.new,
        "resolve", "r", "--tenant", T, "--call", "c0",
        "--outcome", '{"booked": "BK-1"}', "--by", "ops", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["woken"] is True
    assert f.outcome_format("book-k1") == 3


async def test_a_call_an_old_worker_left_in_doubt_resolved_by_the_new_cli_is_carried_once(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await _old_left_in_doubt(f)
        await _resolve_completed(f)
        await f.new.work()
        assert await f.status("r") == "completed"
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})


async def test_a_resolution_by_the_new_cli_taken_by_an_old_worker_is_refused_and_kept(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await _old_left_in_doubt(f)
        await _resolve_completed(f)
        row = f.record("book-k1")
        assert await f.old.work() == ["parked"]
        entry = await f.entry("r")
        assert entry.reason.startswith("CheckpointFormatError:"), entry.reason
        assert f.record("book-k1") == row
        assert "r" in await f.stuck()
        run = await f.new.runner().resume(f.new.agent, "r", tenant=T)
        assert run.status.value == "completed"
        assert f.world.effects == Counter({"book-k1": 1, "book-k2": 1})


# --- a business key two runs share across the releases ----------------------------------


async def test_an_old_run_sharing_a_key_a_new_run_recorded_is_refused_then_carried_once(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.new.submit("a", "book:k1")
        assert await f.new.work() == ["finished"]
        row = f.record("book-k1")
        await f.old.submit("b", "book:k1")
        assert await f.old.work() == ["parked"]
        assert (await f.entry("b")).reason.startswith("CheckpointFormatError:")
        assert f.record("book-k1") == row
        assert "b" in await f.stuck()
        run = await f.new.runner().resume(f.new.agent, "b", tenant=T)
        assert run.status.value == "completed"
        assert f.world.effects == Counter({"book-k1": 1})


async def test_a_new_resolve_of_an_old_claim_wakes_a_new_run_parked_on_it_and_books_once(
    old: Kit, new: Kit, tmp_path: Path
) -> None:
    async with fleet(old, new, tmp_path) as f:
        await f.old.submit("a", "book:k1")
        f.world.faults["book-k1"] = "died_after"
        await f.old.work()
        await f.new.submit("b", "book:k1")
        await f.lapse()
        await f.new.work()
        assert (await f.entry("a")).state.value == "parked"
        assert (await f.entry("b")).state.value == "parked"
        code, out, err = await f.cli(
            f.new,
            "resolve", "a", "--tenant", T, "--call", "c0",
            "--outcome", '{"booked": "BK-1"}', "--by", "ops", "--json",
        )  # fmt: skip
        assert code == 0, err
        assert json.loads(out)["also_woken"] == ["b"], out
        await f.lapse()
        await f.new.work()
        assert (await f.status("a"), await f.status("b")) == ("completed", "completed")
        assert f.world.effects == Counter({"book-k1": 1})
