"""Fresh-eyes attacks on "What it guarantees", ``ctx.state``, parallel calls and streaming.

Attacked: streamed runs left (``break``) mid-call, mid-turn and mid-answer and carried on
with ``stream_resume`` (async and sync tools, with and without ``group_writes``); a tool
that raises after its side effect; ``max_iterations`` and ``budget_micros`` reached exactly
at a turn's frontier and then resumed; retrying on the same runner object after a
retryable error; two ``run()`` of one run id at once on one store (two bundles); a SQLite
run carried on through another spelling of its file (``..``, a symlink); ``ctx.state``
written by parallel calls and by a call whose frontier was never written. The world is a
counter each side-effecting tool increments.

Found: nothing; no test here is an xfail.

Held: a retry on the same runner after a model error, and after a run whose frontiers
all failed (SQLite, Redis, PostgreSQL), replays the booking; a tool that raised after its
side effect is not sent again; a stream left while an async or sync tool was running (with
and without ``group_writes``, on every backend) is replayed or refused in doubt, never sent
again; a stream left after a call finished, or broken without ``aclosing`` and collected,
resumes at once and books the rest once; a cancel asked during a stream ends it
``cancelled`` and nothing more goes out; a resume while the stream still holds the run is
refused retryably; two ``stream_resume`` at once, and two ``run()`` of one run id on two
bundles of one store (every backend), book once; an ``on_event`` raising at
``ToolCallStarted``/``ToolCallFinished`` never leads to a second send; ``max_iterations=1``
and a budget spent exactly by the booking turn stop the run and a resume sends nothing; a
SQLite run resumed through ``..``, a symlink or doubled slashes finds its records; an
unkeyed call is not sent while no frontier can be written, and left mid-stream is refused
(``IndeterminateToolCallError``); fields of ``ctx.state`` set by two parallel calls (either
finishing last) survive a lost ``after_tool_result`` frontier; sync parallel calls adding
fields while others complete and snapshot the state (pydantic's dump holds the GIL).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from contextlib import aclosing, suppress
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    ScriptedProvider,
    ScriptedTurn,
    ToolCallFinished,
    ToolCallStarted,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.errors import ProviderError

T = "acme"


class World:
    def __init__(self) -> None:
        self.booked: list[str] = []
        self.lock = threading.Lock()

    def book(self, what: str) -> int:
        with self.lock:
            self.booked.append(what)
            return len(self.booked)


def _agent(world: World, **kw: Any) -> Agent:
    @tool
    async def book(seat: str) -> str:
        """Book a seat."""
        n = world.book(seat)
        return f"BK-{n}"

    @tool(side_effects=False)
    def look(q: str) -> str:
        """Read only."""
        return q

    return Agent("fresh", "Book.", [book, look], **kw)


class Flaky:
    """A ScriptedProvider that raises a retryable ProviderError at given model turns once."""

    def __init__(self, turns: list[Any], fail_at: set[int]) -> None:
        self.inner = ScriptedProvider(turns)
        self.fail_at = set(fail_at)
        self.asked = 0

    async def complete(self, request: Any) -> Any:
        turn = sum(1 for m in request.messages if m.role.value == "assistant")
        self.asked += 1
        if turn in self.fail_at:
            self.fail_at.discard(turn)
            raise ProviderError("model down", retryable=True)
        return await self.inner.complete(request)


async def _sqlite(tmp_path: Any, name: str = "a.db") -> Any:
    stores = open_stores(f"sqlite:///{tmp_path / name}")
    await stores.__aenter__()
    await stores.create_schema()
    return stores


def _runner(provider: Any, stores: Any, **kw: Any) -> AgentRunner:
    return AgentRunner.from_stores(provider, stores, **kw)


BOOK_THEN_DONE = [ScriptedTurn(text="booking", calls=[("book", {"seat": "1A"})]), "done"]


# --------------------------------------------------------------------------- retries


def test_retry_on_same_runner_after_model_error_books_once(tmp_path: Any) -> None:
    async def main() -> None:
        world = World()
        stores = await _sqlite(tmp_path)
        try:
            provider = Flaky(BOOK_THEN_DONE, fail_at={1})
            runner = _runner(provider, stores)
            agent = _agent(world)
            with pytest.raises(ProviderError):
                await runner.run(agent, "go", tenant=T, run_id="r1")
            assert world.booked == ["1A"]
            run = await runner.resume(agent, "r1", tenant=T)
            assert run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_tool_raising_after_side_effect_is_not_sent_again(tmp_path: Any) -> None:
    """A tool that made its side effect then raised: the model is told, and a resume after
    the model failed does not send it again."""

    async def main() -> None:
        world = World()

        @tool
        async def book(seat: str) -> str:
            """Book then fail."""
            world.book(seat)
            raise RuntimeError("downstream said 500 after booking")

        agent = Agent("fresh", "Book.", [book])
        stores = await _sqlite(tmp_path)
        try:
            provider = Flaky(BOOK_THEN_DONE, fail_at={1})
            with pytest.raises(ProviderError):
                await _runner(provider, stores).run(agent, "go", tenant=T, run_id="r1")
            run = await _runner(Flaky(BOOK_THEN_DONE, set()), stores).resume(agent, "r1", tenant=T)
            assert run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- streaming


async def _stream_until(runner: AgentRunner, agent: Agent, pred: Any, **kw: Any) -> list[Any]:
    seen: list[Any] = []
    async with aclosing(runner.stream(agent, "go", tenant=T, **kw)) as events:
        async for event in events:
            seen.append(event)
            if pred(event):
                break
    return seen


@pytest.mark.parametrize("group_writes", [False, True])
@pytest.mark.parametrize("sync", [False, True])
def test_stream_left_while_tool_runs_never_sends_twice(
    tmp_path: Any, group_writes: bool, sync: bool
) -> None:
    """The viewer leaves while the booking is in the tool, after its side effect: the
    resume replays it or refuses it as in doubt; it never books again."""

    async def main() -> None:
        world = World()
        started = threading.Event()
        release = threading.Event()

        if sync:

            @tool
            def book(seat: str) -> str:
                """Book (sync)."""
                world.book(seat)
                started.set()
                release.wait(5)
                return "BK"
        else:

            @tool
            async def book(seat: str) -> str:
                """Book (async)."""
                world.book(seat)
                started.set()
                for _ in range(500):
                    if release.is_set():
                        break
                    await asyncio.sleep(0.01)
                return "BK"

        agent = Agent("fresh", "Book.", [book])
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(BOOK_THEN_DONE), stores, group_writes=group_writes)

            async def leave_when_booked() -> None:
                async with aclosing(runner.stream(agent, "go", tenant=T, run_id="r1")) as ev:
                    async for event in ev:
                        if isinstance(event, ToolCallStarted):
                            while not started.is_set():  # noqa: ASYNC110
                                await asyncio.sleep(0.01)
                            break

            timer = threading.Timer(0.3, release.set)
            timer.start()
            await leave_when_booked()
            release.set()
            timer.cancel()
            await asyncio.sleep(0.1)
            assert world.booked == ["1A"]
            runner2 = _runner(ScriptedProvider(BOOK_THEN_DONE), stores)
            try:
                run = await runner2.resume(agent, "r1", tenant=T)
            except Exception as exc:  # refused in doubt is allowed, never a guess
                assert type(exc).__name__ in {"IndeterminateToolCallError"}, repr(exc)
            else:
                assert run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_stream_left_after_call_finished_resumes_with_replay(tmp_path: Any) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world)
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(BOOK_THEN_DONE), stores)
            await _stream_until(
                runner, agent, lambda e: isinstance(e, ToolCallFinished), run_id="r1"
            )
            assert world.booked == ["1A"]
            events: list[Any] = []
            async with aclosing(runner.stream_resume(agent, "r1", tenant=T)) as ev:
                async for event in ev:
                    events.append(event)
            assert events[-1].run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_cancel_while_streaming_sends_nothing_more(tmp_path: Any) -> None:
    """A cancel asked while the stream is in its first call: the second turn's booking is
    never sent; the run ends cancelled; a resume sends nothing."""

    async def main() -> None:
        world = World()
        agent = _agent(world)
        turns = [
            ScriptedTurn(text="a", calls=[("book", {"seat": "1A"})]),
            ScriptedTurn(text="b", calls=[("book", {"seat": "2B"})]),
            "done",
        ]
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(turns), stores)
            other = _runner(ScriptedProvider(turns), stores)
            last: Any = None
            async with aclosing(runner.stream(agent, "go", tenant=T, run_id="r1")) as ev:
                async for event in ev:
                    if isinstance(event, ToolCallFinished) and not last:
                        last = await other.cancel("r1", tenant=T, by="ops", reason="stop")
                    final = event
            assert final.run.status.value == "cancelled"
            assert world.booked == ["1A"]
            try:
                again = await other.resume(agent, "r1", tenant=T)
            except Exception:  # a refusal is fine: nothing sent
                pass
            else:
                assert again.status.value == "cancelled"
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- one run id


def test_two_runs_of_one_run_id_at_once_book_once(tmp_path: Any) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world)
        a = await _sqlite(tmp_path)
        b = open_stores(f"sqlite:///{tmp_path / 'a.db'}")
        await b.__aenter__()
        try:
            r1 = _runner(ScriptedProvider(BOOK_THEN_DONE), a)
            r2 = _runner(ScriptedProvider(BOOK_THEN_DONE), b)
            got = await asyncio.gather(
                r1.run(agent, "go", tenant=T, run_id="same"),
                r2.run(agent, "go", tenant=T, run_id="same"),
                return_exceptions=True,
            )
            done = [g for g in got if not isinstance(g, BaseException)]
            assert len(done) >= 1, got
            assert world.booked == ["1A"], got
        finally:
            await b.__aexit__(None, None, None)
            await a.__aexit__(None, None, None)

    asyncio.run(main())


@pytest.mark.parametrize("spelling", ["dotdot", "symlink", "double_slash"])
def test_sqlite_resume_through_another_spelling_books_once(tmp_path: Any, spelling: str) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world)
        (tmp_path / "sub").mkdir()
        a = await _sqlite(tmp_path)
        try:
            with pytest.raises(ProviderError):
                await _runner(Flaky(BOOK_THEN_DONE, {1}), a).run(agent, "go", tenant=T, run_id="r1")
        finally:
            await a.__aexit__(None, None, None)
        if spelling == "dotdot":
            url = f"sqlite:///{tmp_path / 'sub' / '..' / 'a.db'}"
        elif spelling == "symlink":
            os.symlink(tmp_path / "a.db", tmp_path / "link.db")
            url = f"sqlite:///{tmp_path / 'link.db'}"
        else:
            url = f"sqlite:///{str(tmp_path).replace('/', '//')}//a.db"
        b = open_stores(url)
        await b.__aenter__()
        try:
            run = await _runner(ScriptedProvider(BOOK_THEN_DONE), b).resume(agent, "r1", tenant=T)
            assert run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await b.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- limits


def test_max_iterations_hit_at_the_booking_turn_then_resumed(tmp_path: Any) -> None:
    """``max_iterations=1``: the first turn books, the run stops at its limit; a resume (same
    agent) never books again."""

    async def main() -> None:
        world = World()
        agent = _agent(world, max_iterations=1)
        stores = await _sqlite(tmp_path)
        try:
            run = await _runner(ScriptedProvider(BOOK_THEN_DONE), stores).run(
                agent, "go", tenant=T, run_id="r1"
            )
            assert world.booked == ["1A"], run
            first = run.status.value
            try:
                again = await _runner(ScriptedProvider(BOOK_THEN_DONE), stores).resume(
                    agent, "r1", tenant=T
                )
            except Exception as exc:
                assert getattr(exc, "retryable", False) is False, repr(exc)
            else:
                assert again.status.value == first
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_budget_spent_exactly_by_the_booking_turn(tmp_path: Any) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world, budget_micros=100)
        turns = [
            ScriptedTurn(text="b", calls=[("book", {"seat": "1A"})], cost_micros=100),
            ScriptedTurn(text="b2", calls=[("book", {"seat": "2B"})], cost_micros=100),
            "done",
        ]
        stores = await _sqlite(tmp_path)
        try:
            try:
                run = await _runner(ScriptedProvider(turns), stores).run(
                    agent, "go", tenant=T, run_id="r1"
                )
            except Exception as exc:
                print("run raised", repr(exc))
            else:
                print("run", run.status, run.spent_micros)
            booked = list(world.booked)
            assert booked in (["1A"], ["1A", "2B"])
            try:
                again = await _runner(ScriptedProvider(turns), stores).resume(agent, "r1", tenant=T)
                print("resume", again.status, again.spent_micros)
            except Exception as exc:
                print("resume raised", repr(exc))
            assert world.booked == booked
            assert booked == ["1A"]  # the budget is spent: the second booking's turn is not
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- ctx.state


class NoFrontiersAfter:
    """The SQLite checkpoint store, whose frontier writes fail once ``broken`` is set (a
    checkpoint failure never fails the live run: it lands in ``last_error``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.broken = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in ("put", "put_with_history"):

            async def refused(*a: Any, **kw: Any) -> Any:
                if self.broken:
                    from tesserix_adk.errors import StoreUnavailableError

                    raise StoreUnavailableError("checkpoint store down")
                return await attr(*a, **kw)

            return refused
        return attr


@pytest.mark.parametrize("slow_first", [False, True])
def test_parallel_state_writes_survive_a_lost_frontier(tmp_path: Any, slow_first: bool) -> None:
    """Two parallel calls each set a field of ``ctx.state``; the ``after_tool_result``
    frontier is not written and the model then fails. The resume must see both fields
    (each call set a field, as the README advises), whichever call finished last."""

    async def main() -> None:
        from tesserix_adk import Checkpointer

        world = World()
        seen: list[dict[str, Any]] = []

        @tool
        async def book(seat: str, ctx: ToolContext) -> str:
            """Book, then note the seat in the state."""
            n = world.book(seat)
            if slow_first and seat == "1A":
                await asyncio.sleep(0.15)
            ctx.state[f"seat_{seat}"] = n
            return f"BK-{n}"

        @tool(side_effects=False)
        def report(ctx: ToolContext) -> str:
            """Read the state."""
            seen.append(dict(ctx.state))
            return "ok"

        agent = Agent("fresh", "Book.", [book, report], parallel_tool_calls=2)
        turns = [
            ScriptedTurn(text="b", calls=[("book", {"seat": "1A"}), ("book", {"seat": "2B"})]),
            ScriptedTurn(text="r", calls=[("report", {})]),
            "done",
        ]
        stores = await _sqlite(tmp_path)
        try:
            cps = NoFrontiersAfter(stores.checkpoints)
            runner = AgentRunner(
                Flaky(turns, fail_at={1}),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(cps, history=stores.history),
                leases=stores.leases,
                ledger=stores.ledger,
            )
            task = asyncio.ensure_future(
                runner.run(agent, "go", tenant=T, run_id="r1", state={"owner": "me"})
            )
            while not world.booked:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            cps.broken = True
            with pytest.raises(ProviderError):
                await task
            assert sorted(world.booked) == ["1A", "2B"]
            cps.broken = False
            run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
                agent, "r1", tenant=T
            )
            assert run.status.value == "completed", run
            assert sorted(world.booked) == ["1A", "2B"]
            assert len(seen) == 1, seen
            assert set(seen[0]) == {"owner", "seat_1A", "seat_2B"}, seen
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- on every backend

BACKENDS = ["sqlite", "redis", "postgres"]


class Site:
    """A store of its own: a SQLite file, a Redis key prefix or a PostgreSQL schema."""

    def __init__(self, backend: str, tmp_path: Any) -> None:
        from adapters.services import POSTGRES_URL, REDIS_URL, with_query

        self.backend = backend
        self.name = f"fresh_{secrets.token_hex(5)}"
        if backend == "sqlite":
            self.url = f"sqlite:///{tmp_path / 'site.db'}"
        elif backend == "redis":
            self.url = with_query(REDIS_URL, prefix=f"{self.name}:", allow_volatile="true")
        else:
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as admin:
                admin.execute(f'CREATE SCHEMA "{self.name}"')
            self.url = with_query(POSTGRES_URL, schema=self.name)
        self.opened: list[Any] = []

    async def open(self) -> Any:
        stores = open_stores(self.url)
        await stores.__aenter__()
        if not self.opened:
            await stores.create_schema()
        self.opened.append(stores)
        return stores

    async def close(self) -> None:
        for stores in self.opened:
            await stores.__aexit__(None, None, None)
        if self.backend == "redis":
            import redis

            from adapters.services import REDIS_URL

            client = redis.Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(match=f"{self.name}:*", count=1000))
            if keys:
                client.delete(*keys)
            client.close()
        elif self.backend == "postgres":
            import psycopg

            from adapters.services import POSTGRES_URL

            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f'DROP SCHEMA "{self.name}" CASCADE')


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_run_id_at_once_on_two_bundles_books_once(tmp_path: Any, backend: str) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world)
        site = Site(backend, tmp_path)
        try:
            a, b = await site.open(), await site.open()
            runners = [_runner(ScriptedProvider(BOOK_THEN_DONE), s) for s in (a, b)]
            got = await asyncio.gather(
                *(r.run(agent, "go", tenant=T, run_id="same") for r in runners),
                return_exceptions=True,
            )
            assert any(not isinstance(g, BaseException) for g in got), got
            assert world.booked == ["1A"], got
        finally:
            await site.close()

    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_retried_on_same_runner_without_any_frontier_books_once(
    tmp_path: Any, backend: str
) -> None:
    """No frontier could ever be written (checkpoint store down), the booking went out and
    the model then failed: ``run()`` retried on the same runner object replays the booking."""

    async def main() -> None:
        from tesserix_adk import Checkpointer

        world = World()
        agent = _agent(world)
        site = Site(backend, tmp_path)
        try:
            stores = await site.open()
            cps = NoFrontiersAfter(stores.checkpoints)
            cps.broken = True
            runner = AgentRunner(
                Flaky(BOOK_THEN_DONE, fail_at={1}),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(cps, history=stores.history),
                leases=stores.leases,
                ledger=stores.ledger,
            )
            with pytest.raises(ProviderError):
                await runner.run(agent, "go", tenant=T, run_id="r1")
            assert world.booked == ["1A"]
            cps.broken = False
            run = await runner.run(agent, "go", tenant=T, run_id="r1")
            assert run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await site.close()

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["redis", "postgres"])
def test_stream_left_mid_call_on_servers_never_sends_twice(tmp_path: Any, backend: str) -> None:
    async def main() -> None:
        world = World()
        started = asyncio.Event()

        @tool
        async def book(seat: str) -> str:
            """Book (async), slow after its side effect."""
            world.book(seat)
            started.set()
            await asyncio.sleep(0.2)
            return "BK"

        agent = Agent("fresh", "Book.", [book])
        site = Site(backend, tmp_path)
        try:
            stores = await site.open()
            runner = _runner(
                ScriptedProvider(BOOK_THEN_DONE), stores, group_writes=backend == "postgres"
            )
            async with aclosing(runner.stream(agent, "go", tenant=T, run_id="r1")) as ev:
                async for event in ev:
                    if isinstance(event, ToolCallStarted):
                        await started.wait()
                        break
            try:
                run = await runner.resume(agent, "r1", tenant=T)
            except Exception as exc:
                assert type(exc).__name__ == "IndeterminateToolCallError", repr(exc)
            else:
                assert run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await site.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- more streaming


def test_resume_while_the_stream_still_holds_the_run_sends_nothing(tmp_path: Any) -> None:
    """A second runner resumes while the viewer is still reading (the booking in the tool):
    it is refused (the run is held); the booking is made once."""

    async def main() -> None:
        world = World()
        gate = asyncio.Event()

        @tool
        async def book(seat: str) -> str:
            """Book, then wait."""
            world.book(seat)
            await gate.wait()
            return "BK"

        agent = Agent("fresh", "Book.", [book])
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(BOOK_THEN_DONE), stores)
            other = _runner(ScriptedProvider(BOOK_THEN_DONE), stores)
            refused: list[BaseException] = []
            final: Any = None
            async with aclosing(runner.stream(agent, "go", tenant=T, run_id="r1")) as ev:
                async for event in ev:
                    if isinstance(event, ToolCallStarted):
                        while not world.booked:  # noqa: ASYNC110
                            await asyncio.sleep(0.005)
                        try:
                            await other.resume(agent, "r1", tenant=T)
                        except Exception as exc:
                            refused.append(exc)
                        gate.set()
                    final = event
            assert refused and getattr(refused[0], "retryable", None) is True, refused
            assert final.run.status.value == "completed"
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_break_without_aclosing_then_collected_lets_resume_take_it(tmp_path: Any) -> None:
    async def main() -> None:
        import gc

        world = World()
        agent = _agent(world)
        turns = [
            ScriptedTurn(text="a", calls=[("book", {"seat": "1A"})]),
            ScriptedTurn(text="b", calls=[("book", {"seat": "2B"})]),
            "done",
        ]
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(turns), stores)
            stream = runner.stream(agent, "go", tenant=T, run_id="r1")
            async for event in stream:
                if isinstance(event, ToolCallFinished):
                    break
            del stream
            gc.collect()
            for _ in range(50):
                await asyncio.sleep(0.01)
            run = await _runner(ScriptedProvider(turns), stores).resume(agent, "r1", tenant=T)
            assert run.status.value == "completed"
            assert world.booked == ["1A", "2B"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


@pytest.mark.parametrize("at", ["ToolCallStarted", "ToolCallFinished"])
def test_on_event_raising_around_a_call_never_sends_it_twice(tmp_path: Any, at: str) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world)
        stores = await _sqlite(tmp_path)
        try:

            def sink(event: Any) -> None:
                if type(event).__name__ == at:
                    raise RuntimeError("viewer crashed")

            runner = _runner(ScriptedProvider(BOOK_THEN_DONE), stores)
            with suppress(Exception):
                await runner.run(agent, "go", tenant=T, run_id="r1", on_event=sink)
            before = list(world.booked)
            try:
                await _runner(ScriptedProvider(BOOK_THEN_DONE), stores).resume(
                    agent, "r1", tenant=T
                )
            except Exception as exc:
                assert type(exc).__name__ in {"IndeterminateToolCallError", "RunFinishedError"}, (
                    repr(exc)
                )
            assert len(world.booked) <= 1, (before, world.booked)
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- unkeyed calls


def _unkeyed_agent(world: World, gate: asyncio.Event | None = None) -> Agent:
    @tool(key=None)
    async def book(seat: str) -> str:
        """Book with no idempotency key."""
        world.book(seat)
        if gate is not None:
            await gate.wait()
        return "BK"

    return Agent("fresh", "Book.", [book])


def test_unkeyed_call_not_sent_while_no_frontier_can_be_written(tmp_path: Any) -> None:
    async def main() -> None:
        from tesserix_adk import Checkpointer

        world = World()
        agent = _unkeyed_agent(world)
        stores = await _sqlite(tmp_path)
        try:
            cps = NoFrontiersAfter(stores.checkpoints)
            cps.broken = True
            runner = AgentRunner(
                ScriptedProvider(BOOK_THEN_DONE),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(cps, history=stores.history),
                leases=stores.leases,
                ledger=stores.ledger,
            )
            with suppress(Exception):
                await runner.run(agent, "go", tenant=T, run_id="r1")
            assert world.booked == []
            cps.broken = False
            try:
                await runner.run(agent, "go", tenant=T, run_id="r1")
            except Exception as exc:
                print("retry:", repr(exc))
            assert len(world.booked) <= 1
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_unkeyed_call_left_mid_stream_is_refused_not_resent(tmp_path: Any) -> None:
    async def main() -> None:
        world = World()
        gate = asyncio.Event()
        agent = _unkeyed_agent(world, gate)
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(BOOK_THEN_DONE), stores)
            async with aclosing(runner.stream(agent, "go", tenant=T, run_id="r1")) as ev:
                async for event in ev:
                    if isinstance(event, ToolCallStarted):
                        while not world.booked:  # noqa: ASYNC110
                            await asyncio.sleep(0.005)
                        break
            gate.set()
            from tesserix_adk import IndeterminateToolCallError

            with pytest.raises(IndeterminateToolCallError):
                await _runner(ScriptedProvider(BOOK_THEN_DONE), stores).resume(
                    agent, "r1", tenant=T
                )
            assert world.booked == ["1A"]
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


# --------------------------------------------------------------------------- state races


def test_sync_parallel_calls_setting_fields_while_others_complete(tmp_path: Any) -> None:
    """Sync tools of one turn set fields of ``ctx.state`` (the README's advice: set a field,
    not append) in their threads while the calls beside them complete and their records
    snapshot the state: every call completes once and the run completes."""

    async def main() -> None:
        world = World()

        @tool
        def book(seat: str, ctx: ToolContext) -> str:
            """Book, then note many fields."""
            n = world.book(seat)
            if seat == "slow":
                for i in range(5_000):
                    ctx.state[f"f{i}"] = i
            return f"BK-{n}"

        agent = Agent("fresh", "Book.", [book], parallel_tool_calls=4)
        seats = ["slow", "a", "b", "c", "d", "e", "f", "g"]
        turns = [ScriptedTurn(text="b", calls=[("book", {"seat": s}) for s in seats]), "done"]
        stores = await _sqlite(tmp_path)
        try:
            runner = _runner(ScriptedProvider(turns), stores)
            run = await runner.run(agent, "go", tenant=T, run_id="r1", state={})
            assert run.status.value == "completed", run
            assert sorted(world.booked) == sorted(seats)
            assert runner.checkpoints.last_error is None
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())


def test_two_stream_resumes_at_once_book_the_rest_once(tmp_path: Any) -> None:
    async def main() -> None:
        world = World()
        agent = _agent(world)
        turns = [
            ScriptedTurn(text="a", calls=[("book", {"seat": "1A"})]),
            ScriptedTurn(text="b", calls=[("book", {"seat": "2B"})]),
            "done",
        ]
        stores = await _sqlite(tmp_path)
        try:
            await _stream_until(
                _runner(ScriptedProvider(turns), stores),
                agent,
                lambda e: isinstance(e, ToolCallFinished),
                run_id="r1",
            )

            async def viewer() -> Any:
                runner = _runner(ScriptedProvider(turns), stores)
                last = None
                async with aclosing(runner.stream_resume(agent, "r1", tenant=T)) as ev:
                    async for event in ev:
                        last = event
                return last

            got = await asyncio.gather(viewer(), viewer(), return_exceptions=True)
            assert any(not isinstance(g, BaseException) for g in got), got
            assert world.booked == ["1A", "2B"], got
        finally:
            await stores.__aexit__(None, None, None)

    asyncio.run(main())
