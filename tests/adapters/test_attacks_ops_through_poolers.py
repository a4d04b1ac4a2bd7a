"""Attacks by an on-call engineer operating through PgBouncer (transaction pooling) and a
Redis Cluster: real ``tesserix worker`` processes carrying submitted runs through a pooler,
SIGKILLed inside a side-effecting tool and while their frontier write waits in the server,
a second worker taking over; the pooler restarted under a worker that carries a run; and
``runs``, ``runs --stuck``, ``show``, ``inspect``, ``resolve``, ``cancel`` and ``approve``
(with ``--json``) pointed at the pooler's and the cluster's store URLs.

Every server that is stopped or restarted here is the test's own (a throwaway PgBouncer,
a throwaway cluster); the shared PostgreSQL is only written to in a schema of the test's
own. Effects are lines appended with ``O_APPEND`` to a file (key, run, fence, pid), so a
SIGKILL right after one cannot lose it; marks in another file say where each process is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from adapters.cluster import ThrowawayCluster, delete_prefixed, redis_cluster
from adapters.pooler import PgBouncer, pgbouncer
from processes import held_open
from tesserix_adk import AgentRunner, open_stores

pytestmark = pytest.mark.postgres

T = "acme"

AGENT_SRC = '''
"""The agent of test_attacks_ops_through_poolers: one booking, then an answer."""

import asyncio
import os
import time

from tesserix_adk import Agent, ModelRequest, ModelResponse, tool
from tesserix_adk.messages import Message, Role, ToolCall


def append(path, line):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


def mark(what):
    append(os.environ["OP_MARKS"], f"{what} {os.getpid()}")


class Model:
    async def complete(self, request: ModelRequest) -> ModelResponse:
        first = next(m for m in request.messages if m.role is Role.user)
        run_id = str(first.content).split()[-1]
        done = sum(1 for m in request.messages if m.role is Role.tool)
        mark(f"model {run_id} {done}")
        if done < 1:
            call = ToolCall(id="call_0", name=os.environ.get("OP_TOOL", "book_seat"),
                            arguments={"flight": "LH400"})
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=[call]))
        return ModelResponse(message=Message(Role.assistant, "Booked."))


PROVIDER = Model()


def _book(flight, ctx):
    mark(f"tool {ctx.run_id}")
    append(os.environ["OP_EFFECTS"],
           f"{ctx.idempotency_key} {ctx.run_id} {flight} {ctx.fence} {os.getpid()}")
    mark(f"booked {ctx.run_id}")
    # Parks here while the test kills the process or the pooler.
    while os.path.exists(os.environ["OP_HOLD"] + "." + ctx.run_id):
        time.sleep(0.05)
    return {"booked": flight}


@tool
def book_seat(flight: str, ctx) -> dict:
    """Book one seat (no reconciler: a call in doubt waits for a person)."""
    return _book(flight, ctx)


@tool(requires_approval=True)
def book_approved(flight: str, ctx) -> dict:
    """Book one seat once a person approved."""
    return _book(flight, ctx)


agent = Agent("op", "Book a seat.", [book_seat, book_approved])
'''

SUBMIT_SRC = """
import asyncio, sys
from tesserix_adk import AgentRunner, open_stores
import op_agent

async def main():
    async with open_stores(sys.argv[1]) as stores:
        runner = AgentRunner.from_stores(op_agent.Model(), stores)
        for run_id in sys.argv[2:]:
            await runner.submit(op_agent.agent, f"book {run_id}", tenant="acme", run_id=run_id)

asyncio.run(main())
"""


def wait(cond: Callable[[], bool], seconds: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.03)


def one_sentence(err: str) -> bool:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return len(lines) == 1 and lines[0].startswith("tesserix: ") and "Traceback" not in err


class Site:
    """One store URL shared by every process of a test, the agent module and its files."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp, self.url = tmp, url
        (tmp / "op_agent.py").write_text(AGENT_SRC)
        self.marks_path, self.effects_path = tmp / "marks", tmp / "effects"
        self.hold = str(tmp / "hold")
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
            "OP_MARKS": str(self.marks_path),
            "OP_EFFECTS": str(self.effects_path),
            "OP_HOLD": self.hold,
            "ADK_STORE": url,
        }
        self.env.pop("ADK_DEBUG", None)
        self.spawned: list[subprocess.Popen[str]] = []

    def in_stores(self, fn: Callable[[Any], Any]) -> Any:
        async def go() -> Any:
            async with open_stores(self.url) as stores:
                return await fn(stores)

        return asyncio.run(go())

    def apply_schema(self) -> None:
        self.in_stores(lambda s: s.create_schema())

    def holding(self, run_id: str) -> None:
        Path(f"{self.hold}.{run_id}").touch()

    def let_go(self, run_id: str) -> None:
        Path(f"{self.hold}.{run_id}").unlink(missing_ok=True)

    def submit(self, *run_ids: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", SUBMIT_SRC, self.url, *run_ids],
            env=self.env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr

    def worker(self, *flags: str) -> subprocess.Popen[str]:
        n = len(self.spawned)
        argv = [sys.executable, "-m", "tesserix_adk", "worker", "--agent", "op_agent:agent"]
        with (self.logs / f"w{n}.out").open("w") as out, (self.logs / f"w{n}.err").open("w") as err:
            proc = subprocess.Popen(
                [*argv, "--poll", "0.05", *flags],
                env=self.env,
                cwd=self.tmp,
                stdout=out,
                stderr=err,
                text=True,
            )
        self.spawned.append(proc)
        return proc

    def tesserix(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tesserix_adk", "--store", self.url, *args],
            env=self.env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=90,
        )

    def json(self, *args: str) -> tuple[int, Any, str]:
        done = self.tesserix(*args, "--json")
        try:
            body = json.loads(done.stdout) if done.stdout.strip() else None
        except json.JSONDecodeError:
            body = done.stdout
        return done.returncode, body, done.stderr

    def marks(self) -> list[str]:
        return self.marks_path.read_text().splitlines() if self.marks_path.exists() else []

    def marked(self, what: str, pid: int | None = None) -> bool:
        return any(
            line.rsplit(" ", 1)[0] == what and (pid is None or line.endswith(f" {pid}"))
            for line in self.marks()
        )

    def effects(self) -> list[list[str]]:
        if not self.effects_path.exists():
            return []
        return [line.split() for line in self.effects_path.read_text().splitlines()]

    def once_each(self, *run_ids: str) -> None:
        effects = self.effects()
        assert [k for k, n in Counter(e[0] for e in effects).items() if n > 1] == [], effects
        assert Counter(e[1] for e in effects) == dict.fromkeys(run_ids, 1), effects

    def logs_text(self) -> str:
        parts = [f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.logs.iterdir())]
        return "\n".join(parts) + "\n--- marks\n" + "\n".join(self.marks())

    def status(self, run_id: str) -> str | None:
        code, body, _ = self.json("show", run_id, "--tenant", T)
        if code != 0:
            return None
        return str(body["status"]) if isinstance(body, dict) and "status" in body else None

    def kill_all(self) -> None:
        for p in self.spawned:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


class Pooler:
    """A PgBouncer of the test's own that can be killed and started again on its port."""

    def __init__(self, bouncer: PgBouncer) -> None:
        self.bouncer = bouncer
        self.process: subprocess.Popen[bytes] = bouncer.process

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def start(self) -> None:
        import pwd

        ini = self.bouncer.log.parent / "pgbouncer.ini"
        account = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        self.process = subprocess.Popen(
            [str(shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"), str(ini)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=None if account is None else account.pw_uid,
            group=None if account is None else account.pw_gid,
            extra_groups=None if account is None else [],
        )

        def listening() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.bouncer.port), timeout=0.5):
                    return True
            except OSError:
                return False

        wait(listening, 20, lambda: "pgbouncer did not listen again")

    def stop(self) -> None:
        if self.process is not self.bouncer.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@contextlib.contextmanager
def pooled_site(tmp_path: Path) -> Iterator[tuple[Site, Pooler, str]]:
    """A Site whose URL goes through a PgBouncer of the test's own; its schema."""
    with held_open(services.postgres_schema()) as schema, pgbouncer() as bouncer:
        pooler = Pooler(bouncer)
        site = Site(tmp_path, bouncer.stores_url(schema))
        site.apply_schema()
        try:
            yield site, pooler, schema
        finally:
            site.kill_all()
            pooler.stop()


# --- workers through the pooler -------------------------------------------------------------


def test_a_worker_killed_inside_a_tool_through_the_pooler_is_taken_over_resolved_and_books_once(
    tmp_path: Path,
) -> None:
    """The on-call story through PgBouncer: worker A is SIGKILLed after the airline booked
    and before the outcome was recorded; worker B takes the run once A's lease lapses and
    parks it in doubt; ``runs --stuck``, ``inspect`` and ``show`` (``--json``) say so
    through the pooler; ``resolve`` records the booking; B carries the run to the end with
    one booking."""
    with pooled_site(tmp_path) as (site, _, _):
        run_id = f"mid-tool-{secrets.token_hex(3)}"
        site.holding(run_id)
        site.submit(run_id)
        first = site.worker("--lease-ttl", "2", "--worker", "first")
        wait(lambda: site.marked(f"booked {run_id}", first.pid), 60, site.logs_text)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        site.let_go(run_id)
        # Nobody carries it yet: once A's lease lapsed the run is stuck, one call in flight.
        code, stuck, err = 0, None, ""

        def listed() -> bool:
            nonlocal code, stuck, err
            code, stuck, err = site.json("runs", "--tenant", T, "--stuck")
            return code == 0 and any(r["run_id"] == run_id for r in stuck["runs"])

        wait(listed, 30, lambda: f"{code} {stuck} {err}\n{site.logs_text()}")
        [row] = [r for r in stuck["runs"] if r["run_id"] == run_id]
        assert row["in_flight"] == 1 and row["lease"] is None, row
        second = site.worker("--lease-ttl", "2", "--worker", "second")

        def parked() -> bool:
            nonlocal code, stuck, err
            code, stuck, err = site.json("runs", "--tenant", T, "--stuck")
            return code == 0 and any(r["run_id"] == run_id and r["parked"] for r in stuck["runs"])

        wait(parked, 60, lambda: f"{code} {stuck} {err}\n{site.logs_text()}")
        [row] = [r for r in stuck["runs"] if r["run_id"] == run_id]
        code, seen, err = site.json("inspect", run_id, "--tenant", T)
        assert code == 0, err
        [call] = seen["calls"]
        assert call["disposition"] == "indeterminate", seen
        code, shown, err = site.json("show", run_id, "--tenant", T)
        assert code == 0 and shown["status"] == "running", (shown, err)
        code, resolved, err = site.json(
            "resolve",
            *(run_id, "--tenant", T, "--call", call["call_id"]),
            *("--outcome", '{"booked": "LH400"}', "--by", "ops"),
        )
        assert code == 0, (resolved, err)
        wait(lambda: site.status(run_id) == "completed", 60, site.logs_text)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, site.logs_text()
        site.once_each(run_id)
        assert row["status"] == "running" and row["in_flight"] == 1, row


def _waiting_on(schema: str, table: str) -> Callable[[], bool]:
    """Whether some backend waits for a lock on ``schema.table``."""
    import psycopg

    def check() -> bool:
        with psycopg.connect(services.POSTGRES_URL, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
                "to_regclass(format('%%I.%%I', %s::text, %s::text))",
                (schema, table),
            ).fetchone()
            return bool(row and row[0])

    return check


def test_a_worker_killed_while_its_frontier_waits_in_the_server_is_taken_over_books_once(
    tmp_path: Path,
) -> None:
    """Worker A's first frontier (the model asked for ``book_seat``) is sent through the
    pooler and waits on a lock in the server; A is SIGKILLed there and the lock let go, so
    the dead worker's statement may still land behind the pooler. Worker B takes the run
    once A's lease lapses and carries it to the end: one booking, run completed."""
    import psycopg

    with pooled_site(tmp_path) as (site, _, schema):
        run_id = f"mid-frontier-{secrets.token_hex(3)}"
        site.submit(run_id)
        with psycopg.connect(services.POSTGRES_URL) as locker:
            locker.execute(
                psycopg.sql.SQL("LOCK TABLE {}.adk_checkpoints IN EXCLUSIVE MODE").format(
                    psycopg.sql.Identifier(schema)
                )
            )
            first = site.worker("--lease-ttl", "2", "--worker", "first")
            wait(lambda: site.marked(f"model {run_id} 0", first.pid), 60, site.logs_text)
            wait(_waiting_on(schema, "adk_checkpoints"), 30, site.logs_text)
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
            locker.rollback()
        assert site.effects() == []
        second = site.worker("--lease-ttl", "2", "--worker", "second")
        wait(lambda: site.status(run_id) == "completed", 60, site.logs_text)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, site.logs_text()
        site.once_each(run_id)
        code, shown, err = site.json("show", run_id, "--tenant", T)
        assert code == 0 and shown["status"] == "completed", (shown, err)


@pytest.mark.parametrize("down_for", [0.0, 3.0], ids=["restarted", "down-past-the-ttl"])
def test_the_pooler_restarted_under_a_worker_inside_a_tool_loses_nothing_and_books_once(
    tmp_path: Path, down_for: float
) -> None:
    """The pooler (the test's own) is killed while a worker is inside ``book_seat`` and
    started again at once, or after the worker's 2 s lease ttl. The worker stays up; the run
    ends completed with one booking, or (its outcome unrecordable meanwhile) is listed by
    ``runs --stuck`` in doubt, never booked twice; the worker drains with exit 0."""
    with pooled_site(tmp_path) as (site, pooler, _):
        run_id = f"bounced-{secrets.token_hex(3)}"
        site.holding(run_id)
        site.submit(run_id)
        worker = site.worker("--lease-ttl", "2", "--worker", "bounced")
        wait(lambda: site.marked(f"booked {run_id}"), 60, site.logs_text)
        pooler.kill()
        if down_for:
            site.let_go(run_id)
            time.sleep(down_for)
        pooler.start()
        site.let_go(run_id)

        def settled() -> bool:
            if site.status(run_id) == "completed":
                return True
            code, body, _ = site.json("runs", "--tenant", T, "--stuck")
            return code == 0 and any(r["run_id"] == run_id for r in body["runs"])

        wait(settled, 60, site.logs_text)
        assert worker.poll() is None, site.logs_text()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, site.logs_text()
        site.once_each(run_id)
        if not down_for:
            assert site.status(run_id) == "completed", site.logs_text()


def test_approve_and_cancel_through_the_pooler_wake_a_later_worker_and_book_once(
    tmp_path: Path,
) -> None:
    """A run waits on an approval; the worker that left it so is SIGKILLed; ``approve
    --json`` through the pooler decides it and a new worker carries it on (one booking).
    A second run is cancelled (``cancel --json``) while that worker is inside its tool: the
    call in hand finishes, the run ends cancelled, and deciding anything more is refused."""
    with pooled_site(tmp_path) as (site, _, _):
        waiting, cancelled = (f"{name}-{secrets.token_hex(3)}" for name in ("approve", "cancel"))
        site.env["OP_TOOL"] = "book_approved"
        site.submit(waiting)
        first = site.worker("--lease-ttl", "2", "--worker", "first")
        wait(lambda: site.status(waiting) == "waiting_approval", 60, site.logs_text)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        code, seen, err = site.json("inspect", waiting, "--tenant", T)
        assert code == 0, err
        request = seen["pending_approval"]
        request = request["id"] if isinstance(request, dict) else request
        assert isinstance(request, str) and request, seen
        code, decided, err = site.json("approve", request, "--tenant", T, "--by", "ops")
        assert code == 0 and decided["status"] == "approved", (decided, err)
        code, again, err = site.json("approve", request, "--tenant", T, "--by", "ops")
        assert code == 0, (again, err)
        code, denied, err = site.json("approve", request, "--tenant", T, "--by", "x", "--deny")
        assert code == 4, (denied, err)
        site.env["OP_TOOL"] = "book_seat"
        site.holding(cancelled)
        site.submit(cancelled)
        second = site.worker("--lease-ttl", "2", "--worker", "second")
        wait(lambda: site.status(waiting) == "completed", 60, site.logs_text)
        wait(lambda: site.marked(f"booked {cancelled}", second.pid), 60, site.logs_text)
        code, asked, err = site.json("cancel", cancelled, "--tenant", T, "--by", "ops")
        assert code == 0, (asked, err)
        site.let_go(cancelled)
        wait(lambda: site.status(cancelled) == "cancelled", 60, site.logs_text)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, site.logs_text()
        site.once_each(waiting, cancelled)
        code, listed, err = site.json("runs", "--tenant", T, "--stuck")
        assert code == 0 and listed["runs"] == [], (listed, err)


# --- the same operations on a Redis Cluster (no work index: no worker) ----------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayCluster]:
    with redis_cluster() as made:
        yield made


@pytest.mark.redis
def test_cancel_on_a_cluster_stops_a_live_resume_after_its_call_and_books_once(
    tmp_path: Path, cluster: ThrowawayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run on the cluster died after its model asked for ``book_seat``; ``tesserix run
    --resume`` carries it and is inside the tool when ``cancel --json`` (through the
    cluster) asks it to stop: the call in hand finishes once, the run ends cancelled, the
    resume exits 0, ``runs --stuck`` lists nothing and ``approve`` of an unknown request
    is exit 1. ``worker`` and ``submit`` on the cluster are refused in one sentence."""
    from tesserix_adk.testing.faults import SimulatedCrash

    prefix = services.redis_prefix()
    site = Site(tmp_path, services.with_query(cluster.url, prefix=prefix))
    run_id = f"cl-{secrets.token_hex(3)}"
    for name in ("OP_MARKS", "OP_EFFECTS", "OP_HOLD"):
        monkeypatch.setenv(name, site.env[name])
    sys.path.insert(0, str(tmp_path))
    try:
        import op_agent  # type: ignore[import-not-found]

        async def died_before_the_claim(stores: Any) -> None:
            async def dying(*args: Any, **kwargs: Any) -> Any:
                raise SimulatedCrash

            stores.idempotency.claim = dying
            runner = AgentRunner.from_stores(op_agent.Model(), stores)
            with pytest.raises(SimulatedCrash):
                await runner.run(op_agent.agent, f"book {run_id}", tenant=T, run_id=run_id)

        site.in_stores(died_before_the_claim)
        site.holding(run_id)
        resume = subprocess.Popen(
            [
                *(sys.executable, "-m", "tesserix_adk", "--store", site.url, "run", "--resume"),
                *(run_id, "--tenant", T, "--agent", "op_agent:agent", "--json"),
            ],
            env=site.env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        site.spawned.append(resume)
        wait(lambda: site.marked(f"booked {run_id}", resume.pid), 60, site.logs_text)
        code, asked, err = site.json("cancel", run_id, "--tenant", T, "--by", "ops")
        assert code == 0, (asked, err)
        site.let_go(run_id)
        out, err = resume.communicate(timeout=60)
        assert resume.returncode == 0, (out, err)
        assert json.loads(out)["status"] == "cancelled", out
        site.once_each(run_id)
        code, listed, err = site.json("runs", "--tenant", T, "--stuck")
        assert code == 0 and listed["runs"] == [], (listed, err)
        code, shown, err = site.json("show", run_id, "--tenant", T)
        assert code == 0 and shown["status"] == "cancelled", (shown, err)
        code, _, err = site.json("approve", "req-none", "--tenant", T, "--by", "ops")
        assert code == 1 and one_sentence(err), err
        for argv in (
            ("worker", "--agent", "op_agent:agent", "--exit-when-idle"),
            ("submit", "--agent", "op_agent:agent", "--tenant", T, "--input", "x"),
        ):
            done = site.tesserix(*argv)
            assert done.returncode == 2 and one_sentence(done.stderr), (argv, done.stderr)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("op_agent", None)
        site.kill_all()
        asyncio.run(delete_prefixed(cluster, prefix))


def _admin(pooler: Pooler, command: str) -> None:
    import psycopg

    with psycopg.connect(
        f"postgresql://postgres@127.0.0.1:{pooler.bouncer.port}/pgbouncer", autocommit=True
    ) as conn:
        conn.execute(command, prepare=False)


def _paused_under_a_tool(tmp_path: Path) -> tuple[Site, str, str]:
    """A worker inside ``book_seat`` through a pooler (the test's own) that is PAUSEd for
    longer than the kit's 5 s deadline and the worker's 2 s lease ttl, then RESUMEd: the
    tool's outcome and the lease renewals wait in the pooler meanwhile. The site, the run and
    the worker's output, once the run settled and the worker drained."""
    with pooled_site(tmp_path) as (site, pooler, _):
        ini = pooler.bouncer.log.parent / "pgbouncer.ini"
        ini.write_text(ini.read_text() + "admin_users = postgres\n")
        pooler.kill()
        pooler.start()
        run_id = f"paused-{secrets.token_hex(3)}"
        site.holding(run_id)
        site.submit(run_id)
        worker = site.worker("--lease-ttl", "2", "--worker", "only")
        wait(lambda: site.marked(f"booked {run_id}"), 60, site.logs_text)
        _admin(pooler, "PAUSE")
        site.let_go(run_id)
        time.sleep(6.5)
        _admin(pooler, "RESUME")

        def settled() -> bool:
            if site.status(run_id) == "completed":
                return True
            code, body, _ = site.json("runs", "--tenant", T, "--stuck")
            return code == 0 and any(r["run_id"] == run_id for r in body["runs"])

        wait(settled, 60, site.logs_text)
        assert worker.poll() is None, site.logs_text()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, site.logs_text()
        site.once_each(run_id)
        code, listed, err = site.json("runs", "--tenant", T)
        assert code == 0, err
        [row] = listed["runs"]
        return site, row, (site.logs / "w0.out").read_text()


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory) -> tuple[Site, str, str]:
    """The paused-pooler scenario, played once for the two tests that read it (10 s)."""
    return _paused_under_a_tool(tmp_path_factory.mktemp("paused"))


def test_a_paused_pooler_under_a_tool_holds_the_outcome_and_the_run_completes_once(
    paused: tuple[Site, str, str],
) -> None:
    _, row, _ = paused
    assert row["status"] == "completed" and row["in_flight"] == 0, row


def test_a_worker_that_lost_its_lease_to_a_paused_pooler_does_not_say_held_elsewhere(
    paused: tuple[Site, str, str],
) -> None:
    _, row, out = paused
    lines = [line for line in out.splitlines() if row["run_id"] in line]
    assert not [line for line in lines if "held elsewhere" in line], lines


@pytest.mark.parametrize(
    "argv",
    [
        ("runs", "--tenant", T, "--stuck"),
        ("show", "RUN", "--tenant", T),
        ("inspect", "RUN", "--tenant", T),
        ("approve", "req-x", "--tenant", T, "--by", "ops"),
        ("cancel", "RUN", "--tenant", T, "--by", "ops"),
        ("resolve", "RUN", "--tenant", T, "--call", "call_0", "--never-ran", "--by", "ops"),
        ("submit", "--agent", "op_agent:agent", "--tenant", T, "--input", "x"),
    ],
    ids=lambda argv: argv[0] + ("-stuck" if "--stuck" in argv else ""),
)
def test_every_json_command_through_a_pooler_that_is_down_is_exit_3_in_one_sentence(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    with pooled_site(tmp_path) as (site, pooler, _):
        run_id = f"down-{secrets.token_hex(3)}"
        site.submit(run_id)
        pooler.kill()
        done = site.tesserix(*(run_id if a == "RUN" else a for a in argv), "--json")
        assert done.returncode == 3 and one_sentence(done.stderr), done.stderr
        assert json.loads(done.stdout)["error"]["exit_code"] == 3, done.stdout
        pooler.start()
        code, _, err = site.json("show", run_id, "--tenant", T)
        assert code in (0, 1), err  # the submission is still there, untouched
        if argv[0] == "cancel":
            assert site.status(run_id) != "cancelled"
