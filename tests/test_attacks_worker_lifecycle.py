"""Attacks on the lifecycle of ``tesserix worker`` processes: signals at every moment (idle,
while the model is asked, inside a side-effecting tool, while a run waits on a person),
signals repeated, SIGTERM then SIGKILL before the drain ends, two workers started with the
same ``--worker`` name, a store without its schema, a PostgreSQL of the test's own that is
down when the worker starts and goes down again mid-run, and the numbers a command line can
give (``--concurrency``, ``--lease-ttl``) at their edges.

Every worker here is the real console script (``python -m tesserix_adk worker``) in a
process of its own, its output in a file. The agent is a module written to ``tmp_path``
(imported from the worker's working directory, as the README says ``--agent`` is): its
model asks for one booking, then answers; the booking appends one line to an effects file
with ``O_APPEND`` (key, run, flight, fence, pid), so a SIGKILL right after it cannot lose
it, and marks (``model RUN N``, ``tool RUN``, ``booked RUN``, each with the pid) tell the
test where each process is, so a signal lands where the test means it to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from processes import held_open, store_url
from tesserix_adk import Checkpointer, WorkState, open_stores
from tesserix_adk.stores.bundle import Stores

T = "acme"
README = Path(__file__).resolve().parents[1] / "README.md"

AGENT_SRC = '''
"""The agent of tests/test_attacks_worker_lifecycle.py: one booking, then an answer."""

import asyncio
import os
import time
from typing import Any

from tesserix_adk import Agent, ModelRequest, ModelResponse, Reconciled, tool
from tesserix_adk.messages import Message, Role, ToolCall


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


def lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def mark(what: str) -> None:
    append(os.environ["WL_MARKS"], f"{what} {os.getpid()}")


class Model:
    async def complete(self, request: ModelRequest) -> ModelResponse:
        first = next(m for m in request.messages if m.role is Role.user)
        run_id = str(first.content).split()[-1]
        done = sum(1 for m in request.messages if m.role is Role.tool)
        mark(f"model {run_id} {done}")
        await asyncio.sleep(float(os.environ.get("WL_MODEL_SLOW", "0")))
        if done < 1:
            tool_name = os.environ.get("WL_TOOL", "book_seat")
            call = ToolCall(id="call_0", name=tool_name, arguments={"flight": "LH400"})
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=[call]))
        return ModelResponse(message=Message(Role.assistant, "Booked."))


PROVIDER = Model()
OTHER_PROVIDER = Model()


def look_up(call: Any, ctx: Any) -> Reconciled:
    for line in lines(os.environ["WL_EFFECTS"]):
        if line.split()[0] == ctx.idempotency_key:
            return Reconciled.completed({"booked": line.split()[2]})
    return Reconciled.never_ran()


def _book(flight: str, ctx: Any) -> dict:
    mark(f"tool {ctx.run_id}")
    time.sleep(float(os.environ.get("WL_TOOL_SLOW", "0")))
    append(
        os.environ["WL_EFFECTS"],
        f"{ctx.idempotency_key} {ctx.run_id} {flight} {ctx.fence} {os.getpid()}",
    )
    mark(f"booked {ctx.run_id}")
    time.sleep(float(os.environ.get("WL_AFTER_SLOW", "0")))
    return {"booked": flight}


@tool(reconcile=look_up)
def book_seat(flight: str, ctx: Any) -> dict:
    """Book one seat."""
    return _book(flight, ctx)


@tool
def book_blind(flight: str, ctx: Any) -> dict:
    """Book one seat (no reconciler: a call in doubt waits for a person)."""
    return _book(flight, ctx)


@tool(reconcile=look_up, requires_approval=True)
def book_approved(flight: str, ctx: Any) -> dict:
    """Book one seat once a person approved."""
    return _book(flight, ctx)


agent = Agent("wl", "Book a seat.", [book_seat, book_blind, book_approved])
'''

SUBMIT_SRC = """
import asyncio, sys
from tesserix_adk import AgentRunner, open_stores
import wl_agent

async def main():
    async with open_stores(sys.argv[1]) as stores:
        runner = AgentRunner.from_stores(wl_agent.Model(), stores)
        for run_id in sys.argv[2:]:
            await runner.submit(wl_agent.agent, f"book {run_id}", tenant="acme", run_id=run_id)

asyncio.run(main())
"""


class Site:
    """One store shared by every process of a test, the agent module and its files."""

    def __init__(self, tmp: Path, url: str, *, schema: bool = True) -> None:
        self.tmp = tmp
        self.url = url
        (tmp / "wl_agent.py").write_text(AGENT_SRC)
        self.marks_path = tmp / "marks"
        self.effects_path = tmp / "effects"
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
            "WL_MARKS": str(self.marks_path),
            "WL_EFFECTS": str(self.effects_path),
            "ADK_STORE": url,
        }
        self.env.pop("ADK_DEBUG", None)
        self.spawned: list[subprocess.Popen[str]] = []
        if schema:
            self.in_stores(lambda s: s.create_schema())

    # --- the store -----------------------------------------------------------------------

    def in_stores(self, fn: Callable[[Stores], Any]) -> Any:
        async def go() -> Any:
            async with open_stores(self.url) as stores:
                return await fn(stores)

        return asyncio.run(go())

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

    def statuses(self, *run_ids: str) -> dict[str, str | None]:
        async def go(stores: Stores) -> dict[str, str | None]:
            checkpointer = Checkpointer.from_stores(stores)
            found: dict[str, str | None] = {}
            for run_id in run_ids:
                cp = await checkpointer.latest(T, run_id)
                found[run_id] = None if cp is None else str(cp.status)
            return found

        return self.in_stores(go)  # type: ignore[no-any-return]

    def completed(self, *run_ids: str) -> bool:
        return set(self.statuses(*run_ids).values()) == {"completed"}

    def parked(self) -> list[str]:
        items = self.in_stores(lambda s: s.work.items(T, state=WorkState.parked))
        return [i.run_id for i in items]

    def lease(self, run_id: str) -> Any:
        return self.in_stores(lambda s: s.leases.current(T, run_id))

    # --- the processes -------------------------------------------------------------------

    def worker(self, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        n = len(self.spawned)
        argv = [sys.executable, "-m", "tesserix_adk", "worker", "--agent", "wl_agent:agent"]
        out = (self.logs / f"worker-{n}.out").open("w")
        err = (self.logs / f"worker-{n}.err").open("w")
        with out, err:
            proc = subprocess.Popen(
                [*argv, "--poll", "0.05", *flags],
                env={**self.env, **(env or {})},
                cwd=self.tmp,
                stdout=out,
                stderr=err,
                text=True,
            )
        proc.n = n  # type: ignore[attr-defined]
        self.spawned.append(proc)
        return proc

    def out(self, proc: subprocess.Popen[str]) -> str:
        return (self.logs / f"worker-{proc.n}.out").read_text()  # type: ignore[attr-defined]

    def err(self, proc: subprocess.Popen[str]) -> str:
        return (self.logs / f"worker-{proc.n}.err").read_text()  # type: ignore[attr-defined]

    def tesserix(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tesserix_adk", *args],
            env=self.env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def all_logs(self) -> str:
        parts = [f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.logs.iterdir())]
        return "\n".join(parts) + f"\n--- marks\n{self.marks()}"

    def up(self, proc: subprocess.Popen[str]) -> None:
        """Wait until the worker's signal handlers are in (its first line is printed)."""
        wait(lambda: "carrying runs of" in self.out(proc) or proc.poll() is not None, 60, self)
        assert proc.poll() is None, self.all_logs()

    def finish(self, proc: subprocess.Popen[str], timeout: float = 60) -> int:
        proc.wait(timeout=timeout)
        return proc.returncode

    def kill_all(self) -> None:
        for p in self.spawned:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

    # --- what happened -------------------------------------------------------------------

    def marks(self) -> str:
        return self.marks_path.read_text() if self.marks_path.exists() else ""

    def marked(self, what: str, pid: int | None = None) -> bool:
        return any(
            line.rsplit(" ", 1)[0] == what and (pid is None or line.endswith(f" {pid}"))
            for line in self.marks().splitlines()
        )

    def effects(self) -> list[list[str]]:
        if not self.effects_path.exists():
            return []
        return [line.split() for line in self.effects_path.read_text().splitlines()]

    def once_each(self, *run_ids: str) -> None:
        effects = self.effects()
        per_key = Counter(e[0] for e in effects)
        assert [k for k, n in per_key.items() if n > 1] == [], f"an effect twice: {effects}"
        assert Counter(e[1] for e in effects) == dict.fromkeys(run_ids, 1), effects


def wait(cond: Callable[[], bool], seconds: float, site: Site | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, site.all_logs() if site else "timed out"
        time.sleep(0.03)


def one_sentence(err: str) -> bool:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in err


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    try:
        yield s
    finally:
        s.kill_all()


@contextlib.contextmanager
def postgres_site(tmp_path: Path) -> Iterator[Site]:
    with held_open(store_url("postgres", tmp_path)) as url:
        s = Site(tmp_path, url)
        try:
            yield s
        finally:
            s.kill_all()


# --- signals ------------------------------------------------------------------------------


def test_sigterm_while_idle_exits_0_and_every_json_line_says_so(site: Site) -> None:
    worker = site.worker("--json", "--worker", "idle-one")
    site.up(worker)
    worker.send_signal(signal.SIGTERM)
    assert site.finish(worker) == 0, site.all_logs()
    lines = [json.loads(line) for line in site.out(worker).splitlines()]
    assert all(set(line) == {"worker", "at", "message"} for line in lines), lines
    assert all(line["worker"] == lines[0]["worker"] for line in lines)
    messages = [line["message"] for line in lines]
    assert messages[-2:] == [
        "SIGTERM: draining (runs stop at their next boundary)",
        "stopped; 0 run(s) taken",
    ], messages
    assert site.err(worker) == ""


def test_sigint_then_sigterm_then_sigint_inside_a_tool_drain_once_and_exit_0(site: Site) -> None:
    """Ctrl-C, then SIGTERM, then Ctrl-C again while a sync booking is inside its tool: one
    drain, the booking finishes and its outcome is recorded (not in doubt), the lease is
    released, exit 0 (not 130: a worker's SIGINT drains). The next worker finishes the run at
    once and books nothing again."""
    site.submit("r1")
    worker = site.worker("--lease-ttl", "20", env={"WL_TOOL_SLOW": "1.5"})
    wait(lambda: site.marked("tool r1"), 30, site)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        worker.send_signal(signum)
        time.sleep(0.2)
    assert site.finish(worker) == 0, site.all_logs()
    out = site.out(worker)
    assert out.count("draining (runs stop") == 1, out
    assert "SIGINT: draining" in out and "stopped at a boundary (draining)" in out
    assert "Traceback" not in out + site.err(worker)
    assert site.lease("r1") is None, "the drained worker left its lease to lapse"
    assert site.statuses("r1") == {"r1": "running"}
    # Another worker: at once (the 20 s lease was released), nothing sent again.
    again = site.worker("--exit-when-idle", "--lease-ttl", "20")
    assert site.finish(again) == 0, site.all_logs()
    assert site.completed("r1"), site.all_logs()
    site.once_each("r1")
    assert not site.marked("tool r1", again.pid)


def test_sigterm_while_the_model_is_asked_sends_no_new_side_effecting_call(site: Site) -> None:
    site.submit("r1")
    worker = site.worker("--lease-ttl", "20", env={"WL_MODEL_SLOW": "1.5"})
    wait(lambda: site.marked("model r1 0"), 30, site)
    worker.send_signal(signal.SIGTERM)
    assert site.finish(worker) == 0, site.all_logs()
    assert site.lease("r1") is None
    # Told to take nothing new and stop at the next boundary, it starts no new booking.
    assert not site.marked("tool r1", worker.pid), site.all_logs()
    again = site.worker("--exit-when-idle", "--lease-ttl", "20")
    assert site.finish(again) == 0, site.all_logs()
    assert site.completed("r1")
    site.once_each("r1")


def test_sigterm_then_sigkill_inside_a_tool_leaves_nothing_claimed_and_books_once(
    site: Site,
) -> None:
    """SIGTERM while r1's booking sleeps before its effect, then SIGKILL before the drain
    ended: the call is in doubt. Its lease lapses within the ttl (1 s); the next worker asks
    the reconciler (never ran, after the margin) and books it once; r2, stopped with it, is
    finished too."""
    site.submit("r1", "r2")
    worker = site.worker("--lease-ttl", "1", env={"WL_TOOL_SLOW": "1.5"})
    wait(lambda: site.marked("tool r1") and site.marked("tool r2"), 30, site)
    worker.send_signal(signal.SIGTERM)
    wait(lambda: "draining" in site.out(worker), 10, site)
    worker.send_signal(signal.SIGKILL)
    assert site.finish(worker) == -signal.SIGKILL
    assert site.effects() == []
    # Nothing stays held by the dead worker past its lease ttl.
    wait(lambda: site.lease("r1") is None and site.lease("r2") is None, 5, site)
    again = site.worker("--exit-when-idle", "--lease-ttl", "1")
    assert site.finish(again, timeout=40) == 0, site.all_logs()
    assert site.completed("r1", "r2"), site.all_logs()
    site.once_each("r1", "r2")
    assert site.parked() == []


def test_sigterm_while_a_run_waits_on_approval_exits_0_and_approve_wakes_the_next(
    site: Site,
) -> None:
    env = {"WL_TOOL": "book_approved"}
    site.submit("r1")
    worker = site.worker("--lease-ttl", "2", env=env)
    wait(lambda: "waiting on an approval" in site.out(worker), 30, site)
    worker.send_signal(signal.SIGTERM)
    assert site.finish(worker) == 0, site.all_logs()
    assert site.effects() == []
    inspected = site.tesserix("inspect", "r1", "--tenant", T, "--json")
    assert inspected.returncode == 0, inspected.stderr
    request = re.search(r"req-[0-9a-f]+", inspected.stdout)
    assert request is not None, inspected.stdout
    # A new worker started first, then the approval: it picks the run up by itself.
    next_worker = site.worker("--lease-ttl", "2", env=env)
    site.up(next_worker)
    approved = site.tesserix("approve", request.group(0), "--tenant", T, "--by", "alice")
    assert approved.returncode == 0, approved.stderr
    wait(lambda: site.completed("r1"), 30, site)
    next_worker.send_signal(signal.SIGTERM)
    assert site.finish(next_worker) == 0, site.all_logs()
    site.once_each("r1")


# --- two workers under one name -------------------------------------------------------------


def test_two_workers_with_the_same_name_never_take_each_others_call_as_their_own(
    site: Site,
) -> None:
    """A copy-pasted unit: two workers, both ``--worker unit``. The first is SIGKILLed right
    after r1's booking took effect, before its outcome was recorded (a tool without a
    reconciler). The second, same name, must not treat that claim as a retry of its own
    and send it again: r1 is parked in doubt, booked once; r2..r4 finish, each once."""
    env = {"WL_TOOL": "book_blind"}
    site.submit("r1")
    first = site.worker("--worker", "unit", "--lease-ttl", "1", env={**env, "WL_AFTER_SLOW": "30"})
    wait(lambda: site.marked("booked r1"), 30, site)
    first.send_signal(signal.SIGKILL)
    assert site.finish(first) == -signal.SIGKILL
    site.submit("r2", "r3", "r4")
    second = site.worker("--worker", "unit", "--lease-ttl", "1", "--concurrency", "2", env=env)
    wait(lambda: site.completed("r2", "r3", "r4") and site.parked() == ["r1"], 30, site)
    second.send_signal(signal.SIGTERM)
    assert site.finish(second) == 0, site.all_logs()
    assert "worker unit:" in site.out(first) and "worker unit:" in site.out(second)
    site.once_each("r1", "r2", "r3", "r4")
    assert not site.marked("tool r1", second.pid)


# --- the store: not there, not the kit's, down and back ----------------------------------------


def test_a_worker_on_a_sqlite_file_that_does_not_exist_exits_1_naming_schema_apply(
    tmp_path: Path,
) -> None:
    site = Site(tmp_path, f"sqlite:///{tmp_path / 'none' / 'adk.sqlite3'}", schema=False)
    worker = site.worker("--exit-when-idle")
    assert site.finish(worker) == 1, site.all_logs()
    err = site.err(worker)
    assert one_sentence(err) and "tesserix schema apply" in err, err
    assert "Traceback" not in site.out(worker)


@pytest.mark.postgres
def test_a_worker_on_a_postgres_schema_never_applied_exits_1_naming_schema_apply(
    tmp_path: Path,
) -> None:
    with held_open(store_url("postgres", tmp_path)) as url:
        site = Site(tmp_path, url, schema=False)
        try:
            worker = site.worker()  # not idle: it must still stop at its first look
            assert site.finish(worker) == 1, site.all_logs()
        finally:
            site.kill_all()
    err = site.err(worker)
    assert one_sentence(err) and "tesserix schema apply" in err, err


@pytest.mark.postgres
def test_a_worker_whose_postgres_is_down_at_start_and_mid_run_books_each_run_once(
    tmp_path: Path,
) -> None:
    """A PostgreSQL cluster of the test's own. The worker starts while it is down (it waits,
    it does not exit), the cluster comes up and the worker starts the submitted runs; the
    cluster is stopped (fast) while the runs are inside their model calls and started
    again. Every run finishes, each booking once, nothing parked, and SIGTERM exits 0."""
    from adapters.test_outages import require_postgres_cluster, stop_cluster
    from reliability.servers import PostgresCluster

    require_postgres_cluster()
    cluster = PostgresCluster()
    site: Site | None = None
    try:
        cluster.start()
        site = Site(tmp_path, cluster.url)
        runs = ("r1", "r2", "r3")
        site.submit(*runs)
        stop_cluster(cluster)
        worker = site.worker("--lease-ttl", "2", env={"WL_MODEL_SLOW": "1.0"})
        wait(lambda: "finding work failed" in site.out(worker), 30, site)
        assert worker.poll() is None, site.all_logs()
        cluster.start()
        wait(lambda: all(site.marked(f"model {r} 0") for r in runs), 40, site)
        stop_cluster(cluster)
        time.sleep(1.5)
        assert worker.poll() is None, site.all_logs()
        cluster.start()
        wait(lambda: site.completed(*runs), 60, site)
        worker.send_signal(signal.SIGTERM)
        assert site.finish(worker) == 0, site.all_logs()
        site.once_each(*runs)
        assert site.parked() == []
        assert "Traceback" not in site.out(worker) + site.err(worker)
    finally:
        if site is not None:
            site.kill_all()
        cluster.stop()


# --- numbers at their edges and the documented flags -------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--concurrency", "0"],
        ["--concurrency", "-1"],
        ["--concurrency", "10001"],
        ["--concurrency", "99999999999999999999"],
        ["--concurrency", "1e3"],
        ["--concurrency", "two"],
        ["--lease-ttl", "nan"],
        ["--lease-ttl", "inf"],
        ["--lease-ttl", "-0"],
        ["--lease-ttl", "soon"],
        ["--temporal", "127.0.0.1:1"],
        ["--task-queue", "q"],
    ],
    ids=lambda flags: "=".join(flags),
)
def test_worker_numbers_and_flags_no_worker_can_use_are_one_sentence_and_exit_2(
    site: Site, flags: list[str]
) -> None:
    worker = site.worker("--exit-when-idle", *flags)
    assert site.finish(worker) == 2, site.all_logs()
    err = site.err(worker)
    assert one_sentence(err) and err.startswith("tesserix: "), err
    assert site.out(worker) == ""


@pytest.mark.parametrize("concurrency", ["1", "10000"])
def test_concurrency_at_its_edges_carries_every_run_once(site: Site, concurrency: str) -> None:
    runs = [f"r{n}" for n in range(6)]
    site.submit(*runs)
    worker = site.worker("--exit-when-idle", "--concurrency", concurrency)
    assert site.finish(worker) == 0, site.all_logs()
    assert f"{int(concurrency)} at a time" in site.out(worker)
    assert site.completed(*runs), site.all_logs()
    site.once_each(*runs)


def test_a_lease_ttl_no_run_can_be_carried_under_is_refused_or_the_run_finishes(
    site: Site,
) -> None:
    site.submit("r1")
    worker = site.worker("--exit-when-idle", "--lease-ttl", "0.001")
    code = site.finish(worker)
    err = site.err(worker)
    refused = code == 2 and one_sentence(err)
    assert refused or (code == 0 and site.completed("r1")), (code, site.all_logs())
    assert site.parked() == [], "a worker's own setting parked the run"


@pytest.mark.postgres
def test_a_lease_ttl_the_store_cannot_hold_is_refused_or_the_run_finishes(
    tmp_path: Path,
) -> None:
    with postgres_site(tmp_path) as site:
        site.submit("r1")
        worker = site.worker("--exit-when-idle", "--lease-ttl", "1e300")
        code = site.finish(worker)
        err = site.err(worker)
        refused = code == 2 and one_sentence(err)
        assert refused or (code == 0 and site.completed("r1")), (code, site.all_logs())


def _documented_worker_flags() -> list[str]:
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `tesserix worker"))
    return sorted(set(re.findall(r"--[a-z][a-z-]+", row)) | {"--json"})


def test_every_documented_worker_flag_is_in_its_help(site: Site) -> None:
    flags = _documented_worker_flags()
    assert "--exit-when-idle" in flags and "--lease-ttl" in flags
    shown = site.tesserix("worker", "--help")
    assert shown.returncode == 0, shown.stderr
    missing = [f for f in flags if f not in shown.stdout]
    assert missing == [], shown.stdout


def test_provider_worker_and_lease_ttl_flags_are_used(site: Site) -> None:
    """``--provider module:attr``, ``--worker NAME`` and ``--lease-ttl`` as documented: the
    run is carried by that provider, the lines name the worker, the ttl is the one given."""
    site.submit("r1")
    worker = site.worker(
        "--exit-when-idle",
        "--provider",
        "wl_agent:OTHER_PROVIDER",
        "--worker",
        "night-shift",
        "--lease-ttl",
        "7.5",
    )
    assert site.finish(worker) == 0, site.all_logs()
    out = site.out(worker)
    assert out.startswith("worker night-shift: carrying runs of wl, 8 at a time, lease ttl 7.5 s")
    assert site.completed("r1")
    site.once_each("r1")
    bad = site.worker("--exit-when-idle", "--provider", "wl_agent:NO_SUCH_PROVIDER")
    assert site.finish(bad) == 2, site.all_logs()
    assert one_sentence(site.err(bad)), site.err(bad)


def test_exit_when_idle_with_temporal_is_one_sentence_and_exit_2(site: Site) -> None:
    pytest.importorskip("temporalio")
    worker = site.worker("--exit-when-idle", "--temporal", "127.0.0.1:1", "--task-queue", "q")
    assert site.finish(worker) == 2, site.all_logs()
    assert one_sentence(site.err(worker)), site.err(worker)
