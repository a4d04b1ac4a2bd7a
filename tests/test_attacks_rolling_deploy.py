"""An attack on a rolling deploy of an AGENT (not of the kit): workers of the old and the new
revision of one agent (same name; the new one adds a tool, renames one, rewords the
instructions, or changes a tool's business key function) poll ONE store side by side, as
real OS processes (``python -m tesserix_adk worker``), on a SQLite file and on PostgreSQL
(a schema of this test's own). A worker is SIGKILLed inside a side-effecting tool, after its
effect (the tool appends a line to a file, then blocks), and a worker of the other revision
finds the run.

The oracle: each business key's effect at most once (lines in the effects file); every run
completes, or is parked with a reason ``tesserix runs --stuck`` shows, saying what to do;
after that action it completes, each effect still once; the operator's commands exit with
the README's codes and one sentence.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from processes import store_url
from tesserix_adk.stores.urls import open_stores

T = "rolling"
EXIT_CODES = {0, 1, 2, 3, 4}

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
# The held promises run on PostgreSQL too with ADK_SLOW=1 (real worker processes each):
# CI keeps under 20 minutes; the defect's own test runs on both in CI.
SQLITE_IN_CI = [
    BACKENDS[0],
    pytest.param("postgres", id="postgres", marks=(pytest.mark.postgres, pytest.mark.slow)),
]

_MODULE = '''
import os
import time
from pathlib import Path

from tesserix_adk import Agent, Message, ModelResponse, Role, ToolCall, tool

EFFECTS = Path({effects!r})
HOLD = Path({hold!r})
READY = Path({ready!r})
REV = {rev!r}


def _effect(name, key):
    with EFFECTS.open("a") as f:
        f.write(f"{{name}}-{{key}} {{REV}}\\n")
        f.flush()
        os.fsync(f.fileno())
    if HOLD.exists():
        READY.write_text(f"{{name}}-{{key}}")
        time.sleep(3600)  # SIGKILLed here, after the effect
    return "done " + key


def _key(*, tool, arguments, **_):
    return {key_prefix!r} + "-" + tool + "-" + arguments["key"]


TOOLS = []
for _name in {tools!r}:
    def _make(n):
        def fn(key: str) -> str:
            """Book under a business key (side-effecting)."""
            return _effect(n, key)
        fn.__name__ = n
        return tool(key=_key, name=n)(fn)
    TOOLS.append(_make(_name))

agent = Agent("booker", {instructions!r}, TOOLS)


class Plan:
    """One call per word of the user's message (``book:k1 book:k2``), then done; the
    tool of a word is renamed through RENAME (a new revision's name for it)."""

    RENAME = {rename!r}

    async def complete(self, request):
        user = next(m for m in request.messages if m.role is Role.user)
        plan = str(user.content).split()
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked >= len(plan):
            return ModelResponse(message=Message(role=Role.assistant, content="all done"))
        name, key = plan[asked].split(":")
        name = self.RENAME.get(name, name)
        call = ToolCall(id=f"c{{asked}}", name=name, arguments={{"key": key}})
        return ModelResponse(
            message=Message(role=Role.assistant, content="", tool_calls=[call])
        )


PROVIDER = Plan()
'''


class Deploy:
    """One store, one effects file, and agent files of two (or more) revisions."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp = tmp
        self.url = url
        self.effects = tmp / "effects.txt"
        self.hold = tmp / "hold"
        self.ready = tmp / "ready"
        self.procs: list[subprocess.Popen[str]] = []

    def agent(
        self,
        rev: str,
        *,
        tools: tuple[str, ...] = ("book",),
        instructions: str = "Book.",
        key_prefix: str = "biz",
        rename: dict[str, str] | None = None,
    ) -> str:
        path = self.tmp / f"agent_{rev}.py"
        path.write_text(
            _MODULE.format(
                effects=str(self.effects),
                hold=str(self.hold),
                ready=str(self.ready),
                rev=rev,
                key_prefix=key_prefix,
                tools=list(tools),
                instructions=instructions,
                rename=rename or {},
            ),
            encoding="utf-8",
        )
        return f"{path}:agent"

    def counts(self) -> Counter[str]:
        if not self.effects.exists():
            return Counter()
        return Counter(line.split()[0] for line in self.effects.read_text().splitlines())

    def tesserix(self, *argv: str) -> tuple[int, str, str]:
        done = subprocess.run(
            [sys.executable, "-m", "tesserix_adk", "--store", self.url, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.tmp,
        )
        return done.returncode, done.stdout, done.stderr

    def typed(self, argv: tuple[str, ...], code: int, err: str) -> None:
        assert code in EXIT_CODES, (argv, code, err)
        if code:
            assert "Traceback" not in err, (argv, err)
            assert err.startswith("tesserix: ") and err.count("\n") == 1, (argv, err)

    def cli(self, *argv: str) -> tuple[int, str, str]:
        code, out, err = self.tesserix(*argv)
        self.typed(argv, code, err)
        return code, out, err

    def worker(self, agent: str, name: str, *extra: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tesserix_adk",
                "--store",
                self.url,
                "worker",
                "--agent",
                agent,
                "--worker",
                name,
                "--lease-ttl",
                "1",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def idle_worker(self, agent: str, name: str) -> tuple[int, str, str]:
        """A worker run until nothing is due (``--exit-when-idle``)."""
        proc = self.worker(agent, name, "--exit-when-idle")
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err

    def killed_in_tool(self, agent: str, name: str) -> str:
        """A worker the test SIGKILLs inside a tool, after its effect; which call it was."""
        self.hold.touch()
        proc = self.worker(agent, name)
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"worker ended before the tool: {out} {err}")
            assert time.monotonic() < deadline, "the tool was never reached"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        self.hold.unlink()
        which = self.ready.read_text()
        self.ready.unlink()
        return which

    async def lapse(self, run_id: str) -> None:
        """Until the run's lease (and so the killed worker's resume claim) lapsed."""
        async with open_stores(self.url) as stores:
            deadline = time.monotonic() + 30
            while await stores.leases.current(T, run_id) is not None:
                assert time.monotonic() < deadline, "lease never lapsed"
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.2)  # the resume claim lapses with the lease ttl (1 s)

    def stuck(self, *extra: str) -> dict[str, dict[str, object]]:
        code, out, err = self.cli("runs", "--tenant", T, "--stuck", "--json", *extra)
        assert code == 0, err
        return {str(r["run_id"]): r for r in json.loads(out)["runs"]}

    def status(self, run_id: str) -> str:
        code, out, err = self.cli("inspect", run_id, "--tenant", T, "--json")
        assert code == 0, err
        return str(json.loads(out)["status"])

    def submit(self, agent: str, run_id: str, plan: str) -> None:
        code, _, err = self.cli(
            "submit", "--agent", agent, "--tenant", T, "--input", plan, "--run-id", run_id
        )
        assert code == 0, err

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)


@asynccontextmanager
async def deploy(backend: str, tmp: Path) -> AsyncIterator[Deploy]:
    async with store_url(backend, tmp) as url:
        async with open_stores(url) as stores:
            await stores.create_schema()
        d = Deploy(tmp, url)
        try:
            yield d
        finally:
            d.close()


# --- a run of the new revision, its worker killed in a tool, found by an old worker -------


@pytest.mark.parametrize("backend", SQLITE_IN_CI)
async def test_old_worker_parks_a_new_run_killed_in_a_tool_and_the_advice_completes_it(
    tmp_path: Path, backend: str
) -> None:
    async with deploy(backend, tmp_path) as d:
        old = d.agent("v1")
        new = d.agent("v2", tools=("book", "ship"), instructions="Book, then ship.")
        d.submit(new, "r1", "book:k1 ship:k2")
        assert d.killed_in_tool(new, "new-a") == "book-k1"
        await d.lapse("r1")
        code, out, err = await asyncio.to_thread(d.idle_worker, old, "old-a")
        assert code == 0, err
        assert d.counts() == Counter({"book-k1": 1})
        stuck = d.stuck()
        assert "r1" in stuck, stuck
        reason = str(stuck["r1"]["reason"])
        assert "RevisionMismatchError" in reason or "revision" in reason, reason
        # Whatever the advice, the run of the NEW revision must not be carried by the old
        # agent: the call in doubt is named when the new agent resumes it.
        code, out, err = d.cli("run", "--resume", "r1", "--tenant", T, "--agent", new)
        assert code == 4, (out, err)
        assert "c0" in out + err or "book" in out + err, (out, err)
        assert d.counts() == Counter({"book-k1": 1})
        code, out, err = d.cli(
            "resolve", "r1", "--tenant", T, "--call", "c0", "--outcome", '"done k1"', "--by", "al"
        )
        assert code == 0, (out, err)
        code, out, err = await asyncio.to_thread(d.idle_worker, new, "new-b")
        assert code == 0, err
        assert d.status("r1") == "completed"
        assert d.counts() == Counter({"book-k1": 1, "ship-k2": 1})


@pytest.mark.parametrize("backend", BACKENDS)
async def test_new_worker_carries_a_new_run_an_old_worker_parked(
    tmp_path: Path, backend: str
) -> None:
    async with deploy(backend, tmp_path) as d:
        old = d.agent("v1")
        new = d.agent("v2", instructions="Book carefully.")
        d.submit(new, "r1", "book:k1 book:k2")
        # The new worker is SIGKILLed in k1 after its effect; the operator settles k1 as
        # the tool's system says (README, "At 3 a.m."), and a worker picks the run up again.
        assert d.killed_in_tool(new, "new-a") == "book-k1"
        await d.lapse("r1")
        code, out, err = d.cli(
            "resolve", "r1", "--tenant", T, "--call", "c0", "--outcome", '"done k1"', "--by", "al"
        )
        assert code == 0, (out, err)
        # Side by side: the old worker happens to poll first and meets the resolved run.
        code, out, err = await asyncio.to_thread(d.idle_worker, old, "old-a")
        assert code == 0, err
        assert "parked: RevisionMismatchError" in out, out  # the set-up, not the defect
        assert d.counts() == Counter({"book-k1": 1})
        # The deploy goes on: a worker of the run's own revision starts. It could carry the
        # run (nothing needs accepting), and the operator already did what was asked.
        code, out, err = await asyncio.to_thread(d.idle_worker, new, "new-b")
        assert code == 0, err
        assert d.counts() == Counter({"book-k1": 1, "book-k2": 1})
        assert d.status("r1") == "completed"


async def test_stuck_advice_for_a_run_of_the_current_revision_is_not_accept_revision(
    tmp_path: Path,
) -> None:
    async with deploy("sqlite", tmp_path) as d:
        old = d.agent("v1")
        new = d.agent("v2", instructions="Book carefully.")
        d.submit(new, "r1", "book:k1")
        assert d.killed_in_tool(new, "new-a") == "book-k1"
        await d.lapse("r1")
        code, out, err = await asyncio.to_thread(d.idle_worker, old, "old-a")
        assert code == 0 and "parked: RevisionMismatchError" in out, (out, err)
        row = d.stuck("--agent", new)["r1"]
        reason = str(row["blocked"])
        # The run IS of the current agent's revision: nothing is to be accepted (following
        # the advice with the old module still deployed beside it pins the new run to the
        # OLD revision: "revision NEW accepted as OLD").
        assert "--accept-revision" not in reason, reason


@pytest.mark.parametrize("backend", SQLITE_IN_CI)
async def test_renamed_tool_refuses_acceptance_and_the_old_agent_finishes_it_once(
    tmp_path: Path, backend: str
) -> None:
    async with deploy(backend, tmp_path) as d:
        old = d.agent("v1")
        new = d.agent("v2", tools=("reserve",), rename={"book": "reserve"})
        d.submit(old, "r1", "book:k1 book:k2")
        assert d.killed_in_tool(old, "old-a") == "book-k1"
        await d.lapse("r1")
        code, out, err = await asyncio.to_thread(d.idle_worker, new, "new-a")
        assert code == 0 and "parked: RevisionMismatchError" in out, (out, err)
        assert "r1" in d.stuck()
        code, out, err = d.cli(
            "run",
            "--resume",
            "r1",
            "--tenant",
            T,
            "--agent",
            new,
            "--accept-revision",
            "--by",
            "al",
        )
        assert code == 4 and "no longer exists" in err, (code, out, err)
        assert d.counts() == Counter({"book-k1": 1})
        code, out, err = d.cli(
            "resolve", "r1", "--tenant", T, "--call", "c0", "--outcome", '"done k1"', "--by", "al"
        )
        assert code == 0, (out, err)
        code, out, err = d.cli("run", "--resume", "r1", "--tenant", T, "--agent", old)
        assert code == 0, (out, err)
        assert d.status("r1") == "completed"
        assert d.counts() == Counter({"book-k1": 1, "book-k2": 1})


@pytest.mark.parametrize("backend", SQLITE_IN_CI)
async def test_changed_key_function_same_revision_sends_nothing_twice(
    tmp_path: Path, backend: str
) -> None:
    async with deploy(backend, tmp_path) as d:
        old = d.agent("v1")
        new = d.agent("v2", key_prefix="biz2")  # the key function is not in the revision
        d.submit(old, "r1", "book:k1 book:k2")
        assert d.killed_in_tool(old, "old-a") == "book-k1"
        await d.lapse("r1")
        code, out, err = await asyncio.to_thread(d.idle_worker, new, "new-a")
        assert code == 0 and "parked: IndeterminateToolCallError" in out, (out, err)
        assert d.counts() == Counter({"book-k1": 1})
        code, out, err = d.cli(
            "resolve", "r1", "--tenant", T, "--call", "c0", "--outcome", '"done k1"', "--by", "al"
        )
        assert code == 0, (out, err)
        code, out, err = await asyncio.to_thread(d.idle_worker, new, "new-b")
        assert code == 0, err
        assert d.status("r1") == "completed"
        assert d.counts() == Counter({"book-k1": 1, "book-k2": 1})


def test_accept_revision_without_by_is_one_sentence_exit_2(tmp_path: Path) -> None:
    d = Deploy(tmp_path, f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    new = d.agent("v2")
    code, out, err = d.tesserix("schema", "apply")
    assert code == 0, err
    code, out, err = d.cli(
        "run", "--resume", "r1", "--tenant", T, "--agent", new, "--accept-revision"
    )
    assert code == 2 and "--by" in err, (code, out, err)
