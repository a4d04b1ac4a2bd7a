"""The stateful attack of ``test_attacks_stateful_operators.py`` (workers, deaths at chosen
points, operators through the real CLI in process, the clock past the lease ttl) on Redis
and PostgreSQL instead of a SQLite file, and widened: a run's turn may ask for two bookings
at once, or a booking beside a payment, carried by ``Agent(parallel_tool_calls=2)``; on
PostgreSQL the runner groups its writes (``group_writes=True``); and two workers, each on
stores of its own (two processes, as far as the server can tell), poll the same store at
once.

The rig (the world, its tools, the model, the operators' rules, the invariants and the
drain) is the SQLite machine's, imported; only the site (a Redis key prefix or a PostgreSQL
schema of each example's own, removed after), the model (a turn of several calls) and the
new rules are here. Call ids stay ``c<n>``, numbered over the whole plan, so the imported
rules map a call to its business key as before.

Invariants after every step, as there: a business key's side effect at most once; a denied
payment never made; an unfinished run is due for a worker, listed ``--stuck`` or waiting on
a pending approval; refusals typed. The drain ends every run finished, cancelled, failed or
waiting on a person.

Examples: ``STATEFUL_BACKENDS_EXAMPLES`` (default 3 per backend) and
``STATEFUL_BACKENDS_STEPS`` (default 8), so CI stays under a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from adapters.services import POSTGRES_URL, REDIS_URL, unavailable, with_query
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    Worker,
    open_stores,
)
from tesserix_adk.messages import Message, Role
from test_attacks_stateful_operators import (
    FAST,
    FAULTS,
    TTL,
    Died,
    OperatorsAndWorkers,
    PlanModel,
    Site,
    World,
    _agent,
    _say,
    cli,
)

T = "acme"
# A short profile in CI; ADK_SLOW=1 (or STATEFUL_BACKENDS_EXAMPLES=N) looks further.
EXAMPLES = int(
    os.environ.get("STATEFUL_BACKENDS_EXAMPLES", "3" if os.environ.get("ADK_SLOW") == "1" else "2")
)
STEPS = int(os.environ.get("STATEFUL_BACKENDS_STEPS", "8"))
# Deaths two workers may meet (a hung tool needs the one-worker rig's drain or cancel).
TWO_WORKER_FAULTS = ("none", "died_before", "died_after", "unknown_after", "error_after")


class TurnsModel(PlanModel):
    """``PlanModel`` whose plan has one word per turn, its calls joined by ``+``
    (``book:k1+book:k2 pay:p-r0``: two bookings at once, then a payment); call ids count
    over the whole plan (``c0 c1``, then ``c2``)."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if self.world.fault == "model_died" and any(m.role is Role.tool for m in request.messages):
            self.world.fault = "none"
            raise Died("died asking the model")
        user = next(m for m in request.messages if m.role is Role.user)
        turns = [word.split("+") for word in str(user.content).split()]
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked >= len(turns):
            return _say("done")
        first = sum(len(turn) for turn in turns[:asked])
        calls = []
        for j, step in enumerate(turns[asked]):
            name, key = step.split(":", 1)
            calls.append(ToolCall(id=f"c{first + j}", name=name, arguments={"key": key}))
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=calls))


# --- a site on a server ------------------------------------------------------------------


def _reachable(backend: str) -> None:
    """Skip (fail under CI=true) when the backend's server cannot be reached."""
    if backend == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            unavailable(f"Redis at {REDIS_URL} cannot be reached: {exc}")
        finally:
            client.close()
    else:
        import psycopg

        try:
            psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
        except psycopg.OperationalError as exc:
            unavailable(f"PostgreSQL at {POSTGRES_URL} cannot be reached: {exc}")


class ServerSite(Site):
    """``Site`` on Redis (a key prefix of its own, its keys deleted after) or PostgreSQL (a
    schema of its own, dropped after); the agent carries ``parallel`` calls at once and the
    runner groups its writes if asked. ``other`` is a second bundle of stores on the same
    server, for a second worker (another process, as the server sees it)."""

    def __init__(self, backend: str, *, parallel: int = 2, group_writes: bool = False) -> None:
        self.backend = backend
        self.group_writes = group_writes
        self.loop = asyncio.new_event_loop()
        self.world = World()
        base = _agent(self.world)
        self.agent = Agent(
            base.name, base.instructions, base.tools.values(), parallel_tool_calls=parallel
        )
        self.name = f"adktest_{secrets.token_hex(6)}"
        if backend == "redis":
            self.url = with_query(REDIS_URL, prefix=f"{self.name}:", allow_volatile="true")
        else:
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as admin:
                admin.execute(f'CREATE SCHEMA "{self.name}"')
            self.url = with_query(POSTGRES_URL, schema=self.name)
        self.other: Any = None
        self.stores = self.wait(self._open())

    def runner(self, stores: Any = None) -> AgentRunner:
        return AgentRunner.from_stores(
            TurnsModel(self.world),
            self.stores if stores is None else stores,
            lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
            resume_claim_ttl=TTL,
            never_ran_margin=0.05,
            group_writes=self.group_writes,
        )

    async def two_workers(self, fault: str) -> list[list[Any]]:
        """Two workers until idle, side by side, one on each bundle of stores; the next tool
        call (whichever worker makes it) meets ``fault``. A worker that died (``Died`` out
        of it) is a process gone: its leases lapse with the ttl."""
        if self.other is None:
            self.other = open_stores(self.url)
            await self.other.__aenter__()
        self.world.fault = fault
        workers = [self.worker(), self._worker_on(self.other)]
        got = await asyncio.gather(*(w.run() for w in workers), return_exceptions=True)
        self.world.fault = "none"
        for outcome in got:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Died):
                raise outcome
        return [[how for _, how in w.carried] for w in workers]

    def _worker_on(self, stores: Any) -> Worker:
        return Worker(
            self.runner(stores),
            [self.agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=FAST,
            drain_timeout=0.05,
        )

    def close(self) -> None:
        try:
            for stores in (self.other, self.stores):
                if stores is not None:
                    with contextlib.suppress(Exception):
                        self.wait(stores.__aexit__(None, None, None))
            self.loop.close()
        finally:
            self._remove()

    def _remove(self) -> None:
        if self.backend == "redis":
            import redis

            client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
            try:
                keys = list(client.scan_iter(match=f"{self.name}:*", count=1000))
                for start in range(0, len(keys), 500):
                    client.delete(*keys[start : start + 500])
            finally:
                client.close()
        else:
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as admin:
                admin.execute(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')


# --- the machine -------------------------------------------------------------------------


class OnAServer(OperatorsAndWorkers):
    """The SQLite machine with its site on a server, turns of two calls, and two workers."""

    backend = "redis"
    group_writes = False

    def __init__(self) -> None:
        super().__init__()
        self.site.close()  # the SQLite site the parent opened
        self.site = ServerSite(self.backend, group_writes=self.group_writes)

    @precondition(lambda self: len(self.run_ids) < 4)
    @rule(
        book=st.sampled_from((None, "k1", "k2", "k1+k2", "k2+k3")),
        pay=st.booleans(),
        where=st.sampled_from(("first", "last", "beside")),
    )
    def submit(self, book: str | None, pay: bool, where: str) -> None:  # type: ignore[override]
        """A run's plan: bookings (two at once with ``+``) and a payment before them, after
        them or in the same turn (approval first: nothing of that turn goes out before)."""
        run_id = f"r{len(self.run_ids)}"
        turns = [[f"book:{k}" for k in book.split("+")]] if book else []
        if pay or not turns:
            payment = f"pay:p-{run_id}"
            if where == "beside" and turns:
                turns[0].append(payment)
            else:
                turns.insert(0 if where == "first" else len(turns), [payment])
        text = " ".join("+".join(turn) for turn in turns)
        self.site.wait(self.site.runner().submit(self.site.agent, text, tenant=T, run_id=run_id))
        self.run_ids.append(run_id)
        self.plans[run_id] = [step for turn in turns for step in turn]
        event(f"submit {text.replace(run_id, 'rN')}")

    @precondition(lambda self: self.run_ids)
    @rule(fault=st.sampled_from(TWO_WORKER_FAULTS))
    def two_workers_poll_at_once(self, fault: str) -> None:
        carried = self.site.wait(self.site.two_workers(fault), timeout=60)
        both = Counter(str(how) for worker in carried for how in worker)
        event(f"two workers {fault}: {sorted(both)}")


def _settings() -> settings:
    return settings(
        max_examples=EXAMPLES,
        phases=[Phase.explicit, Phase.reuse, Phase.generate]
        + ([] if os.environ.get("STATEFUL_OPS_NO_SHRINK") else [Phase.shrink]),
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


class OnRedis(OnAServer):
    backend = "redis"


class OnPostgresGrouped(OnAServer):
    backend = "postgres"
    group_writes = True


OnRedis.TestCase.settings = _settings()
OnPostgresGrouped.TestCase.settings = _settings()
TestOnRedis = pytest.mark.redis(OnRedis.TestCase)
TestOnPostgresGrouped = pytest.mark.postgres(OnPostgresGrouped.TestCase)


@pytest.fixture(autouse=True)
def _server_reachable(request: pytest.FixtureRequest) -> Iterator[None]:
    for backend in ("redis", "postgres"):
        if request.node.get_closest_marker(backend) is not None:
            _reachable(backend)
    yield


# --- the rig itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_a_turn_of_two_bookings_books_each_once_and_the_site_is_removed(backend: str) -> None:
    site = ServerSite(backend, group_writes=backend == "postgres")
    try:
        runner = site.runner()
        site.wait(runner.submit(site.agent, "book:k1+book:k2", tenant=T, run_id="a"))
        site.wait(site.work("none"))
        shown = site.inspect("a")
        assert shown is not None and shown["status"] == "completed", shown
        assert site.world.effects == Counter({"book-k1": 1, "book-k2": 1})
        code, _out, err = cli(site.url, "runs", "--tenant", T, "--stuck")
        assert code == 0, err
    finally:
        site.close()
    assert _left(site) == 0


def _left(site: ServerSite) -> int:
    """What of the site is still on its server (keys under its prefix, or its schema)."""
    if site.backend == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        try:
            return len(list(client.scan_iter(match=f"{site.name}:*")))
        finally:
            client.close()
    import psycopg

    with psycopg.connect(POSTGRES_URL) as admin:
        row = admin.execute(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = %s",
            (site.name,),
        ).fetchone()
    return 0 if row is None else int(row[0])


assert "hang_after" in FAULTS  # the one-worker rule still meets every fault of the rig
