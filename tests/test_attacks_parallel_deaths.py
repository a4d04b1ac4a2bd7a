"""Attacks on parallel turns, approvals and write groups across real process deaths, on
PostgreSQL (a schema of the test's own) and Redis (a prefix of its own).

One agent file (written to the test's directory, so the real ``tesserix`` console script
loads it as an operator would: ``--agent path:agent``) asks, in one turn, for a chosen mix
of side-effecting calls: ``hold_seat`` and ``email`` (sent at once) and ``charge`` (needs a
person). Every effect is a row in an "airline" SQLite file of the test's own, carrying the
call's idempotency key, so a test counts effects per key. ``PD_PLAN`` (JSON, call id → where
it stops) holds a call at a point so a SIGKILL lands on a known mix:

- ``before``: claimed and running, its effect not made;
- ``after``: its effect made, the tool not returned;
- ``done``: its outcome handed to the store (``complete`` returned), its slot still held;
- ``claim``: the process stops as the call's claim is about to be written.

The oracle: each call's effect happens exactly once, or the call is refused in doubt and
named; never twice, never silently dropped; the model is told each result in its order.
A test marked ``xfail(strict=True)`` is a defect: it asserts what should hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from processes import held_open, store_url
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")

T = "acme"
REPO = Path(__file__).resolve().parents[1]
TESSERIX = str(REPO / ".venv" / "bin" / "tesserix")

# Each case runs on PostgreSQL in CI and on Redis too with ADK_SLOW=1 (`make test` stays
# under 20 minutes); the first case runs on both always.
BOTH_BACKENDS = [
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]
DEATH_BACKENDS = [
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("redis", id="redis", marks=[pytest.mark.redis, pytest.mark.slow]),
]

AGENT_FILE = r'''
"""The agent of tests/test_attacks_parallel_deaths.py (written by the test)."""
import asyncio, json, os, sqlite3, sys, threading, time

from tesserix_adk import Agent, ModelResponse, Reconciled, ToolContext, tool
from tesserix_adk.messages import Message, Role, ToolCall

AIRLINE = os.environ["PD_AIRLINE"]
TURN = json.loads(os.environ["PD_TURN"])  # [[call id, tool, item], ...]
PARALLEL = int(os.environ.get("PD_PARALLEL", "4"))
RECONCILE = os.environ.get("PD_RECONCILE") == "1"
_lock = threading.Lock()


def _plan():
    raw = os.environ.get("PD_PLAN", "")
    return json.loads(raw) if raw else {}


def say(line):
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _hold(call_id, point):
    say(f"AT {call_id} {point}")
    time.sleep(3600)


async def _ahold(call_id, point):
    say(f"AT {call_id} {point}")
    await asyncio.sleep(3600)


def _patch():
    """Hold a call whose claim is about to be written, or whose outcome was just handed
    to the store, on every backend's idempotency store."""
    from tesserix_adk.adapters.postgres.idempotency import PostgresIdempotencyStore
    from tesserix_adk.adapters.redis.idempotency import RedisIdempotencyStore
    from tesserix_adk.stores.sqlite.idempotency import SqliteIdempotencyStore

    for cls in (PostgresIdempotencyStore, RedisIdempotencyStore, SqliteIdempotencyStore):
        claim, complete = cls.claim, cls.complete

        async def claim_(self, *a, _claim=claim, **kw):
            cid = kw.get("call_id")
            if kw.get("tool") is not None and _plan().get(cid) == "claim":
                await _ahold(cid, "claim")
            return await _claim(self, *a, **kw)

        async def complete_(self, *a, _complete=complete, **kw):
            rec = await _complete(self, *a, **kw)
            if rec.tool is not None:
                say(f"COMPLETED {rec.call_id}")
                if _plan().get(rec.call_id) == "done":
                    await _ahold(rec.call_id, "done")
            return rec

        cls.claim, cls.complete = claim_, complete_

    from tesserix_adk.adapters.postgres.approvals import PostgresApprovalStore
    from tesserix_adk.adapters.redis.approvals import RedisApprovalStore
    from tesserix_adk.stores.sqlite.approvals import SqliteApprovalStore

    for cls in (PostgresApprovalStore, RedisApprovalStore, SqliteApprovalStore):
        request = cls.request

        async def request_(self, *a, _request=request, **kw):
            req = await _request(self, *a, **kw)
            if _plan().get("approval") == "asked":
                await _ahold(req.id, "asked")
            return req

        cls.request = request_


_patch()


def _effect(tool_name, item, ctx):
    point = _plan().get(ctx.call.id)
    if point == "before":
        _hold(ctx.call.id, point)
    conn = sqlite3.connect(AIRLINE, timeout=30, isolation_level=None)
    try:
        conn.execute(
            "INSERT INTO effects (key, tool, call_id, run_id, item) VALUES (?, ?, ?, ?, ?)",
            (ctx.idempotency_key, tool_name, ctx.call.id, ctx.run_id, item),
        )
    finally:
        conn.close()
    if point == "after":
        _hold(ctx.call.id, point)
    return {"done": tool_name, "item": item}


def _look_up(call, ctx):
    conn = sqlite3.connect(AIRLINE, timeout=30, isolation_level=None)
    try:
        row = conn.execute(
            "SELECT tool FROM effects WHERE key = ?", (ctx.idempotency_key,)
        ).fetchone()
    finally:
        conn.close()
    if row is None:
        return Reconciled.never_ran()
    return Reconciled.completed({"done": row[0], "item": call.arguments.get("item")})


REC = _look_up if RECONCILE else None


@tool(name="hold_seat", reconcile=REC)
def hold_seat(item: str, ctx: ToolContext) -> dict:
    """Hold a seat."""
    return _effect("hold_seat", item, ctx)


@tool(name="charge", requires_approval=True, reconcile=REC)
def charge(item: str, ctx: ToolContext) -> dict:
    """Charge the card (a person agrees first)."""
    return _effect("charge", item, ctx)


@tool(name="email", reconcile=REC)
def email(item: str, ctx: ToolContext) -> dict:
    """Send the confirmation."""
    return _effect("email", item, ctx)


agent = Agent("trip", "Book the trip.", [hold_seat, charge, email], parallel_tool_calls=PARALLEL)


class Model:
    """Asks for TURN at once, then answers with every result it was given, in order."""

    async def complete(self, request):
        results = [m for m in request.messages if m.role is Role.tool]
        if not results:
            calls = [ToolCall(id=c, name=n, arguments={"item": i}) for c, n, i in TURN]
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=calls))
        told = [[m.tool_call_id, m.is_error, str(m.content)] for m in results]
        return ModelResponse(message=Message(Role.assistant, json.dumps(told)))


PROVIDER = Model
'''

DRIVER = r"""
import asyncio, importlib.util, sys
from tesserix_adk import AgentRunner, LeasePolicy
from tesserix_adk.errors import AdkError
from tesserix_adk.stores import open_stores

command, run_id, url, path, grouped = sys.argv[1:6]
spec = importlib.util.spec_from_file_location("pd_agent", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)


async def main():
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(
            module.Model(), stores, worker="dying",
            lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5), resume_claim_ttl=1.0,
            never_ran_margin=0.2, group_writes=grouped == "1",
        )
        try:
            if command == "run":
                run = await runner.run(module.agent, "go", tenant="acme", run_id=run_id)
            else:
                run = await runner.resume(module.agent, run_id, tenant="acme")
        except AdkError as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
            return 4
    if run.pending_approval is not None:
        print(f"PENDING {run.pending_approval.id}", flush=True)
    print(f"RESULT {run.status.value} {run.output}", flush=True)
    return 0


sys.exit(asyncio.run(main()))
"""


class Site:
    """A store (schema applied), an airline and the agent file, shared by every process."""

    def __init__(
        self, tmp: Path, url: str, turn: list[list[str]], *, reconcile: bool = False
    ) -> None:
        self.tmp, self.url, self.turn = tmp, url, turn
        self.airline = str(tmp / "airline.sqlite3")
        with sqlite3.connect(self.airline) as conn:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, key TEXT, "
                "tool TEXT, call_id TEXT, run_id TEXT, item TEXT)"
            )
        conn.close()
        self.agent = tmp / "pd_agent.py"
        self.agent.write_text(AGENT_FILE)
        self.env = {
            **os.environ,
            "PD_AIRLINE": self.airline,
            "PD_TURN": json.dumps(turn),
            "PD_RECONCILE": "1" if reconcile else "0",
            "ADK_STORE": url,
        }
        self.env.pop("PD_PLAN", None)
        asyncio.run(self._apply_schema())

    async def _apply_schema(self) -> None:
        async with open_stores(self.url) as stores:
            await stores.create_schema()

    # --- processes ------------------------------------------------------------------------

    def start(
        self, command: str, run_id: str, plan: dict[str, str] | None = None, *, grouped=False
    ) -> subprocess.Popen[str]:
        env = {**self.env, "PD_PLAN": json.dumps(plan)} if plan else self.env
        argv = [sys.executable, "-c", DRIVER, command, run_id, self.url, str(self.agent)]
        return subprocess.Popen(
            [*argv, "1" if grouped else "0"],
            env=env,
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(self, command: str, run_id: str, *, grouped: bool = False) -> str:
        proc = self.start(command, run_id, grouped=grouped)
        out, _ = proc.communicate(timeout=90)
        assert "Traceback" not in out, out
        return out

    def kill_when(
        self,
        command: str,
        run_id: str,
        plan: dict[str, str],
        reached: set[str],
        *,
        grouped: bool = False,
        then: Any = None,
        asked: bool = False,
    ) -> list[str]:
        """Carry the run until every line of ``reached`` is printed, call ``then`` (the
        process still alive, holding the run), SIGKILL it, wait out its lease and resume
        claim. The lines it printed."""
        proc = self.start(command, run_id, plan, grouped=grouped)
        return self.kill(proc, run_id, reached, then=then, asked=asked)

    def kill(
        self,
        proc: subprocess.Popen[str],
        run_id: str,
        reached: set[str],
        *,
        then: Any = None,
        asked: bool = False,
    ) -> list[str]:
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        out = proc.stdout

        def read() -> None:
            for line in out:
                lines.put(line.rstrip("\n"))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        seen: list[str] = []
        deadline = time.monotonic() + 45
        while not reached <= set(seen) or (asked and not any(" asked" in x for x in seen)):
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
            if seen[-1].startswith(("RESULT", "ERROR", "Traceback")):
                break
        try:
            if reached <= set(seen) and then is not None:
                then()
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            reader.join(timeout=10)
            out.close()
        assert reached <= set(seen), f"never reached {reached - set(seen)}: {seen}"
        assert proc.returncode == -signal.SIGKILL
        self.wait_lapsed(run_id)
        return seen

    def wait_lapsed(self, run_id: str) -> None:
        async def current() -> Any:
            async with open_stores(self.url) as stores:
                return await stores.leases.current(T, run_id)

        deadline = time.monotonic() + 15
        while asyncio.run(current()) is not None:
            assert time.monotonic() < deadline, "the dead process's lease never lapsed"
            time.sleep(0.05)
        time.sleep(1.1)  # its 1 s resume claim lapses too

    def tesserix(self, *argv: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [TESSERIX, *argv, "--store", self.url],
            env=self.env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
        return done

    def approve(self, request: str, *, deny: bool = False) -> None:
        extra = ["--deny", "--note", "no"] if deny else []
        done = self.tesserix("approve", request, "--tenant", T, "--by", "ops", *extra)
        assert done.returncode == 0, done.stdout + done.stderr

    def resolve(self, run_id: str, call_id: str, *how: str) -> subprocess.CompletedProcess[str]:
        return self.tesserix(
            "resolve", run_id, "--tenant", T, "--call", call_id, *how,
            "--by", "ops", "--margin", "0.2",
        )  # fmt: skip

    def operator_resume(self, run_id: str) -> subprocess.CompletedProcess[str]:
        return self.tesserix(
            "run", "--resume", run_id, "--tenant", T, "--agent", f"{self.agent}:agent"
        )

    def worker(self) -> subprocess.CompletedProcess[str]:
        return self.tesserix(
            "worker", "--agent", f"{self.agent}:agent", "--exit-when-idle",
            "--lease-ttl", "2", "--worker", "pd",
        )  # fmt: skip

    def worker_proc(self, plan: dict[str, str]) -> subprocess.Popen[str]:
        """A worker carrying the run under ``plan`` (held calls), until it is killed."""
        return subprocess.Popen(
            [TESSERIX, "worker", "--agent", f"{self.agent}:agent", "--lease-ttl", "1",
             "--worker", "dying", "--store", self.url],
            env={**self.env, "PD_PLAN": json.dumps(plan)},
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip

    def inspect(self, run_id: str) -> dict[str, Any]:
        done = self.tesserix("inspect", run_id, "--tenant", T, "--json")
        assert done.returncode in (0, 4), done.stdout + done.stderr
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    # --- the outside world ----------------------------------------------------------------

    def effects(self, run_id: str) -> list[tuple[str, str, str]]:
        """(call id, tool, key) of every effect made for ``run_id``."""
        conn = sqlite3.connect(self.airline, timeout=30)
        try:
            rows = conn.execute(
                "SELECT call_id, tool, key FROM effects WHERE run_id = ? ORDER BY id", (run_id,)
            ).fetchall()
        finally:
            conn.close()
        return [(str(c), str(t), str(k)) for c, t, k in rows]

    def per_call(self, run_id: str) -> Counter[str]:
        found = self.effects(run_id)
        assert len({k for _, _, k in found}) == len(found), f"two effects under one key {found}"
        return Counter(c for c, _, _ in found)


def _waiting(site: Site, run_id: str) -> str:
    """Start the run until it waits on its approval; the request id."""
    out = site.finish("run", run_id)
    assert "RESULT waiting_approval" in out, out
    line = next(x for x in out.splitlines() if x.startswith("PENDING "))
    return line.removeprefix("PENDING ").strip()


def _told(out: str) -> list[list[Any]]:
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out
    status, _, output = line.removeprefix("RESULT ").partition(" ")
    assert status == "completed", out
    told: list[list[Any]] = json.loads(output)
    return told


@pytest.fixture(params=DEATH_BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with held_open(store_url(request.param, tmp_path)) as u:
        yield u


@pytest.fixture(params=BOTH_BACKENDS)
def url_both(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with held_open(store_url(request.param, tmp_path)) as u:
        yield u


MIXED = [
    ["call_a", "hold_seat", "A1"],
    ["call_b", "charge", "B1"],
    ["call_c", "email", "C1"],
    ["call_d", "charge", "D1"],
]
ONE_EACH = Counter({"call_a": 1, "call_b": 1, "call_c": 1, "call_d": 1})


# --- 1. approved, then killed with a mix of calls done, in flight and unsent --------------


def test_an_approved_mixed_turn_killed_midway_makes_each_effect_once_through_the_cli(
    tmp_path: Path, url_both: str
) -> None:
    url = url_both
    """Nothing is sent while the turn waits on a person; once approved, the resuming
    process dies with call_a's outcome recorded, call_b's effect made, call_c claimed
    before its effect and call_d finished. The operator's resume is refused naming exactly
    b and c; once resolved (b with what happened, c never ran), a worker finishes the run:
    every effect once, the model told the four results in its order."""
    site = Site(tmp_path, url, MIXED)
    request = _waiting(site, "mx")
    assert site.effects("mx") == []
    site.approve(request)
    plan = {"call_a": "done", "call_b": "after", "call_c": "before"}
    site.kill_when(
        "resume",
        "mx",
        plan,
        {"AT call_a done", "AT call_b after", "AT call_c before", "COMPLETED call_d"},
    )
    assert site.per_call("mx") == Counter({"call_a": 1, "call_b": 1, "call_d": 1})
    refused = site.operator_resume("mx")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "call_b" in refused.stderr and "call_c" in refused.stderr, refused.stderr
    assert "call_a" not in refused.stderr and "call_d" not in refused.stderr, refused.stderr
    assert site.per_call("mx") == Counter({"call_a": 1, "call_b": 1, "call_d": 1})
    done = site.resolve("mx", "call_b", "--outcome", '{"done": "charge", "item": "B1"}')
    assert done.returncode == 0, done.stdout + done.stderr
    done = site.resolve("mx", "call_c", "--never-ran")
    assert done.returncode == 0, done.stdout + done.stderr
    worker = site.worker()
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert site.per_call("mx") == ONE_EACH
    again = site.operator_resume("mx")  # a finished run: nothing sent again
    assert site.per_call("mx") == ONE_EACH, again.stdout + again.stderr
    shown = site.inspect("mx")
    assert "completed" in json.dumps(shown)


def test_killed_as_the_approved_turn_claims_sends_each_call_once_on_resume(
    tmp_path: Path, url: str
) -> None:
    """Right after the decision: the resuming process dies as call_b's claim is about to
    be written, while call_a is held before its effect and call_c and call_d ran. The
    resume refuses call_a only (call_b was never claimed); resolved never-ran, every call
    goes out once."""
    site = Site(tmp_path, url, MIXED)
    request = _waiting(site, "ck")
    site.approve(request)
    site.kill_when(
        "resume",
        "ck",
        {"call_a": "before", "call_b": "claim"},
        {"AT call_a before", "AT call_b claim", "COMPLETED call_c", "COMPLETED call_d"},
    )
    assert site.per_call("ck") == Counter({"call_c": 1, "call_d": 1})
    refused = site.operator_resume("ck")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "call_a" in refused.stderr and "call_b" not in refused.stderr, refused.stderr
    assert site.resolve("ck", "call_a", "--never-ran").returncode == 0
    out = site.finish("resume", "ck")
    told = _told(out)
    assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]
    assert not any(t[1] for t in told), told
    assert site.per_call("ck") == ONE_EACH


# --- 2. denied, then killed with the unapproved calls in flight ---------------------------


def test_a_denied_mixed_turn_killed_midway_never_charges_and_sends_the_rest_once(
    tmp_path: Path, url: str
) -> None:
    """Denied: the charges are never sent, the other calls are. The process carrying the
    denied turn dies with call_a's effect made and call_c held before its effect; the
    refusal names only those two (never a denied charge), and once resolved the model
    hears both charges were denied and the rest done, each effect once."""
    site = Site(tmp_path, url, MIXED)
    request = _waiting(site, "dn")
    site.approve(request, deny=True)
    site.kill_when(
        "resume",
        "dn",
        {"call_a": "after", "call_c": "before"},
        {"AT call_a after", "AT call_c before"},
    )
    assert site.per_call("dn") == Counter({"call_a": 1})
    refused = site.operator_resume("dn")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "call_a" in refused.stderr and "call_c" in refused.stderr, refused.stderr
    assert "call_b" not in refused.stderr and "call_d" not in refused.stderr, refused.stderr
    assert site.resolve("dn", "call_a", "--outcome", '{"done": "hold_seat"}').returncode == 0
    assert site.resolve("dn", "call_c", "--never-ran").returncode == 0
    told = _told(site.finish("resume", "dn"))
    assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]
    assert [t[1] for t in told] == [False, True, False, True], told
    assert "denied" in told[1][2] and "denied" in told[3][2], told
    assert site.per_call("dn") == Counter({"call_a": 1, "call_c": 1})


# --- 3. twin calls across a death ---------------------------------------------------------

TWINS = [
    ["call_a", "hold_seat", "SAME"],
    ["call_b", "hold_seat", "SAME"],
    ["call_c", "hold_seat", "SAME"],
    ["call_d", "email", "X"],
]


@pytest.mark.slow
def test_twins_killed_one_done_one_sent_one_unsent_are_settled_by_reconcilers_apart(
    tmp_path: Path, url: str
) -> None:
    """Three identical calls in one parallel turn: one recorded, one whose effect was made
    and one held before its effect when the process dies. The reconciler looks each up by
    its own key, so a worker settles them apart: the effect made is not made again, the
    unsent twin goes out once, three effects under three keys in all."""
    site = Site(tmp_path, url, TWINS, reconcile=True)
    site.kill_when(
        "run",
        "tw",
        {"call_a": "done", "call_b": "after", "call_c": "before"},
        {"AT call_a done", "AT call_b after", "AT call_c before", "COMPLETED call_d"},
    )
    assert site.per_call("tw") == Counter({"call_a": 1, "call_b": 1, "call_d": 1})
    worker = site.worker()
    assert worker.returncode == 0, worker.stdout + worker.stderr
    found = site.effects("tw")
    assert Counter(t for _, t, _ in found) == Counter({"hold_seat": 3, "email": 1}), found
    assert site.per_call("tw") == ONE_EACH
    told = _told(site.finish("resume", "tw"))
    assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]
    assert not any(t[1] for t in told), told


def test_twins_needing_approval_killed_after_one_twins_effect_charge_it_once(
    tmp_path: Path, url: str
) -> None:
    """Two identical charges, approved together; the process dies with the first twin's
    effect made and the second held before its effect. Resolving the second as never ran
    and the first with its outcome charges the card exactly twice, under two keys."""
    turn = [["call_a", "charge", "SAME"], ["call_b", "charge", "SAME"]]
    site = Site(tmp_path, url, turn)
    site.approve(_waiting(site, "ta"))
    site.kill_when(
        "resume",
        "ta",
        {"call_a": "after", "call_b": "before"},
        {"AT call_a after", "AT call_b before"},
    )
    assert site.per_call("ta") == Counter({"call_a": 1})
    refused = site.operator_resume("ta")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert site.resolve("ta", "call_a", "--outcome", '{"done": "charge"}').returncode == 0
    assert site.resolve("ta", "call_b", "--never-ran").returncode == 0
    told = _told(site.finish("resume", "ta"))
    assert [t[0] for t in told] == ["call_a", "call_b"] and not any(t[1] for t in told)
    assert site.per_call("ta") == Counter({"call_a": 1, "call_b": 1})


# --- 4. a cancel racing a parallel turn across a death -----------------------------------


@pytest.mark.slow
def test_a_cancel_while_a_parallel_turn_is_held_then_a_death_sends_nothing_more(
    tmp_path: Path, url: str
) -> None:
    """The operator cancels while the carrier holds call_a before its effect and call_b
    as its claim is about to be written (call_c finished, call_d not started: width 3);
    then the carrier dies. Nothing not yet sent is ever sent after the cancel (call_b,
    call_d), and the run is not left stranded: a worker and the operator see it end."""
    site = Site(
        tmp_path,
        url,
        [*MIXED[:1], ["call_b", "email", "B1"], *MIXED[2:3], ["call_d", "hold_seat", "D1"]],
    )
    site.env["PD_PARALLEL"] = "3"
    cancelled: list[subprocess.CompletedProcess[str]] = []
    site.kill_when(
        "run",
        "cx",
        {"call_a": "before", "call_b": "claim", "call_c": "done"},
        {"AT call_a before", "AT call_b claim", "AT call_c done"},
        then=lambda: cancelled.append(
            site.tesserix("cancel", "cx", "--tenant", T, "--by", "ops", "--reason", "stop")
        ),
    )
    assert cancelled and cancelled[0].returncode == 0, cancelled[0].stdout + cancelled[0].stderr
    assert site.per_call("cx") == Counter({"call_c": 1})
    site.worker()
    out = site.operator_resume("cx")
    assert site.per_call("cx") == Counter({"call_c": 1}), out.stdout + out.stderr
    # call_a's claim is in doubt: the ended run leaves it in flight, and the operator is
    # told so (``runs --stuck`` lists the run, ``inspect`` names the call).
    stuck = site.tesserix("runs", "--tenant", T, "--stuck")
    assert "cx" in stuck.stdout, stuck.stdout + stuck.stderr
    named = site.inspect("cx")
    assert "call_a" in json.dumps(named.get("calls")), named
    # The operator says it never ran; the cancelled run still sends nothing.
    site.resolve("cx", "call_a", "--never-ran")
    site.worker()
    out = site.operator_resume("cx")
    assert site.per_call("cx") == Counter({"call_c": 1}), out.stdout + out.stderr
    shown = json.dumps(site.inspect("cx"))
    assert "cancel" in shown, shown


# --- 5. write groups on PostgreSQL with parallel calls and a death mid-group ------------


@pytest.mark.postgres
def test_a_death_mid_group_on_postgres_leaves_calls_in_doubt_never_sent_twice(
    tmp_path: Path,
) -> None:
    """group_writes=True on PostgreSQL, four calls at once: the process dies with call_a's
    outcome handed to the (still open) group, call_b's effect made and call_c held before
    its effect, call_d finished. Whatever the group lost, nothing is sent twice and
    nothing is dropped: each call is either replayed or refused in doubt and named; once
    the operator settles what is named, every effect is once."""
    with held_open(store_url("postgres", tmp_path)) as pg:
        turn = [["call_a", "hold_seat", "A1"], ["call_b", "email", "B1"],
                ["call_c", "email", "C1"], ["call_d", "hold_seat", "D1"]]  # fmt: skip
        site = Site(tmp_path, pg, turn)
        site.kill_when(
            "run",
            "gw",
            {"call_a": "done", "call_b": "after", "call_c": "before"},
            {"AT call_a done", "AT call_b after", "AT call_c before", "COMPLETED call_d"},
            grouped=True,
        )
        made = site.per_call("gw")
        assert made == Counter({"call_a": 1, "call_b": 1, "call_d": 1})
        refused = site.operator_resume("gw")
        assert refused.returncode == 4, refused.stdout + refused.stderr
        assert "call_b" in refused.stderr and "call_c" in refused.stderr, refused.stderr
        assert site.per_call("gw") == made
        # Settle every call the refusal names, truthfully.
        for cid in ("call_a", "call_b", "call_c", "call_d"):
            if cid in refused.stderr:
                how = ["--never-ran"] if cid == "call_c" else ["--outcome", '{"done": "x"}']
                done = site.resolve("gw", cid, *how)
                assert done.returncode == 0, done.stdout + done.stderr
        told = _told(site.finish("resume", "gw", grouped=True))
        assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]
        assert site.per_call("gw") == ONE_EACH


# --- 6. a turn partly settled sends nothing of it -----------------------------------------


def test_a_turn_partly_resolved_sends_nothing_until_every_call_in_doubt_is_settled(
    tmp_path: Path, url: str
) -> None:
    """Width 2: call_a's effect made and call_b held before its effect fill both slots;
    call_c and call_d never started. The operator settles call_b only: the resume still
    refuses naming call_a and sends nothing of the turn (not call_b, not the unstarted
    ones). Once call_a is settled, b, c and d go out once each."""
    turn = [["call_a", "hold_seat", "A1"], ["call_b", "email", "B1"],
            ["call_c", "hold_seat", "C1"], ["call_d", "email", "D1"]]  # fmt: skip
    site = Site(tmp_path, url, turn)
    site.env["PD_PARALLEL"] = "2"
    site.kill_when(
        "run",
        "pr",
        {"call_a": "after", "call_b": "before"},
        {"AT call_a after", "AT call_b before"},
    )
    assert site.per_call("pr") == Counter({"call_a": 1})
    assert site.resolve("pr", "call_b", "--never-ran").returncode == 0
    refused = site.operator_resume("pr")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "call_a" in refused.stderr and "call_b" not in refused.stderr, refused.stderr
    worker = site.worker()
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert site.per_call("pr") == Counter({"call_a": 1})
    assert site.resolve("pr", "call_a", "--outcome", '{"done": "hold_seat"}').returncode == 0
    told = _told(site.finish("resume", "pr"))
    assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]
    assert site.per_call("pr") == ONE_EACH


# --- 7. a decision is not taken back once acted on ----------------------------------------


@pytest.mark.slow
def test_a_deny_after_an_approval_was_acted_on_changes_nothing_sent_or_told(
    tmp_path: Path, url: str
) -> None:
    """Approved; the carrier dies with charge call_b recorded and charge call_d in flight
    before its effect. An operator then tries to deny the same request: refused (or a
    no-op). call_d, settled never-ran, still goes out under the approval, and the model is
    told call_b's real result, never "denied"."""
    site = Site(tmp_path, url, MIXED)
    request = _waiting(site, "dd")
    site.approve(request)
    site.kill_when(
        "resume",
        "dd",
        {"call_b": "done", "call_d": "before"},
        {"AT call_b done", "AT call_d before", "COMPLETED call_a", "COMPLETED call_c"},
    )
    denied = site.tesserix("approve", request, "--tenant", T, "--by", "mallory", "--deny")
    assert site.resolve("dd", "call_d", "--never-ran").returncode == 0
    told = _told(site.finish("resume", "dd"))
    assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]
    assert not any(t[1] for t in told), (told, denied.stdout + denied.stderr)
    assert site.per_call("dd") == ONE_EACH


# --- 8. a worker woken by the approval dies mid-turn; workers and the operator finish -----


@pytest.mark.slow
def test_a_worker_woken_by_an_approval_killed_mid_turn_is_parked_then_finished_once(
    tmp_path: Path, url: str
) -> None:
    """The approval wakes a worker, which dies with call_a's effect made, call_b recorded
    and call_c, call_d held before their effects. The next worker parks the run in doubt
    (sending nothing); the operator resolves each named call, which wakes it, and a worker
    finishes it: every effect once."""
    site = Site(tmp_path, url, MIXED)
    request = _waiting(site, "wk")
    site.approve(request)
    proc = site.worker_proc({"call_a": "after", "call_c": "before", "call_d": "before"})
    site.kill(
        proc, "wk", {"AT call_a after", "AT call_c before", "AT call_d before", "COMPLETED call_b"}
    )
    assert site.per_call("wk") == Counter({"call_a": 1, "call_b": 1})
    parked = site.worker()
    assert parked.returncode == 0, parked.stdout + parked.stderr
    assert site.per_call("wk") == Counter({"call_a": 1, "call_b": 1})
    stuck = site.tesserix("runs", "--tenant", T, "--stuck")
    assert "wk" in stuck.stdout, stuck.stdout + stuck.stderr
    assert site.resolve("wk", "call_a", "--outcome", '{"done": "hold_seat"}').returncode == 0
    assert site.resolve("wk", "call_c", "--never-ran").returncode == 0
    assert site.resolve("wk", "call_d", "--never-ran").returncode == 0
    finished = site.worker()
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert site.per_call("wk") == ONE_EACH
    assert "completed" in json.dumps(site.inspect("wk"))


# --- 9. two workers race for a run that died mid-turn -------------------------------------


def test_two_workers_racing_for_a_dead_parallel_turn_send_each_unstarted_call_once(
    tmp_path: Path, url: str
) -> None:
    """The carrier dies with call_a and call_b recorded (slots held, width 2); call_c and
    call_d never started. Two workers start at once: one carries the run, the other is
    fenced out; call_c and call_d go out once each, call_a and call_b are replayed."""
    turn = [["call_a", "hold_seat", "A1"], ["call_b", "email", "B1"],
            ["call_c", "hold_seat", "C1"], ["call_d", "email", "D1"]]  # fmt: skip
    site = Site(tmp_path, url, turn)
    site.env["PD_PARALLEL"] = "2"
    site.kill_when(
        "run", "rc", {"call_a": "done", "call_b": "done"}, {"AT call_a done", "AT call_b done"}
    )
    argv = [TESSERIX, "worker", "--agent", f"{site.agent}:agent", "--exit-when-idle",
            "--lease-ttl", "2", "--store", site.url]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*argv, "--worker", f"w{i}"],
            env=site.env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert site.per_call("rc") == ONE_EACH, outs
    told = _told(site.finish("resume", "rc"))
    assert [t[0] for t in told] == ["call_a", "call_b", "call_c", "call_d"]


# --- 10. a death between asking a person and the frontier that names the request ---------


def test_a_request_orphaned_by_a_death_and_denied_meanwhile_never_charges(
    tmp_path: Path, url: str
) -> None:
    """The carrier records the turn's approval request and dies before any frontier names
    it; an operator denies that request meanwhile. A worker carries the run on: the model
    asks again, the request is found under the same id with its decision, both charges are
    answered denied and never sent, the other calls go out once."""
    site = Site(tmp_path, url, MIXED)
    seen = site.kill_when("run", "or", {"approval": "asked"}, set(), then=None, asked=True)
    request = next(x for x in seen if x.startswith("AT ")).split()[1]
    assert site.effects("or") == []
    site.approve(request, deny=True)
    worker = site.worker()
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert site.per_call("or") == Counter({"call_a": 1, "call_c": 1})
    told = _told(site.finish("resume", "or"))
    assert [t[1] for t in told] == [False, True, False, True], told


# --- 11. approved, died mid-turn, then cancelled while nobody holds it --------------------


@pytest.mark.slow
def test_an_approved_turn_dead_midway_then_cancelled_sends_nothing_more(
    tmp_path: Path, url: str
) -> None:
    """Approved; at width 2 the carrier dies with call_a's effect made and charge call_b
    held before its effect (c and d never started). The operator cancels the run nobody
    holds: no worker or resume sends c or d afterwards, the calls in doubt are named for
    the operator, and settling them sends nothing either."""
    site = Site(tmp_path, url, MIXED)
    site.env["PD_PARALLEL"] = "2"
    site.approve(_waiting(site, "ac"))
    site.kill_when(
        "resume",
        "ac",
        {"call_a": "after", "call_b": "before"},
        {"AT call_a after", "AT call_b before"},
    )
    done = site.tesserix("cancel", "ac", "--tenant", T, "--by", "ops", "--reason", "stop")
    assert done.returncode == 0, done.stdout + done.stderr
    site.worker()
    site.operator_resume("ac")
    assert site.per_call("ac") == Counter({"call_a": 1})
    named = json.dumps(site.inspect("ac").get("calls"))
    assert "call_a" in named and "call_b" in named, named
    site.resolve("ac", "call_a", "--outcome", '{"done": "hold_seat"}')
    site.resolve("ac", "call_b", "--never-ran")
    site.worker()
    site.operator_resume("ac")
    assert site.per_call("ac") == Counter({"call_a": 1})
    assert site.inspect("ac")["status"] == "cancelled"
