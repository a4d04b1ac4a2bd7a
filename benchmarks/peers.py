"""The other side of each comparison, on the conversation of ``conversation.py``.

- Raw floors: what a turn must cost at least on a backend, written with the plain driver
  (``sqlite3``, psycopg), no framework: the turn's assistant message and result as JSON,
  the call's record (claimed, then completed with its outcome) and a small frontier, in
  either **3 commits** per turn (frontier + assistant; claim; outcome + result + frontier)
  or **2** (the claim joins the first). PostgreSQL writes each commit as one statement (a
  CTE), one round trip.
- LangGraph: a two-node graph (model node, tool node; the messages channel appends) with
  ``SqliteSaver`` / ``PostgresSaver`` and ``durability="sync"`` (each step's checkpoint
  committed before the next step, as ours is).
- DBOS: one workflow whose turn is two ``@DBOS.step``s (the model's answer, the tool's
  result), on a SQLite or PostgreSQL system database, as DBOS sets them up.

Each returns one figure per turn (the time between two model calls), like ``ours.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import operator
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import conversation as conv

Window = Callable[[], AbstractContextManager[Any]]


@dataclass
class Stamper:
    """Stamps each model call; counts (``window``) the ``window_turns`` turns before the last."""

    turns: int
    window: Window | None = None
    window_turns: int = 0
    probe: Callable[[int], None] | None = None
    stamps: list[float] = field(default_factory=list)
    counts: Any = None
    _open: Any = None

    def __call__(self) -> None:
        self.stamps.append(time.perf_counter())
        calls = len(self.stamps) - 1
        if self.probe is not None:
            self.probe(calls)
        start = max(1, self.turns - self.window_turns - 1)
        if self.window is None:
            return
        if calls == start:
            self._open = self.window()
            self.counts = self._open.__enter__()
        elif calls == start + self.window_turns and self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def per_turn(self) -> list[float]:
        s = self.stamps
        return [b - a for a, b in itertools.pairwise(s)][: self.turns]


def _frontier(step: int, index: int, outstanding: str | None) -> bytes:
    doc = {
        "format": 1,
        "step": step,
        "iteration": index,
        "boundary": "after_model_call" if outstanding else "after_tool_result",
        "outstanding": [outstanding] if outstanding else [],
        "transcript": 1 + 2 * index + (1 if outstanding else 2),
    }
    return json.dumps(doc).encode()


def _key(run: str, turn: conv.Turn) -> str:
    canonical = json.dumps(turn.arguments, sort_keys=True)
    return hashlib.sha256(f"{run}|{turn.index}|{conv.TOOL}|{canonical}".encode()).hexdigest()


# --- the floors --------------------------------------------------------------------------


class Floor:
    """A floor that writes one turn at a time (``turn(i)``), so a framework's turns can be
    interleaved with it turn by turn; ``close()`` when done."""

    def __init__(self, commits: int) -> None:
        self.commits = commits
        self.run = uuid.uuid4().hex
        self.step = 0

    def turn(self, i: int) -> None:
        turn = conv.turn(i)
        key = _key(self.run, turn)
        self.step += 1
        self._first(i, turn, key, _frontier(self.step, i, key))
        self.step += 1
        self._second(i, turn, key, _frontier(self.step, i, None))

    def _first(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        raise NotImplementedError

    def _second(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _floor_turns(
    floor: Floor,
    turns: int,
    window: Window | None,
    window_turns: int,
    probe: Callable[[int], None] | None,
) -> Stamper:
    try:
        stamp = Stamper(turns, window, window_turns, probe)
        for i in range(turns):
            stamp()
            floor.turn(i)
        stamp()
        return stamp
    finally:
        floor.close()


_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS transcript (run TEXT, seq INTEGER, body BLOB, PRIMARY KEY (run, seq));
CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, run TEXT, state TEXT, outcome BLOB);
CREATE TABLE IF NOT EXISTS frontier (run TEXT PRIMARY KEY, step INTEGER, body BLOB);
"""
_UPSERT_FRONTIER = (
    "INSERT INTO frontier VALUES (?, ?, ?) "
    "ON CONFLICT (run) DO UPDATE SET step = excluded.step, body = excluded.body"
)


class SqliteFloor(Floor):
    """``BEGIN IMMEDIATE`` … ``COMMIT`` with plain ``sqlite3``, WAL, ``synchronous`` as asked."""

    def __init__(self, path: str, synchronous: str, commits: int) -> None:
        super().__init__(commits)
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        self.conn.executescript(_SQLITE_SCHEMA)

    def _first(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO transcript VALUES (?, ?, ?)", (self.run, 2 * i + 1, turn.assistant_json())
        )
        conn.execute(_UPSERT_FRONTIER, (self.run, self.step, frontier))
        if self.commits == 3:
            conn.execute("COMMIT")
            conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO records VALUES (?, ?, 'in_flight', NULL)", (key, self.run))
        conn.execute("COMMIT")

    def _second(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE records SET state = 'completed', outcome = ? WHERE key = ?",
            (turn.result.encode(), key),
        )
        conn.execute(
            "INSERT INTO transcript VALUES (?, ?, ?)", (self.run, 2 * i + 2, turn.result_json())
        )
        conn.execute(_UPSERT_FRONTIER, (self.run, self.step, frontier))
        conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


def sqlite_floor(
    path: str,
    synchronous: str,
    commits: int,
    turns: int,
    window: Window | None = None,
    window_turns: int = 0,
    probe: Callable[[int], None] | None = None,
) -> Stamper:
    """``turns`` turns in ``commits`` (2 or 3) commits each with plain ``sqlite3``."""
    return _floor_turns(SqliteFloor(path, synchronous, commits), turns, window, window_turns, probe)


def sqlite_stored_bytes(path: str) -> int:
    """Bytes the database holds in use (pages minus free pages), its WAL folded in first."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)
    finally:
        conn.close()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS transcript (run text, seq int, body bytea, PRIMARY KEY (run, seq));
CREATE TABLE IF NOT EXISTS records (key text PRIMARY KEY, run text, state text, outcome bytea);
CREATE TABLE IF NOT EXISTS frontier (run text PRIMARY KEY, step int, body bytea)
"""
_PG_FRONTIER = (
    "INSERT INTO frontier VALUES (%(run)s, %(step)s, %(frontier)s) "
    "ON CONFLICT (run) DO UPDATE SET step = excluded.step, body = excluded.body"
)
_PG_FIRST_3 = (
    "WITH t AS (INSERT INTO transcript VALUES (%(run)s, %(seq)s, %(body)s)) " + _PG_FRONTIER
)
_PG_CLAIM = "INSERT INTO records VALUES (%(key)s, %(run)s, 'in_flight', NULL)"
_PG_FIRST_2 = (
    "WITH t AS (INSERT INTO transcript VALUES (%(run)s, %(seq)s, %(body)s)), "
    "c AS (INSERT INTO records VALUES (%(key)s, %(run)s, 'in_flight', NULL)) " + _PG_FRONTIER
)
_PG_SECOND = (
    "WITH r AS (UPDATE records SET state = 'completed', outcome = %(outcome)s "
    "WHERE key = %(key)s), t AS (INSERT INTO transcript VALUES (%(run)s, %(seq)s, %(body)s)) "
    + _PG_FRONTIER
)


class PostgresFloor(Floor):
    """Each commit one autocommitted statement (a CTE), one round trip, with psycopg."""

    def __init__(self, url: str, commits: int) -> None:
        import psycopg

        super().__init__(commits)
        self.conn = psycopg.connect(url, autocommit=True)
        for ddl in _PG_SCHEMA.split(";"):
            self.conn.execute(ddl)

    def _first(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        args = {"run": self.run, "seq": 2 * i + 1, "body": turn.assistant_json(),
                "step": self.step, "frontier": frontier, "key": key}  # fmt: skip
        if self.commits == 3:
            self.conn.execute(_PG_FIRST_3, args, prepare=True)
            self.conn.execute(_PG_CLAIM, args, prepare=True)
        else:
            self.conn.execute(_PG_FIRST_2, args, prepare=True)

    def _second(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        args = {"run": self.run, "seq": 2 * i + 2, "body": turn.result_json(),
                "step": self.step, "frontier": frontier, "key": key,
                "outcome": turn.result.encode()}  # fmt: skip
        self.conn.execute(_PG_SECOND, args, prepare=True)

    def close(self) -> None:
        self.conn.close()


def postgres_floor(
    url: str,
    commits: int,
    turns: int,
    window: Window | None = None,
    window_turns: int = 0,
    probe: Callable[[int], None] | None = None,
) -> Stamper:
    """``turns`` turns in ``commits`` (2 or 3) autocommitted statements each with psycopg."""
    return _floor_turns(PostgresFloor(url, commits), turns, window, window_turns, probe)


class RedisFloor(Floor):
    """Each commit one ``MULTI``/``EXEC`` pipeline with redis-py."""

    def __init__(self, url: str, commits: int) -> None:
        import redis

        super().__init__(commits)
        self.client = redis.Redis.from_url(url)
        self.tag = f"floor:{{{self.run}}}"

    def _first(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(f"{self.tag}:transcript", turn.assistant_json())
        pipe.set(f"{self.tag}:frontier", frontier)
        if self.commits == 3:
            pipe.execute()
            pipe = self.client.pipeline(transaction=True)
        pipe.hset(f"{self.tag}:records", key, b"in_flight")
        pipe.execute()

    def _second(self, i: int, turn: conv.Turn, key: str, frontier: bytes) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(f"{self.tag}:records", key, b"completed:" + turn.result.encode())
        pipe.rpush(f"{self.tag}:transcript", turn.result_json())
        pipe.set(f"{self.tag}:frontier", frontier)
        pipe.execute()

    def close(self) -> None:
        self.client.close()


def redis_floor(
    url: str,
    commits: int,
    turns: int,
    window: Window | None = None,
    window_turns: int = 0,
    probe: Callable[[int], None] | None = None,
) -> Stamper:
    """``turns`` turns in ``commits`` (2 or 3) MULTI/EXEC pipelines each with redis-py."""
    return _floor_turns(RedisFloor(url, commits), turns, window, window_turns, probe)


# --- LangGraph ---------------------------------------------------------------------------


class _State(TypedDict):
    messages: Annotated[list[dict[str, Any]], operator.add]


def _assistant(turn: conv.Turn) -> dict[str, Any]:
    call = {"id": turn.call_id, "name": conv.TOOL, "args": dict(turn.arguments)}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _tool_message(turn: conv.Turn) -> dict[str, Any]:
    return {"role": "tool", "content": turn.result, "tool_call_id": turn.call_id}


def _graph(saver: Any, turns: int, stamp: Callable[[], None]) -> Any:
    from langgraph.graph import END, START, StateGraph

    def model(state: _State) -> dict[str, Any]:
        stamp()
        index = (len(state["messages"]) - 1) // 2
        if index >= turns:
            return {"messages": [{"role": "assistant", "content": conv.ANSWER}]}
        return {"messages": [_assistant(conv.turn(index))]}

    def tools(state: _State) -> dict[str, Any]:
        call = state["messages"][-1]["tool_calls"][0]
        return {"messages": [_tool_message(conv.turn(int(call["args"]["page"])))]}

    def route(state: _State) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    builder = StateGraph(_State)
    builder.add_node("model", model)
    builder.add_node("tools", tools)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tools", END])
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=saver)


def _question() -> dict[str, Any]:
    return {"role": "user", "content": conv.QUESTION}


@contextmanager
def langgraph_sqlite(path: str, synchronous: str) -> Iterator[Any]:
    """A ``SqliteSaver`` on ``path`` with ``synchronous`` set on its connection."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(path, check_same_thread=False)
    try:
        saver = SqliteSaver(conn)
        saver.setup()
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        yield saver
    finally:
        conn.close()


@contextmanager
def langgraph_postgres(url: str) -> Iterator[Any]:
    """A ``PostgresSaver`` on ``url`` (its ``search_path`` names the schema)."""
    import psycopg
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg.rows import dict_row

    with psycopg.connect(url, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        saver = PostgresSaver(conn)
        saver.setup()
        yield saver


def langgraph_turns(
    saver: Any,
    turns: int,
    window: Window | None = None,
    window_turns: int = 0,
    probe: Callable[[int], None] | None = None,
) -> Stamper:
    """The conversation through the graph, on a new thread of ``saver``."""
    stamp = Stamper(turns, window, window_turns, probe)
    graph = _graph(saver, turns, stamp)
    config = {"configurable": {"thread_id": uuid.uuid4().hex}, "recursion_limit": 2 * turns + 10}
    graph.invoke({"messages": [_question()]}, config, durability="sync")
    return stamp


def langgraph_get_state(saver: Any, turns: int, times: int) -> list[float]:
    """``get_state`` on a thread whose latest checkpoint holds ``turns`` turns (written in
    one update: writing it step by step grows as the square of the run)."""
    graph = _graph(saver, turns, lambda: None)
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    messages = [_question()]
    for i in range(turns):
        messages += [_assistant(conv.turn(i)), _tool_message(conv.turn(i))]
    graph.update_state(config, {"messages": messages}, as_node="tools")
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        state = graph.get_state(config)
        seconds.append(time.perf_counter() - started)
        if len(state.values["messages"]) != len(messages):
            raise RuntimeError("LangGraph's state does not hold the conversation")
    return seconds


# --- DBOS --------------------------------------------------------------------------------


class Dbos:
    """DBOS launched on one system database; ``turns`` runs one workflow of the conversation."""

    def __init__(self, system_database_url: str, schema: str | None = None) -> None:
        from dbos import DBOS

        logging.getLogger("dbos").setLevel(logging.WARNING)
        config: dict[str, Any] = {
            "name": "tesserix-bench",
            "system_database_url": system_database_url,
            "run_admin_server": False,
            "log_level": "WARNING",
        }
        if schema is not None:
            config["dbos_system_schema"] = schema
        self.stamp: Stamper | None = None
        bench = self

        @DBOS.step()
        def model(index: int, turns: int) -> dict[str, Any]:
            assert bench.stamp is not None
            bench.stamp()
            if index >= turns:
                return {"role": "assistant", "content": conv.ANSWER}
            return _assistant(conv.turn(index))

        @DBOS.step()
        def act(page: int) -> str:
            return conv.turn(page).result

        @DBOS.workflow()
        def conversation(turns: int) -> int:
            for index in range(turns + 1):
                message = model(index, turns)
                if not message.get("tool_calls"):
                    break
                act(int(message["tool_calls"][0]["args"]["page"]))
            return turns

        self._dbos = DBOS(config=config)  # type: ignore[arg-type]
        self._workflow = conversation
        DBOS.launch()

    def turns(
        self,
        turns: int,
        window: Window | None = None,
        window_turns: int = 0,
        probe: Callable[[int], None] | None = None,
    ) -> Stamper:
        self.stamp = Stamper(turns, window, window_turns, probe)
        self._workflow(turns)
        return self.stamp

    def close(self) -> None:
        from dbos import DBOS

        DBOS.destroy(destroy_registry=True)
