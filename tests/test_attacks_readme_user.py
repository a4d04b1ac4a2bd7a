"""A careful user's first days with README.md, on PostgreSQL and Redis (the URLs of
``tests/conftest.py``'s services): the README's own ``my_agent.py`` (its store URL changed
to the backend's), killed with SIGKILL and carried on; a booking agent with keyed and
unkeyed side-effecting tools and parallel calls in one turn; an approval decided with
``tesserix approve`` and carried by a ``Worker``; ``tesserix submit`` and ``tesserix
worker`` recovering a run whose worker was killed; ``runner.resume`` after a crash; the same
request retried on the same runner; a cancel while a tool runs; ``tesserix inspect``,
``show``, ``runs``, ``resolve``. A planted API key is looked for in every raw Redis value and
PostgreSQL row, and in every CLI output.

Found, and fixed (``open_calls`` counts an in-flight call whose arguments the frontier
masked, read-only or not):

- MEDIUM: ``tesserix runs --stuck`` leaves out a run whose read-only call with masked
  arguments was in flight when its process died, though ``run --resume`` refuses it
  (exit 4, indeterminate) and nothing carries it on until a worker parks it
  (``cli/reasons.py`` ``open_calls`` counts a redacted call only through
  ``checkpoint/planning.py`` ``left_open``, which drops read-only records):
  ``test_stuck_lists_a_run_refused_for_a_masked_read_only_call``.

Held (plain tests):

- README "Start here" step 3 on Redis: SIGKILL in ``seat_map``, ``inspect`` says
  ``never_ran``, ``run --resume`` completes with one booking, again does nothing
  (``test_start_here_step_3_killed_and_resumed``).
- A parallel turn (twin keyed bookings, a read-only lookup whose argument holds a key) killed
  in the lookup: twins booked once each under two keys; the masked lookup is never sent
  with masked arguments (refused in doubt, exit 4); ``resolve --outcome`` (holding the key)
  then ``run --resume`` completes; the unkeyed call of the next turn goes out once; the key
  is in no CLI output and no raw row or value
  (``test_parallel_turn_killed_in_read_only_call_with_a_secret``).
- An approval decided by ``tesserix approve`` (``--by`` and ``--note`` holding the key):
  nothing of the turn sent before, a ``Worker(exit_when_idle=True)`` sends the booking once,
  a second worker and a resume send nothing, the key stored nowhere
  (``test_approval_decided_by_cli_and_carried_by_a_worker``).
- A cancel while a booking is in its tool: the booking finishes, the next turn's charge is
  never sent, the run ends ``cancelled``; resume and worker send nothing
  (``test_cancel_while_a_tool_runs``).
- The same ``run()`` retried on the same runner while the first is in its tool, and after
  it ended: typed refusals, one booking (``test_the_same_request_retried_on_the_same_runner``).
- ``tesserix submit`` + ``tesserix worker`` killed with SIGKILL, an idle worker right after,
  a worker after the lease lapsed: completed with one booking
  (``test_running_workers_submit_kill_and_carry_on``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from processes import held_open, store_url
from tesserix_adk import (
    AdkError,
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    LeasePolicy,
    RunStartedError,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.cli import frontier_main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
TENANT = "acme"

PG_REDIS = [
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


def readme_file(name: str) -> str:
    """The README block marked ``<!-- file: NAME -->``, as written."""
    text = README.read_text()
    mark = text.index(f"<!-- file: {name} -->")
    start = text.index("```python\n", mark) + len("```python\n")
    return text[start : text.index("```", start)]


REDIS = [PG_REDIS[1]]
POSTGRES = [PG_REDIS[0]]


@pytest.fixture
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory like the README's (``my_agent.py`` saved there, its store URL changed to
    the backend's, as a user moving off SQLite would) and the store URL."""
    with held_open(store_url(request.param, tmp_path)) as url:
        source = readme_file("my_agent.py")
        assert '"sqlite:///.adk/adk.sqlite3"' in source
        (tmp_path / "my_agent.py").write_text(
            source.replace('"sqlite:///.adk/adk.sqlite3"', repr(url))
        )
        yield tmp_path, url


def env_for(url: str) -> dict[str, str]:
    env = {**os.environ, "ADK_STORE": url}
    env.pop("SLOW", None)
    return env


def tesserix(cwd: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tesserix_adk", *args],
        cwd=cwd,
        env=env_for(url),
        capture_output=True,
        text=True,
        timeout=120,
    )


def wait_for(path: Path, text: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None, f"process ended early: {proc.returncode}"
        assert time.monotonic() < deadline, f"never saw {text!r}"
        time.sleep(0.05)


@pytest.mark.parametrize("site", REDIS, indirect=True)
def test_start_here_step_3_killed_and_resumed(site: tuple[Path, str]) -> None:
    """README "Start here" step 3 on PostgreSQL and Redis: SIGKILL in the slow read-only tool
    after the booking, ``inspect``, wait out the 2 s lease, ``run --resume``, one booking; a
    second resume does nothing. Held."""
    cwd, url = site
    assert tesserix(cwd, url, "schema", "apply").returncode == 0
    log = cwd / "run-1.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "my_agent.py", "run-1"],
            cwd=cwd,
            env={**env_for(url), "SLOW": "60"},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_for(log, "seat map", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert len((cwd / "bookings.txt").read_text().splitlines()) == 1
    shown = tesserix(cwd, url, "inspect", "run-1", "--tenant", TENANT)
    assert shown.returncode == 0, shown.stderr
    assert "seat_map (call_2_0): never_ran" in shown.stdout, shown.stdout
    time.sleep(3)
    resumed = tesserix(
        cwd, url, "run", "--resume", "run-1", "--tenant", TENANT, "--agent", "my_agent:agent"
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "completed" in resumed.stdout
    assert len((cwd / "bookings.txt").read_text().splitlines()) == 1
    again = tesserix(
        cwd, url, "run", "--resume", "run-1", "--tenant", TENANT, "--agent", "my_agent:agent"
    )
    assert again.returncode == 0, again.stderr
    assert "nothing" in again.stdout, again.stdout
    assert len((cwd / "bookings.txt").read_text().splitlines()) == 1


SECRET = "sk-proj-" + "Q7vT2mXk9LpR4sWn8ZcYb3HdJf6GqA1eUo5Ni0Vt"

TRIP_AGENT = '''
"""trip.py: a turn of parallel calls (twin bookings, a slow read-only lookup whose argument
holds a credential), then an unkeyed notification, then the answer."""

import json
import os
import time

from tesserix_adk import (
    Agent, AgentRunner, LeasePolicy, ScriptedProvider, ToolContext, open_stores, tool,
)


def _log(name, **kw):
    with open("effects.jsonl", "a") as f:
        f.write(json.dumps({"tool": name, **kw}) + "\\n")


@tool
def book_seat(flight: str, ctx: ToolContext) -> dict:
    """Book one seat."""
    _log("book_seat", flight=flight, key=ctx.idempotency_key)
    return {"booking": "BK-" + flight, "key": ctx.idempotency_key[-6:]}


@tool(side_effects=False)
def lookup(account: str) -> str:
    """Look an account up (slow when SLOW is set)."""
    _log("lookup", account=account)
    print("in lookup", flush=True)
    time.sleep(float(os.environ.get("SLOW", "0")))
    return "gold member"


@tool(key=None)
def notify(text: str) -> str:
    """Send a message (no key: the messaging service cannot deduplicate)."""
    _log("notify", text=text)
    return "sent"


agent = Agent("trip", "Book the trip.", [book_seat, lookup, notify], parallel_tool_calls=4)

PROVIDER = ScriptedProvider([
    [("book_seat", {"flight": "LH400"}), ("book_seat", {"flight": "LH400"}),
     ("lookup", {"account": "SECRET_HERE"})],
    [("notify", {"text": "booked twice"})],
    "Two seats on LH400.",
])


async def main(run_id):
    async with open_stores(os.environ["ADK_STORE"]) as stores:
        runner = AgentRunner.from_stores(
            PROVIDER, stores, worker="trip", lease_policy=LeasePolicy(ttl=1, renew_within=0.5)
        )
        run = await runner.run(agent, "Two seats on LH400 please.", tenant="acme", run_id=run_id)
        print("RESULT", run.status, run.output, flush=True)


if __name__ == "__main__":
    import asyncio, sys
    asyncio.run(main(sys.argv[1]))
'''.replace("SECRET_HERE", SECRET)


def effects(cwd: Path) -> list[dict[str, str]]:
    path = cwd / "effects.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_lease_lapsed(url: str, run_id: str) -> None:
    from tesserix_adk import open_stores

    async def current() -> object:
        async with open_stores(url) as stores:
            return await stores.leases.current(TENANT, run_id)

    deadline = time.monotonic() + 15
    while asyncio.run(current()) is not None:
        assert time.monotonic() < deadline, "lease never lapsed"
        time.sleep(0.1)


async def raw_store_text(url: str) -> str:
    """Every byte the backend holds under this test's prefix or schema, as text."""
    if url.startswith("redis"):
        import redis.asyncio as aioredis

        from adapters.services import REDIS_URL

        prefix = re.search(r"prefix=([^&]+)", url)
        assert prefix is not None
        client = aioredis.from_url(REDIS_URL)
        parts: list[str] = []
        try:
            async for key in client.scan_iter(match=f"{prefix.group(1)}*", count=1000):
                kind = (await client.type(key)).decode()
                if kind == "string":
                    value: object = await client.get(key)
                elif kind == "hash":
                    value = await client.hgetall(key)
                elif kind == "list":
                    value = await client.lrange(key, 0, -1)
                elif kind == "set":
                    value = await client.smembers(key)
                elif kind == "zset":
                    value = await client.zrange(key, 0, -1, withscores=True)
                elif kind == "stream":
                    value = await client.xrange(key)
                else:
                    value = kind
                parts.append(f"{key!r} {value!r}")
        finally:
            await client.aclose()
        return "\n".join(parts)
    import psycopg

    from adapters.services import POSTGRES_URL

    schema = re.search(r"search_path%3D([A-Za-z0-9_]+)", url)
    assert schema is not None, url
    parts = []
    async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (schema.group(1),),
        )
        for (table,) in await cur.fetchall():
            rows = await conn.execute(f'SELECT t::text FROM "{schema.group(1)}"."{table}" t')
            parts.extend(f"{table} {row[0]}" for row in await rows.fetchall())
    return "\n".join(parts)


@pytest.mark.parametrize("site", PG_REDIS, indirect=True)
def test_parallel_turn_killed_in_read_only_call_with_a_secret(site: tuple[Path, str]) -> None:
    """A parallel turn (twin keyed bookings and a read-only lookup whose argument holds an API
    key) killed with SIGKILL inside the lookup, then ``tesserix run --resume``: each twin
    booked once, the lookup never sent with masked arguments, the unkeyed notification of the
    next turn sent once, and the key nowhere in the store's raw rows or values."""
    cwd, url = site
    (cwd / "trip.py").write_text(TRIP_AGENT)
    assert tesserix(cwd, url, "schema", "apply").returncode == 0
    log = cwd / "trip.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "trip.py", "trip-1"],
            cwd=cwd,
            env={**env_for(url), "SLOW": "60"},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_for(log, "in lookup", proc)
        deadline = time.monotonic() + 20
        while sum(e["tool"] == "book_seat" for e in effects(cwd)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # the bookings' outcomes recorded
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    wait_lease_lapsed(url, "trip-1")
    args = ("--tenant", TENANT, "--agent", "trip:agent")
    refused = tesserix(cwd, url, "run", "--resume", "trip-1", *args)
    done = effects(cwd)
    assert [e for e in done if "redacted" in json.dumps(e)] == [], done
    books = [e for e in done if e["tool"] == "book_seat"]
    assert len(books) == 2 and books[0]["key"] != books[1]["key"], done
    # A read-only call whose arguments were masked cannot be sent again: refused in doubt.
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "lookup (call_0_2): indeterminate" in refused.stdout
    stuck = tesserix(cwd, url, "runs", "--tenant", TENANT)
    assert "trip-1" in stuck.stdout, stuck.stdout + stuck.stderr
    outcome = json.dumps({"status": "gold member", "checked_with": f"api_key={SECRET}"})
    resolved = tesserix(
        cwd,
        url,
        "resolve",
        "trip-1",
        "--tenant",
        TENANT,
        "--call",
        "call_0_2",
        "--outcome",
        outcome,
        "--by",
        "alice",
        "--margin",
        "0",
    )
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    resumed = tesserix(cwd, url, "run", "--resume", "trip-1", *args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "completed" in resumed.stdout, resumed.stdout
    done = effects(cwd)
    assert [e["tool"] for e in done].count("book_seat") == 2, done
    assert [e["tool"] for e in done].count("lookup") == 1, done
    assert [e["tool"] for e in done].count("notify") == 1, done
    shown = tesserix(cwd, url, "show", "trip-1", "--tenant", TENANT, "--json")
    assert shown.returncode == 0, shown.stderr
    for out in (refused, stuck, resolved, resumed, shown):
        assert SECRET not in out.stdout + out.stderr
    assert SECRET not in asyncio.run(raw_store_text(url))


# --- in-process: the "Using it" session on PostgreSQL and Redis ---------------------------


@contextlib.asynccontextmanager
async def opened(backend: str, tmp: Path) -> AsyncIterator[tuple[Stores, str]]:
    async with store_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores, url


async def cli(url: str, *argv: str) -> tuple[int, str]:
    """A frontier command (``frontier_main``, as a product embeds it) on stores of its own,
    in a thread: it runs its own event loop and closes its stores."""

    def call() -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue() + err.getvalue()

    return await asyncio.to_thread(call)


class Airline:
    """What the outside world saw: every call each tool made, with its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def count(self, name: str) -> int:
        return sum(1 for tool_name, _ in self.calls if tool_name == name)


@pytest.mark.parametrize("backend", PG_REDIS)
async def test_approval_decided_by_cli_and_carried_by_a_worker(
    backend: str, tmp_path: Path
) -> None:
    """README "Tools, keys and approvals" and "Running workers": a call that needs approval
    waits; ``tesserix approve`` (note and ``--by`` holding a secret) wakes the run; a
    ``Worker(exit_when_idle=True)`` sends the call once; a second worker does nothing; the
    secret is nowhere in the store. Held."""
    airline = Airline()

    @tool(requires_approval=True)
    def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book one seat."""
        airline.calls.append(("book_seat", {"flight": flight}))
        return {"booking": f"BK-{flight}"}

    @tool(side_effects=False)
    def search_flights(origin: str, destination: str) -> list[str]:
        """Find flights."""
        airline.calls.append(("search_flights", {"origin": origin}))
        return ["LH400"]

    agent = Agent("booking", "Book.", [search_flights, book_seat])
    provider = ScriptedProvider(
        [
            [("search_flights", {"origin": "FRA", "destination": "JFK"})],
            [
                ("book_seat", {"flight": "LH400"}),
                ("search_flights", {"origin": "FRA", "destination": "EWR"}),
            ],
            "Booked LH400.",
        ]
    )
    async with opened(backend, tmp_path) as (stores, url):
        runner = AgentRunner.from_stores(provider, stores, worker="web-1")
        run = await runner.run(agent, "Book me FRA to JFK.", tenant=TENANT, run_id="appr-1")
        assert run.status is RunStatus.waiting_approval
        assert run.pending_approval is not None
        # Approvals come first: nothing of the turn was sent.
        assert airline.count("book_seat") == 0 and airline.count("search_flights") == 1
        code, text = await cli(
            url,
            "approve",
            run.pending_approval.id,
            "--tenant",
            TENANT,
            "--by",
            f"alice {SECRET}",
            "--note",
            f"ok, paid with password={SECRET}",
        )
        assert code == 0, text
        assert SECRET not in text
        await Worker(runner, [agent], exit_when_idle=True).run()
        assert airline.count("book_seat") == 1, airline.calls
        assert airline.count("search_flights") == 2, airline.calls
        await Worker(runner, [agent], exit_when_idle=True).run()
        done = await runner.resume(agent, "appr-1", tenant=TENANT)
        assert done.status is RunStatus.completed and done.output == "Booked LH400."
        assert airline.count("book_seat") == 1
        for command in (("show", "appr-1"), ("inspect", "appr-1"), ("runs",)):
            code, text = await cli(url, *command, "--tenant", TENANT)
            assert code == 0, text
            assert SECRET not in text
        assert SECRET not in await raw_store_text(url)


@pytest.mark.parametrize("backend", PG_REDIS)
async def test_cancel_while_a_tool_runs(backend: str, tmp_path: Path) -> None:
    """README ``tesserix cancel``: a cancel asked while a booking is in the tool lets it
    finish and record, sends nothing after it (the next turn's call is not sent), ends the
    run ``cancelled``; a resume and a worker send nothing more. Held."""
    airline = Airline()
    entered, release = asyncio.Event(), asyncio.Event()

    @tool
    async def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book one seat."""
        airline.calls.append(("book_seat", {"flight": flight}))
        entered.set()
        await release.wait()
        return {"booking": f"BK-{flight}"}

    @tool
    def charge(amount: int) -> str:
        """Charge the card."""
        airline.calls.append(("charge", {"amount": amount}))
        return "charged"

    agent = Agent("booking", "Book.", [book_seat, charge])
    provider = ScriptedProvider(
        [[("book_seat", {"flight": "LH400"})], [("charge", {"amount": 40})], "Done."]
    )
    async with opened(backend, tmp_path) as (stores, url):
        runner = AgentRunner.from_stores(provider, stores, worker="web-1")
        task = asyncio.create_task(runner.run(agent, "Book.", tenant=TENANT, run_id="cx-1"))
        await asyncio.wait_for(entered.wait(), 10)
        asked = await runner.cancel("cx-1", tenant=TENANT, by="bob", reason="customer called")
        assert asked is None  # a live holder ends it
        release.set()
        run = await asyncio.wait_for(task, 20)
        assert run.status is RunStatus.cancelled, run
        assert airline.calls == [("book_seat", {"flight": "LH400"})]
        again = await runner.resume(agent, "cx-1", tenant=TENANT)
        assert again.status is RunStatus.cancelled
        await Worker(runner, [agent], exit_when_idle=True).run()
        assert airline.calls == [("book_seat", {"flight": "LH400"})]
        code, text = await cli(url, "show", "cx-1", "--tenant", TENANT)
        assert code == 0 and "customer called" in text, text


@pytest.mark.parametrize("backend", PG_REDIS)
async def test_the_same_request_retried_on_the_same_runner(backend: str, tmp_path: Path) -> None:
    """A web handler's ``runner.run(..., run_id=order)`` retried by the client while the first
    is still in the booking, then once more after it finished: one booking; the retries are
    refused with the kit's typed errors (README: a run id names one run for good). Held."""
    airline = Airline()
    entered, release = asyncio.Event(), asyncio.Event()

    @tool
    async def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book one seat."""
        airline.calls.append(("book_seat", {"flight": flight}))
        entered.set()
        await release.wait()
        return {"booking": f"BK-{flight}"}

    agent = Agent("booking", "Book.", [book_seat])
    provider = ScriptedProvider([[("book_seat", {"flight": "LH400"})], "Booked."])
    async with opened(backend, tmp_path) as (stores, _url):
        runner = AgentRunner.from_stores(provider, stores, worker="web-1")
        first = asyncio.create_task(runner.run(agent, "Book.", tenant=TENANT, run_id="order-7"))
        await asyncio.wait_for(entered.wait(), 10)
        with pytest.raises(AdkError) as retried:
            await runner.run(agent, "Book.", tenant=TENANT, run_id="order-7")
        assert retried.value.retryable or isinstance(retried.value, RunStartedError)
        release.set()
        assert (await first).status is RunStatus.completed
        with pytest.raises(RunStartedError):
            await runner.run(agent, "Book.", tenant=TENANT, run_id="order-7")
        assert (await runner.resume(agent, "order-7", tenant=TENANT)).output == "Booked."
        assert airline.count("book_seat") == 1


@pytest.mark.parametrize("backend", PG_REDIS)
async def test_stuck_lists_a_run_refused_for_a_masked_read_only_call(
    backend: str, tmp_path: Path
) -> None:
    """README ``tesserix runs``: ``--stuck`` keeps "runs with calls in flight that a resume
    cannot send again ... and no live lease"; "At 3 a.m. ``runs --stuck`` shows what waits
    for you". A read-only lookup whose argument held a key, its process dead inside it."""

    @tool(side_effects=False)
    def lookup(account: str) -> str:
        """Look an account up."""
        raise SimulatedCrash

    agent = Agent("support", "Help.", [lookup])
    provider = ScriptedProvider([[("lookup", {"account": SECRET})], "Gold."])
    async with opened(backend, tmp_path) as (stores, url):
        runner = AgentRunner.from_stores(
            provider, stores, worker="web-1", lease_policy=LeasePolicy(ttl=1, renew_within=0.5)
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "Look me up.", tenant=TENANT, run_id="look-1")
        for _ in range(200):  # the dead attempt's 1 s lease lapses
            if await stores.leases.current(TENANT, "look-1") is None:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(IndeterminateToolCallError):
            await runner.resume(agent, "look-1", tenant=TENANT)
        code, text = await cli(url, "runs", "--tenant", TENANT, "--stuck")
        assert code == 0, text
        assert "look-1" in text, text


@pytest.mark.parametrize("site", POSTGRES, indirect=True)
def test_running_workers_submit_kill_and_carry_on(site: tuple[Path, str]) -> None:
    """README "Running workers" as written, with ``my_agent.py``: ``tesserix submit``, a
    ``tesserix worker`` killed with SIGKILL in the slow read-only tool after the booking, a
    worker with ``--exit-when-idle`` right after (takes nothing: the lease is live), then one
    once the lease lapsed: the run completes with one booking. Held."""
    cwd, url = site
    assert tesserix(cwd, url, "schema", "apply").returncode == 0
    submitted = tesserix(
        cwd,
        url,
        "submit",
        "--agent",
        "my_agent:agent",
        "--tenant",
        TENANT,
        "--input",
        "book LH400",
        "--run-id",
        "order-5",
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "order-5" in submitted.stdout
    log = cwd / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tesserix_adk",
                "worker",
                "--agent",
                "my_agent:agent",
                "--lease-ttl",
                "1",
            ],
            cwd=cwd,
            env={**env_for(url), "SLOW": "60"},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_for(log, "seat map", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert len((cwd / "bookings.txt").read_text().splitlines()) == 1
    idle = tesserix(cwd, url, "worker", "--agent", "my_agent:agent", "--exit-when-idle")
    assert idle.returncode == 0, idle.stdout + idle.stderr
    wait_lease_lapsed(url, "order-5")
    carried = tesserix(cwd, url, "worker", "--agent", "my_agent:agent", "--exit-when-idle")
    assert carried.returncode == 0, carried.stdout + carried.stderr
    shown = tesserix(cwd, url, "inspect", "order-5", "--tenant", TENANT, "--json")
    assert json.loads(shown.stdout)["status"] == "completed", shown.stdout + idle.stdout
    assert len((cwd / "bookings.txt").read_text().splitlines()) == 1
