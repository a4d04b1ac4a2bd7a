"""Attacks on a502afd: a PostgreSQL write group's COMMIT rides in the message of its last
single statement (the cancel check after a call's claim, the cancel check at the top of
the loop), on the real server with the runner on top (``group_writes=True``).

The oracle is a counting tool (each real dispatch appends to a list) and the ledger's
spend against the model calls the provider counted; another connection looks at what is
committed at the moment a tool is sent. Failures are made by triggers in the test's own
schema, by terminating the group's backend, by wrapping ``batched`` in the group module (to
raise before or after the real message), and by cancelling the run's task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from adapters import services
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import grouping as pg_grouping
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.errors import (
    AdkError,
    IndeterminateToolCallError,
    NoCheckpointError,
    StoreUnavailableError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("grouped_writes")]

T = "acme"
COST = 100
SLEEPER = "adk-test-attack-commit-with-next"  # its own schema's triggers sleep under this name
REAL_BATCHED = pg_grouping.batched


def _script(turns: int, calls: int) -> list[Any]:
    return [
        *(
            ScriptedTurn(
                calls=[("book", {"seat": f"{t}-{c}"}) for c in range(calls)], cost_micros=COST
            )
            for t in range(turns)
        ),
        ScriptedTurn(text="done", cost_micros=COST),
    ]


class Oracle:
    """A counting tool; at each dispatch, what another connection sees committed."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url
        self.sent: list[str] = []
        # Each dispatch's seat with what it saw: calls sent side by side finish their looks
        # in any order, so the two are kept together, never paired up by position later.
        self.seen_at_dispatch: list[tuple[str, dict[str, Any]]] = []

        @tool
        async def book(seat: str) -> str:
            self.sent.append(seat)
            if self.url is not None:
                self.seen_at_dispatch.append((seat, await self._look()))
            await asyncio.sleep(0)
            return f"booked {seat}"

        self.tool = book

    async def _look(self) -> dict[str, Any]:
        assert self.url is not None
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as other:
            cur = await other.execute("SELECT call_id, status FROM adk_idempotency")
            claims = {str(c): str(s) for c, s in await cur.fetchall()}
            cur = await other.execute("SELECT coalesce(sum(micros), 0) FROM adk_ledger")
            row = await cur.fetchone()
        return {"claims": claims, "spent": int(row[0]) if row else 0}

    def agent(self, **kwargs: Any) -> Agent:
        return Agent("g", "b", tools=[self.tool], max_iterations=20, **kwargs)


async def _spent(stores: Stores, run_id: str) -> int:
    assert stores.ledger is not None
    return await stores.ledger.spent(T, run_id)


async def _statuses(stores: Stores, run_id: str) -> dict[str, str]:
    records = await stores.idempotency.records(T, run_id)
    return {str(r.call_id): str(r.status) for r in records if r.tool}


def _pool_is_clean(stores: Stores) -> None:
    pool = stores.idempotency.database.pool  # type: ignore[attr-defined]
    for conn in list(pool._pool):
        assert conn.info.transaction_status is TransactionStatus.IDLE


async def _no_open_transactions(admin: psycopg.AsyncConnection[Any], stores: Stores) -> None:
    pool = stores.idempotency.database.pool  # type: ignore[attr-defined]
    pids = [c.info.backend_pid for c in list(pool._pool)]
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND state <> 'idle'",
        (pids,),
    )
    row = await cur.fetchone()
    assert row is not None and row[0] == 0


async def _resume_to_the_end(runner: AgentRunner, agent: Agent, run_id: str, tries: int = 4) -> Any:
    """Resume until the run finishes or is refused as in doubt (then that error)."""
    last: BaseException | None = None
    for _ in range(tries):
        try:
            return await runner.resume(agent, run_id, tenant=T)
        except NoCheckpointError:
            # Stopped before its first frontier: nothing of it is durable, so it starts over.
            return await runner.run(agent, "go", tenant=T, run_id=run_id)
        except IndeterminateToolCallError as exc:
            return exc
        except AdkError as exc:
            if not exc.retryable:
                raise
            last = exc
    raise AssertionError(f"never finished: {last!r}")


def _wrap_batched(
    monkeypatch: pytest.MonkeyPatch,
    wanted: Callable[[Any, Any, Any, Any], bool],
    *,
    after: bool,
    error: Callable[[], BaseException] = lambda: psycopg.OperationalError("reply lost"),
    times: int = 1,
) -> list[int]:
    """``batched`` in the group module raising ``error`` before or after the real message
    when ``wanted(before, statements, after_statements, conn)`` (``times`` times)."""
    hits: list[int] = []

    async def wrapped(
        conn: Any, before: Any, statements: Any, tail: Any = (), prepared: Any = None
    ):
        hit = len(hits) < times and wanted(before, statements, tail, conn)
        if hit:
            hits.append(1)
            if not after:
                raise error()
        result = await REAL_BATCHED(conn, before, statements, tail, prepared)
        if hit:
            raise error()
        return result

    monkeypatch.setattr(pg_grouping, "batched", wrapped)
    return hits


def _is_claim(statements: Any) -> bool:
    return "adk_idempotency" in statements[0][0] and "INSERT" in statements[0][0].upper()


class _Committing:
    """Tells a group's committing messages apart by the message before them on the same
    connection: a call's claim is committed by the cancel check that follows it (the
    claim's COMMIT), a turn's last outcome by the cancel check at the top of the loop."""

    def __init__(self) -> None:
        self._last_was_claim: dict[int, bool] = {}

    def kind(self, statements: Any, tail: Any, conn: Any) -> str | None:
        after_claim = self._last_was_claim.get(id(conn), False)
        self._last_was_claim[id(conn)] = _is_claim(statements)
        if "COMMIT" not in tail or "INSERT" in statements[0][0].upper():
            return None
        return "claim" if after_claim else "outcome"


def _claim_with_commit() -> Callable[[Any, Any, Any, Any], bool]:
    """A matcher of the message that commits a call's claim (the cancel check after it)."""
    seen = _Committing()
    return lambda before, statements, tail, conn: seen.kind(statements, tail, conn) == "claim"


def _lookup_with_commit() -> Callable[[Any, Any, Any, Any], bool]:
    """A matcher of the message that commits a turn's last outcome (the next cancel check)."""
    seen = _Committing()
    return lambda before, statements, tail, conn: seen.kind(statements, tail, conn) == "outcome"


# --- (1) claim durable before dispatch ---------------------------------------------------


@pytest.mark.parametrize(("calls", "parallel"), [(1, 1), (3, 1), (3, 3)])
async def test_every_dispatch_finds_its_claim_and_the_turns_charge_committed(
    pg_stores: Stores, pg_url: str, calls: int, parallel: int
) -> None:
    oracle = Oracle(pg_url)
    provider = ScriptedProvider(_script(2, calls))
    runner = AgentRunner.from_stores(provider, pg_stores)
    run = await runner.run(oracle.agent(parallel_tool_calls=parallel), "go", tenant=T, run_id="d")
    assert run.status == "completed"
    assert sorted(oracle.sent) == sorted(f"{t}-{c}" for t in range(2) for c in range(calls))
    # Each dispatch: its own claim committed in flight, and every model call so far charged.
    assert sorted(seat for seat, _ in oracle.seen_at_dispatch) == sorted(oracle.sent)
    for seat, seen in oracle.seen_at_dispatch:
        turn, index = (int(x) for x in seat.split("-"))
        assert seen["claims"].get(f"call_{turn}_{index}") == RecordStatus.in_flight.value
        assert seen["spent"] == COST * (turn + 1)
    assert await _spent(pg_stores, "d") == COST * provider.calls


# --- (2) charges when the message carrying the COMMIT fails ------------------------------


async def _fail_at_commit_once(admin: psycopg.AsyncConnection[Any], raising: str) -> None:
    """A deferred trigger on claims that runs ``raising`` at the COMMIT of the second
    claim (the second turn's: the first turn is durable, so there is a frontier to resume
    from); a sequence, which no rollback undoes, counts."""
    await admin.execute("CREATE SEQUENCE adk_test_once")
    await admin.execute(
        "CREATE FUNCTION adk_test_trap() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF nextval('adk_test_once') = 2 THEN {raising}; END IF; RETURN NEW; END $$"
    )
    await admin.execute(
        "CREATE CONSTRAINT TRIGGER adk_test_trap AFTER INSERT ON adk_idempotency "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
    )


async def _fails_then_resumes(
    stores: Stores, oracle: Oracle, provider: ScriptedProvider, run_id: str
) -> Any:
    runner = AgentRunner.from_stores(provider, stores)
    agent = oracle.agent()
    with pytest.raises(StoreUnavailableError):
        await runner.run(agent, "go", tenant=T, run_id=run_id)
    return await _resume_to_the_end(runner, agent, run_id)


@pytest.mark.parametrize(
    "raising",
    [
        pytest.param("RAISE EXCEPTION 'refused at commit'", id="raise"),
        pytest.param(
            "RAISE EXCEPTION 'refused at commit' USING ERRCODE = 'integrity_constraint_violation'",
            id="integrity",
        ),
    ],
)
async def test_a_commit_refused_with_the_claim_charges_every_model_call_once(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], raising: str
) -> None:
    await _fail_at_commit_once(pg_admin, raising)
    oracle = Oracle()
    provider = ScriptedProvider(_script(2, 1))
    run = await _fails_then_resumes(pg_stores, oracle, provider, "refused")
    assert run.status == "completed"
    assert oracle.sent == ["0-0", "1-0"]
    # The second turn's model call was asked twice (nothing of the turn committed): both paid.
    assert provider.calls == 4
    assert await _spent(pg_stores, "refused") == COST * provider.calls


@pytest.mark.parametrize(
    "raising",
    [
        pytest.param(
            "RAISE EXCEPTION 'refused at commit' USING ERRCODE = 'serialization_failure'",
            id="serialization",
        ),
        pytest.param(
            "RAISE EXCEPTION 'refused at commit' USING ERRCODE = 'query_canceled'",
            id="query-canceled",
        ),
    ],
)
async def test_a_commit_the_server_rolls_back_with_the_claim_charges_every_model_call_once(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], raising: str
) -> None:
    await _fail_at_commit_once(pg_admin, raising)
    oracle = Oracle()
    provider = ScriptedProvider(_script(2, 1))
    run = await _fails_then_resumes(pg_stores, oracle, provider, "rolled")
    assert run.status == "completed"
    assert oracle.sent == ["0-0", "1-0"]
    assert provider.calls == 4
    assert await _spent(pg_stores, "rolled") == COST * provider.calls


@pytest.mark.parametrize("after", [False, True], ids=["before-sent", "after-commit"])
@pytest.mark.parametrize("which", [0, 1], ids=["first-claim", "second-claim"])
async def test_a_claim_message_whose_reply_is_lost_books_once_and_charges_once(
    pg_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    after: bool,
    which: int,
) -> None:
    claims: list[int] = []
    committing_a_claim = _claim_with_commit()

    def nth_claim(before: Any, statements: Any, tail: Any, conn: Any) -> bool:
        if not committing_a_claim(before, statements, tail, conn):
            return False
        claims.append(1)
        return len(claims) == which + 1

    hits = _wrap_batched(monkeypatch, nth_claim, after=after)
    oracle = Oracle()
    provider = ScriptedProvider(_script(1, 2))
    run = await _fails_then_resumes(pg_stores, oracle, provider, "lost")
    monkeypatch.undo()
    assert hits == [1]
    assert run.status == "completed"
    assert sorted(oracle.sent) == ["0-0", "0-1"]
    # The group committed (after) or went on and committed alone (before): the turn's
    # model call was asked once and charged once.
    assert provider.calls == 2
    assert await _spent(pg_stores, "lost") == COST * provider.calls
    assert set((await _statuses(pg_stores, "lost")).values()) == {"completed"}
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)


async def _backend_asleep(admin: psycopg.AsyncConnection[Any]) -> int:
    return await services.asleep(admin, SLEEPER)


@pytest.mark.parametrize("deferred", [False, True], ids=["in-claim", "at-commit"])
async def test_a_claim_message_whose_backend_dies_books_once_and_never_charges_twice(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], deferred: bool
) -> None:
    """The connection dies while the message holding the claim and the COMMIT runs (in the
    claim, or at the COMMIT): nobody can say, so the group is in doubt and its charge is
    not made again; nothing of it committed, so the resume asks the model again (the model
    call made is not charged, as for a death)."""
    await pg_admin.execute("CREATE SEQUENCE adk_test_once")
    await pg_admin.execute(
        "CREATE FUNCTION adk_test_trap() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF nextval('adk_test_once') = 2 THEN {services.marked_sleep(SLEEPER)}; END IF; "
        "RETURN NEW; END $$"
    )
    if deferred:
        await pg_admin.execute(
            "CREATE CONSTRAINT TRIGGER adk_test_trap AFTER INSERT ON adk_idempotency "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
        )
    else:
        await pg_admin.execute(
            "CREATE TRIGGER adk_test_trap BEFORE INSERT ON adk_idempotency "
            "FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
        )
    oracle = Oracle()
    provider = ScriptedProvider(_script(2, 1))
    runner = AgentRunner.from_stores(provider, pg_stores)
    agent = oracle.agent()
    running = asyncio.ensure_future(runner.run(agent, "go", tenant=T, run_id="dies"))
    pid = await _backend_asleep(pg_admin)
    await pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(StoreUnavailableError):
        await running
    assert oracle.sent == ["0-0"]
    run = await _resume_to_the_end(runner, agent, "dies")
    assert run.status == "completed"
    assert oracle.sent == ["0-0", "1-0"]
    assert provider.calls == 4
    # Never twice; today the in-doubt group's charge is not made again (one short).
    assert await _spent(pg_stores, "dies") in (COST * provider.calls, COST * (provider.calls - 1))
    _pool_is_clean(pg_stores)


async def test_a_group_the_server_ended_while_frozen_charges_every_model_call_once(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's frozen holder (SIGSTOP, a paused VM): the server ends the group's
    session after twice the store timeout; the claim's message, carrying the COMMIT, then
    finds the session gone. Nothing of the group was committed, for certain."""
    import time

    stores = open_postgres_stores(services.with_query(pg_url, timeout="0.5"))
    try:
        await stores.create_schema()
        claim = stores.idempotency.claim
        claims: list[int] = []

        async def frozen_before_the_second(*args: Any, **kwargs: Any) -> Any:
            claims.append(1)
            if len(claims) == 2:
                time.sleep(2.5)  # noqa: ASYNC251 - the process stops: no timer, no renewal fires
            return await claim(*args, **kwargs)

        monkeypatch.setattr(stores.idempotency, "claim", frozen_before_the_second)
        oracle = Oracle()
        provider = ScriptedProvider(_script(2, 1))
        runner = AgentRunner.from_stores(provider, stores)
        agent = oracle.agent()
        with pytest.raises(StoreUnavailableError):
            await runner.run(agent, "go", tenant=T, run_id="frozen")
        assert oracle.sent == ["0-0"]
        run = await _resume_to_the_end(runner, agent, "frozen")
        assert run.status == "completed"
        assert oracle.sent == ["0-0", "1-0"]
        assert provider.calls == 4
        assert await _spent(stores, "frozen") == COST * provider.calls
    finally:
        await stores.aclose()


# --- (3) an outcome whose group's COMMIT rode with the cancel check ----------------------


async def _on_outcome_at_commit(admin: psycopg.AsyncConnection[Any], action: str) -> None:
    """A deferred trigger that runs ``action`` at the COMMIT of the first transaction that
    records an outcome (the group the cancel check commits)."""
    await admin.execute("CREATE SEQUENCE adk_test_once")
    await admin.execute(
        "CREATE FUNCTION adk_test_trap() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.status = 'completed' AND OLD.status = 'in_flight' "
        f"AND nextval('adk_test_once') = 1 THEN {action}; END IF; RETURN NEW; END $$"
    )
    await admin.execute(
        "CREATE CONSTRAINT TRIGGER adk_test_trap AFTER UPDATE ON adk_idempotency "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
    )


@pytest.mark.parametrize(
    "how",
    ["lost-before-sent", "lost-after-commit", "refused-at-commit", "killed-at-commit"],
)
async def test_an_outcome_committed_with_the_cancel_check_is_never_lost_nor_sent_twice(
    pg_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    if how.startswith("lost"):
        hits = _wrap_batched(monkeypatch, _lookup_with_commit(), after=how.endswith("commit"))
    elif how == "refused-at-commit":
        await _on_outcome_at_commit(pg_admin, "RAISE EXCEPTION 'refused at commit'")
    else:
        await _on_outcome_at_commit(pg_admin, services.marked_sleep(SLEEPER))
    oracle = Oracle()
    provider = ScriptedProvider(_script(2, 1))
    runner = AgentRunner.from_stores(provider, pg_stores)
    agent = oracle.agent()
    running = asyncio.ensure_future(runner.run(agent, "go", tenant=T, run_id="cc"))
    if how == "killed-at-commit":
        pid = await _backend_asleep(pg_admin)
        await pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(StoreUnavailableError):
        await running
    monkeypatch.undo()
    if how.startswith("lost"):
        assert hits == [1]
    assert oracle.sent == ["0-0"]
    # The outcome is durable now, whatever became of its group (recorded again alone).
    assert await _statuses(pg_stores, "cc") == {"call_0_0": "completed"}
    run = await _resume_to_the_end(runner, agent, "cc")
    assert run.status == "completed"
    assert oracle.sent == ["0-0", "1-0"]
    assert await _spent(pg_stores, "cc") == COST * provider.calls
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)


# --- (6) the run's task cancelled at each statement --------------------------------------


async def _cancelled_at(
    stores: Stores, monkeypatch: pytest.MonkeyPatch, run_id: str, nth: int | None, after: bool
) -> tuple[int, Oracle, ScriptedProvider, Any]:
    """A run of two turns of two calls, its task cancelled at its ``nth`` statement (before
    the message goes, or once its answer is in), then resumed to the end; the statements
    counted, the oracle, the provider, and how the resume ended."""
    oracle = Oracle()
    provider = ScriptedProvider(_script(2, 2))
    runner = AgentRunner.from_stores(provider, stores)
    agent = oracle.agent()
    task: asyncio.Task[Any] | None = None
    count = 0
    execute = psycopg.AsyncCursor.execute

    async def counting(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        hit = nth is not None and count == nth and task is not None and not task.done()
        if hit and not after:
            assert task is not None
            task.cancel()
        result = await execute(self, query, *args, **kwargs)
        if hit and after:
            assert task is not None
            task.cancel()
        return result

    with monkeypatch.context() as patch:
        patch.setattr(psycopg.AsyncCursor, "execute", counting)
        task = asyncio.ensure_future(runner.run(agent, "go", tenant=T, run_id=run_id))
        with contextlib.suppress(asyncio.CancelledError, AdkError):
            first = await task
            if nth is None:
                return count, oracle, provider, first
    ended = await _resume_to_the_end(runner, agent, run_id)
    return count, oracle, provider, ended


async def test_a_run_cancelled_at_any_statement_books_each_seat_once_and_never_charges_twice(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    total, _, _, clean = await _cancelled_at(pg_stores, monkeypatch, "clean", None, False)
    assert clean.status == "completed"
    assert total >= 20
    seats = [f"{t}-{c}" for t in range(2) for c in range(2)]
    needless: list[tuple[int, bool, list[str]]] = []
    for nth in range(1, total + 1):
        for after in (False, True):
            run_id = f"c{nth}-{int(after)}"
            _, oracle, provider, ended = await _cancelled_at(
                pg_stores, monkeypatch, run_id, nth, after
            )
            assert len(oracle.sent) == len(set(oracle.sent)), (nth, after, oracle.sent)
            assert await _spent(pg_stores, run_id) <= COST * provider.calls, (nth, after)
            if isinstance(ended, IndeterminateToolCallError):
                # Refused as in doubt: only ever a call that was really sent.
                doubted = [
                    f"{c.call_id.split('_')[1]}-{c.call_id.split('_')[2]}" for c in ended.calls
                ]
                if not set(doubted) <= set(oracle.sent):
                    needless.append((nth, after, doubted))
                continue
            assert ended.status == "completed", (nth, after, ended)
            assert sorted(oracle.sent) == seats, (nth, after, oracle.sent)
    assert needless == []
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)


# --- twin calls under one business key ---------------------------------------------------


def _seat_key(*, arguments: Any, occurrence: int = 0, **_: Any) -> str:
    # Takes ``occurrence`` and ignores it: twins share the key, and so does a later turn's.
    return f"seat-{arguments['seat']}"


@pytest.mark.parametrize("lost", [None, False, True], ids=["clean", "before-sent", "after"])
async def test_twins_under_one_key_are_sent_once_whatever_the_twins_claim_message_meets(
    pg_stores: Stores, monkeypatch: pytest.MonkeyPatch, lost: bool | None
) -> None:
    """The second twin's claim finds the first's outcome in the open group (nothing goes
    out, so the group stays open); the message committing the run's second claim (the
    cancel check after it) lost, before it went or after the COMMIT ran, loses neither the
    first twin's outcome nor sends anything again."""
    sent: list[str] = []

    @tool(key=_seat_key)
    async def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    claims: list[int] = []
    committing_a_claim = _claim_with_commit()

    def second_claim(before: Any, statements: Any, tail: Any, conn: Any) -> bool:
        if not committing_a_claim(before, statements, tail, conn):
            return False
        claims.append(1)
        return len(claims) == 2

    if lost is not None:
        _wrap_batched(monkeypatch, second_claim, after=lost)
    script = [
        ScriptedTurn(calls=[("book", {"seat": "a"}), ("book", {"seat": "a"})], cost_micros=COST),
        ScriptedTurn(calls=[("book", {"seat": "a"}), ("book", {"seat": "b"})], cost_micros=COST),
        ScriptedTurn(text="done", cost_micros=COST),
    ]
    provider = ScriptedProvider(script)
    runner = AgentRunner.from_stores(provider, pg_stores)
    agent = Agent("g", "b", tools=[book], max_iterations=20)
    try:
        run = await runner.run(agent, "go", tenant=T, run_id="twins")
    except StoreUnavailableError:
        # The message committing a claim (the cancel check after it) lost: the run stops
        # retryably, its claim dropped or in doubt, and a resume carries it on.
        monkeypatch.undo()
        run = await _resume_to_the_end(runner, agent, "twins")
    assert run.status == "completed"
    assert sorted(sent) == ["a", "b"]
    assert await _spent(pg_stores, "twins") == COST * provider.calls


# --- (5) the pool: many runs on two connections -----------------------------------------


async def test_six_runs_on_a_pool_of_two_each_book_once_and_leave_the_pool_clean(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    stores = open_postgres_stores(services.with_query(pg_url, pool_max="2"))
    try:
        await stores.create_schema()
        oracle = Oracle()
        providers = [ScriptedProvider(_script(3, 3)) for _ in range(6)]
        runs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    AgentRunner.from_stores(p, stores).run(
                        oracle.agent(), "go", tenant=T, run_id=f"p{i}"
                    )
                    for i, p in enumerate(providers)
                )
            ),
            120,
        )
        assert [r.status for r in runs] == ["completed"] * 6
        assert len(oracle.sent) == 6 * 9
        assert sorted(set(oracle.sent)) == sorted(f"{t}-{c}" for t in range(3) for c in range(3))
        for i, p in enumerate(providers):
            assert await _spent(stores, f"p{i}") == COST * p.calls
        _pool_is_clean(stores)
        await _no_open_transactions(pg_admin, stores)
    finally:
        await stores.aclose()


async def test_a_group_whose_commit_rode_with_the_claim_is_closed_and_its_connection_back(
    pg_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the claim's message carried the COMMIT, nothing more goes to that group: no
    SAVEPOINT outside a transaction, no connection handed back twice."""
    seen: list[tuple[str, str]] = []

    async def watching(
        conn: Any, before: Any, statements: Any, tail: Any = (), prepared: Any = None
    ):
        status = conn.info.transaction_status
        # A message without BEGIN goes into an open transaction, never an idle connection.
        if not any(s.startswith("BEGIN") for s in before):
            seen.append((status.name, statements[0][0][:40]))
        return await REAL_BATCHED(conn, before, statements, tail, prepared)

    monkeypatch.setattr(pg_grouping, "batched", watching)
    puts: list[Any] = []
    pool = pg_stores.idempotency.database.pool  # type: ignore[attr-defined]
    putconn = pool.putconn

    async def counting_put(conn: Any) -> None:
        assert conn not in puts[-1:], "the same connection handed back twice in a row"
        puts.append(conn)
        await putconn(conn)

    monkeypatch.setattr(pool, "putconn", counting_put)
    oracle = Oracle()
    provider = ScriptedProvider(_script(3, 3))
    run = await AgentRunner.from_stores(provider, pg_stores).run(
        oracle.agent(), "go", tenant=T, run_id="closed"
    )
    assert run.status == "completed"
    assert seen and {s for s, _ in seen} == {"INTRANS"}
    _pool_is_clean(pg_stores)


# --- (7) a real process killed around the claim's message --------------------------------

_CHILD = r"""
import asyncio, sys, time
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import grouping as g, open_postgres_stores
from tesserix_adk.leases import LeasePolicy

url, run_id, mode, log = sys.argv[1:5]
real = g.batched
claims = []
after_claim = {}

async def wrapped(conn, before, statements, tail=(), prepared=None):
    # The second call's claim (asleep: the message holding it sleeps in the server), or
    # the message committing it (the cancel check after it, with the COMMIT).
    sql = statements[0][0].upper()
    claiming = "ADK_IDEMPOTENCY" in sql and "INSERT" in sql
    claims.extend([1] if claiming else [])
    committing = "COMMIT" in tail and after_claim.get(id(conn), False) and not claiming
    after_claim[id(conn)] = claiming
    target = len(claims) == 2 and (claiming if mode == "asleep" else committing)
    if target and mode in ("before", "asleep"):
        print("PAUSED", flush=True)
        if mode == "before":
            time.sleep(600)
    result = await real(conn, before, statements, tail, prepared)
    if target and mode == "after":
        print("PAUSED", flush=True)
        time.sleep(600)
    return result

g.batched = wrapped

@tool
async def book(seat: str) -> str:
    with open(log, "a") as f:
        f.write(seat + "\n")
    return "booked " + seat

async def main():
    stores = open_postgres_stores(url)
    script = [ScriptedTurn(calls=[("book", {"seat": "0-0"}), ("book", {"seat": "0-1"})],
                           cost_micros=100), ScriptedTurn(text="done", cost_micros=100)]
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores, group_writes=True,
                                     lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5))
    await runner.run(Agent("g", "b", tools=[book]), "go", tenant="acme", run_id=run_id)
    print("FINISHED", flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["before", "asleep", "after"])
async def test_a_process_killed_around_the_claims_message_never_sends_a_call_twice(
    pg_stores: Stores,
    pg_url: str,
    pg_admin: psycopg.AsyncConnection[Any],
    tmp_path: Any,
    mode: str,
) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tesserix_adk.errors import ResumeConflictError

    if mode == "asleep":
        # The second claim sleeps in the server: the process dies with its message there.
        await pg_admin.execute("CREATE SEQUENCE adk_test_once")
        await pg_admin.execute(
            "CREATE FUNCTION adk_test_trap() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF nextval('adk_test_once') = 2 THEN {services.marked_sleep(SLEEPER, 1)}; "
            "END IF; "
            "RETURN NEW; END $$"
        )
        await pg_admin.execute(
            "CREATE TRIGGER adk_test_trap BEFORE INSERT ON adk_idempotency "
            "FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
        )
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    log = tmp_path / "sent.log"
    log.write_text("")
    proc = subprocess.Popen(  # noqa: ASYNC220 - read from a thread below
        [sys.executable, str(script), pg_url, "k", mode, str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == "PAUSED", line + (proc.stderr.read() if proc.stderr else "")
        if mode == "asleep":
            await _backend_asleep(pg_admin)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        await asyncio.to_thread(proc.communicate, timeout=30)
    child_sent = log.read_text().split()
    assert child_sent == ["0-0"]
    if mode == "asleep":
        # The orphaned backend wakes and finishes the message, COMMIT included.
        for _ in range(500):
            if await services.still_asleep(pg_admin, SLEEPER) == 0:
                break
            await asyncio.sleep(0.01)
    sent: list[str] = []

    @tool
    async def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    script_turns = [
        ScriptedTurn(calls=[("book", {"seat": "0-0"}), ("book", {"seat": "0-1"})], cost_micros=1),
        ScriptedTurn(text="done", cost_micros=1),
    ]
    runner = AgentRunner.from_stores(ScriptedProvider(script_turns), pg_stores)
    agent = Agent("g", "b", tools=[book])
    ended: Any = None
    for _ in range(200):
        try:
            ended = await runner.resume(agent, "k", tenant=T)
            break
        except IndeterminateToolCallError as exc:
            ended = exc
            break
        except ResumeConflictError:  # the dead holder's lease has not lapsed yet
            await asyncio.sleep(0.05)
    assert ended is not None
    everything = child_sent + sent
    assert len(everything) == len(set(everything)), everything
    if isinstance(ended, IndeterminateToolCallError):
        doubted = {c.call_id for c in ended.calls}
        # "before" the message committing the second claim, or while the claim itself
        # sleeps in the server: the first call ran and its outcome was in the group that
        # never committed; "after" it: the second claim is durable, and it may have been
        # sent.
        assert doubted == ({"call_0_1"} if mode == "after" else {"call_0_0"}), doubted
    else:
        assert ended.status == "completed"
        assert sorted(everything) == ["0-0", "0-1"]
