"""An attacker's look at replay for debugging (SPEC section 6, README "Replay", ``tesserix
replay``): a past step carried forward as a new run, side-effecting tools stubbed or named
live, the original run never written.

Defects found (each a strict xfail asserting the promised behaviour):

1. HIGH ``test_a_stub_given_as_none_is_refused_before_anything_runs``: ``stubs={"pay":
   None}`` passes ``check_stubs`` (the name is a key of ``stubs``), but
   ``invoking.invoke`` looks the stub up with ``.get`` and, finding ``None``, sends the
   real ``pay``: the original's payment is made a second time by a "stubbed" replay.
2. HIGH ``test_live_given_as_one_string_lets_out_no_tool_it_merely_contains``:
   ``live="repay"`` (one string, not a list) is searched with ``in``, a substring test, so
   the side-effecting ``pay`` (never named) goes out for real.
3. MEDIUM ``test_a_stub_is_called_with_the_arguments_the_tool_would_get``: the tool is
   called with its validated arguments (``amount=40``); its stub with the model's raw ones
   (``amount="40"``): not "called like the tool".
4. MEDIUM ``test_show_says_a_replay_is_a_replay``: ``tesserix show`` of a replay (text and
   ``--json``) never says it is one (``replay_of``); ``inspect`` does. An operator reading
   ``show`` sees ``pay ... dispatched`` under a run that looks like any other.
5. LOW ``test_a_from_step_given_as_text_is_a_typed_refusal``: ``from_step="1"`` is a bare
   ``TypeError: '<=' not supported between instances of 'int' and 'str'``.

What held (plain tests): every row (SQLite, PostgreSQL) and key (Redis) of the original run
is unchanged by replays from every step and by a replay of a replay; refused replays
(unstubbed tool, unknown stub, missing step, another tenant's run, a taken or the
original's id, a live tool whose arguments were masked, a tombstone step) write nothing at
all and send nothing; a stub that is an async callable object declaring ``ctx`` gets the
replay's run id and a key of its own, and ``"stub": true`` overrides a stub's own
``"stub"``; secrets in stub results (dict, key-named, wrapped text) and in the replayed
transcript are masked in storage; a replay from a step whose call was left in doubt calls
the stub and leaves the doubt (and the original's refusal) to the operator; a replay under
another tenant reads that tenant's run of the same id; ``tesserix replay`` bad step
numbers, unknown runs and bad ``--stub``/``--live`` are one sentence with the documented
exit code and write nothing; a ``tesserix replay`` (a process of its own, on Redis) of a
run another process carries inside its side-effecting call leaves that holder's lease,
fence, records and keys alone, and the holder finishes under fence 1, paying once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.errors import (
    CheckpointTooLargeError,
    IndeterminateToolCallError,
    NoCheckpointError,
    ToolOutcomeUnknownError,
)
from tesserix_adk.stores.bundle import Stores

ORIG = "orig-run-7c1"
SECRET = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"


class Shop:
    """``look`` (read-only) and ``pay`` (side-effecting), counting real payments."""

    def __init__(self, *, pay_unknown: bool = False) -> None:
        self.paid: list[tuple[str, Any]] = []
        self.pay_unknown = pay_unknown

    def agent(self) -> Agent:
        @tool(side_effects=False)
        def look(order: str) -> dict[str, Any]:
            """Read an order."""
            return {"order": order, "total": 40}

        @tool
        def pay(order: str, amount: int) -> dict[str, Any]:
            """Pay (the real thing)."""
            self.paid.append((order, amount))
            if self.pay_unknown:
                raise ToolOutcomeUnknownError("the bank hung up")
            return {"paid": amount}

        return Agent("shop", "Pay for orders.", [look, pay])


def script(amount: Any = 40) -> ScriptedProvider:
    return ScriptedProvider(
        [
            [("look", {"order": "o-1"})],
            [("pay", {"order": "o-1", "amount": amount})],
            "done",
        ]
    )


def runner(stores: Stores, provider: Any = None, **kw: Any) -> AgentRunner:
    return AgentRunner.from_stores(provider or script(), stores, worker="dbg", **kw)


async def original(stores: Stores, shop: Shop, *, tenant: str = "acme", **kw: Any) -> None:
    run = await runner(stores, **kw).run(
        shop.agent(), f"pay o-1 {SECRET}", tenant=tenant, run_id=ORIG
    )
    assert run.status is RunStatus.completed


async def pay_step(stores: Stores, tenant: str = "acme") -> int:
    """The step whose outstanding calls include ``pay``."""
    for step in await stores.checkpoints.steps(tenant, ORIG):
        cp = await runner(stores).checkpoints.at(tenant, ORIG, step)  # type: ignore[union-attr]
        if cp is not None and any(oc.call.name == "pay" for oc in cp.outstanding):
            return step
    raise AssertionError("no step holds pay")


# --- whole-store dumps ------------------------------------------------------------------


class Where:
    """Stores of one backend, with a dump of everything they hold."""

    def __init__(self, kind: str, stores: Stores, tag: str) -> None:
        self.kind, self.stores, self.tag = kind, stores, tag

    async def dump(self) -> dict[Any, Any]:
        if self.kind == "sqlite":
            with contextlib.closing(sqlite3.connect(self.tag)) as db:
                tables = [
                    t
                    for (t,) in db.execute(
                        "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"
                    )
                ]
                return {t: sorted(map(repr, db.execute(f'SELECT * FROM "{t}"'))) for t in tables}
        if self.kind == "postgres":
            import psycopg

            async with await psycopg.AsyncConnection.connect(services.POSTGRES_URL) as db:
                cur = await db.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                    (self.tag,),
                )
                out: dict[Any, Any] = {}
                for (t,) in await cur.fetchall():
                    rows = await db.execute(f'SELECT * FROM "{self.tag}"."{t}"')
                    out[t] = sorted(map(repr, await rows.fetchall()))
                return out
        client = await services.redis_client()
        try:
            out = {}
            async for key in client.scan_iter(match=f"{self.tag}*"):
                kind = (await client.type(key)).decode()
                if kind == "string":
                    value: Any = await client.get(key)
                elif kind == "hash":
                    value = sorted((await client.hgetall(key)).items())
                elif kind == "list":
                    value = await client.lrange(key, 0, -1)
                elif kind == "set":
                    value = sorted(await client.smembers(key))
                elif kind == "zset":
                    value = await client.zrange(key, 0, -1, withscores=True)
                else:
                    value = await client.xrange(key) if kind == "stream" else kind
                out[key.decode()] = value
            return out
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def where(kind: str, tmp_path: Path) -> AsyncIterator[Where]:
    if kind == "sqlite":
        path = str(tmp_path / "adk.sqlite3")
        async with open_stores(f"sqlite:///{path}") as stores:
            await stores.create_schema()
            yield Where(kind, stores, path)
    elif kind == "postgres":
        async with (
            services.postgres_schema() as schema,
            services.postgres_stores_at(services.schema_url(schema)) as stores,
        ):
            await stores.create_schema()
            yield Where(kind, stores, schema)
    else:
        from tesserix_adk.adapters.redis import open_redis_stores

        client = await services.redis_client()
        prefix = services.redis_prefix()
        stores = open_redis_stores(
            services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")
        )
        try:
            yield Where(kind, stores, prefix)
        finally:
            await stores.aclose()
            await services.delete_prefixed(client, prefix)
            await client.aclose()


def raw_files(tmp_path: Path) -> str:
    """The SQLite file and its journal, byte for byte (as text)."""
    return "".join(p.read_bytes().decode("latin-1") for p in tmp_path.glob("adk.sqlite3*"))


def only_added_under(before: dict[Any, Any], after: dict[Any, Any], new_ids: list[str]) -> None:
    """Everything in ``before`` is in ``after`` unchanged, and whatever was added names one
    of ``new_ids`` (the replays' own runs)."""
    for name, was in before.items():
        now = after.get(name)
        if isinstance(was, list) and isinstance(now, list) and name in after:
            missing = [row for row in was if row not in now]
            assert missing == [], f"{name}: rows of the original changed or gone: {missing}"
            added = [row for row in now if row not in was]
            stray = [r for r in added if not any(i in repr(r) for i in new_ids)]
            assert stray == [], f"{name}: rows added that name no replay: {stray}"
        else:
            assert now == was, f"{name} changed: {was!r} -> {now!r}"
    for name in set(after) - set(before):
        assert any(i in repr(name) + repr(after[name]) for i in new_ids), (
            f"{name} added, naming no replay"
        )


# --- the original is never written ------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgres"])
async def test_replays_from_every_step_leave_every_row_and_key_of_the_original_alone(
    kind: str, tmp_path: Path
) -> None:
    async with where(kind, tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        steps = await w.stores.checkpoints.steps("acme", ORIG)
        assert len(steps) >= 4
        before = await w.dump()
        assert ORIG in repr(before) and sum(len(v) for v in before.values()) > 5
        stubbed: list[Any] = []
        new_ids = []
        for step in steps:
            new = f"rep-{step}-9d2"
            run = await runner(w.stores).replay(
                shop.agent(),
                ORIG,
                tenant="acme",
                from_step=step,
                stubs={"pay": lambda **kw: stubbed.append(kw) or {"ok": 1}},
                new_run_id=new,
            )
            assert run.run_id == new and run.replay_of == f"{ORIG}@{step}"
            new_ids.append(new)
        # a replay of a replay leaves its parent alone too
        again = await runner(w.stores).replay(
            shop.agent(),
            new_ids[0],
            tenant="acme",
            from_step=1,
            stubs={"pay": lambda **kw: stubbed.append(kw) or {"ok": 1}},
            new_run_id="rep-of-rep-9d2",
        )
        assert again.replay_of == f"{new_ids[0]}@1"
        new_ids.append("rep-of-rep-9d2")
        only_added_under(before, await w.dump(), new_ids)
        assert shop.paid == [("o-1", 40)]
        assert stubbed, "no replay asked for pay"


class Tomb:
    """An agent whose read-only tool answers too much for a small ``max_bytes``."""

    def agent(self) -> Agent:
        @tool(side_effects=False)
        def look(order: str) -> str:
            """Read an order."""
            return "x" * 6000

        @tool
        def pay(order: str, amount: int) -> str:
            """Pay."""
            return "paid"

        return Agent("shop", "Pay.", [look, pay])


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_refused_replays_write_nothing_at_all_and_send_nothing(
    kind: str, tmp_path: Path
) -> None:
    async with where(kind, tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        await original(w.stores, shop, tenant="beta")
        step = await pay_step(w.stores)
        # A run with a tombstone: its step after the big result is too large.
        tomb = await runner(w.stores, max_bytes=4096).run(
            Tomb().agent(), "go", tenant="acme", run_id="tomb-run"
        )
        assert tomb.status is RunStatus.completed
        tomb_cps = runner(w.stores).checkpoints
        assert tomb_cps is not None
        tomb_steps = [
            s
            for s in await w.stores.checkpoints.steps("acme", "tomb-run")
            if (cp := await tomb_cps.at("acme", "tomb-run", s)) is not None and cp.is_tombstone
        ]
        assert tomb_steps, "no tombstone step written"
        masked = Shop()
        masked_run = await runner(
            w.stores,
            ScriptedProvider(
                [[("pay", {"order": f"o-{SECRET}", "amount": 1})], "done"],
            ),
        ).run(masked.agent(), "go", tenant="acme", run_id="masked-run")
        assert masked_run.status is RunStatus.completed
        before = await w.dump()
        assert "tomb-run" in repr(before) and "masked-run" in repr(before)
        paid = list(shop.paid)
        stub_calls: list[Any] = []

        def stub(**kw: Any) -> dict[str, Any]:
            stub_calls.append(kw)
            return {"ok": 1}

        cases: list[tuple[str, dict[str, Any], type[Exception]]] = [
            (ORIG, {"from_step": step, "stubs": {}}, ConfigurationError),
            (ORIG, {"from_step": step, "stubs": {"pay": stub, "nope": stub}}, ConfigurationError),
            (ORIG, {"from_step": 99, "stubs": {"pay": stub}}, NoCheckpointError),
            (ORIG, {"from_step": -1, "stubs": {"pay": stub}}, NoCheckpointError),
            (
                ORIG,
                {"from_step": step, "stubs": {"pay": stub}, "new_run_id": ORIG},
                ConfigurationError,
            ),
            ("nobody", {"from_step": 1, "stubs": {"pay": stub}}, NoCheckpointError),
            ("masked-run", {"from_step": 1, "stubs": {}, "live": ["pay"]}, ConfigurationError),
            (
                "tomb-run",
                {"from_step": tomb_steps[0], "stubs": {"pay": stub}},
                CheckpointTooLargeError,
            ),
        ]
        for run_id, kw, error in cases:
            with pytest.raises(error) as raised:
                await runner(w.stores).replay(shop.agent(), run_id, tenant="acme", **kw)
            assert str(raised.value), run_id
        # another tenant's run of that id is never read from tenant "gamma"
        with pytest.raises(NoCheckpointError):
            await runner(w.stores).replay(
                shop.agent(), ORIG, tenant="gamma", from_step=1, stubs={"pay": stub}
            )
        # a new id that a run of the tenant already holds
        with pytest.raises(ConfigurationError, match="already exists"):
            await runner(w.stores).replay(
                shop.agent(),
                ORIG,
                tenant="acme",
                from_step=step,
                stubs={"pay": stub},
                new_run_id="masked-run",
            )
        assert await w.dump() == before
        assert shop.paid == paid and masked.paid == [(f"o-{SECRET}", 1)]
        assert stub_calls == []


# --- defects: a stub or live list that lets the real tool out ---------------------------


async def test_a_stub_given_as_none_is_refused_before_anything_runs(tmp_path: Path) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        before = await w.dump()
        with contextlib.suppress(ConfigurationError):
            await runner(w.stores).replay(
                shop.agent(), ORIG, tenant="acme", from_step=1, stubs={"pay": None}
            )  # type: ignore[dict-item]
        assert shop.paid == [("o-1", 40)], f"the real pay went out again: {shop.paid}"
        assert await w.dump() == before


async def test_live_given_as_one_string_lets_out_no_tool_it_merely_contains(
    tmp_path: Path,
) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        before = await w.dump()
        with contextlib.suppress(ConfigurationError):
            await runner(w.stores).replay(
                shop.agent(), ORIG, tenant="acme", from_step=1, stubs={}, live="repay"
            )
        assert shop.paid == [("o-1", 40)], f"pay, never named live, went out: {shop.paid}"
        assert await w.dump() == before


async def test_a_stub_is_called_with_the_arguments_the_tool_would_get(tmp_path: Path) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop, provider=script(amount="40"))
        assert shop.paid == [("o-1", 40)]  # the tool got an int
        got: list[Any] = []
        run = await runner(w.stores, script(amount="40")).replay(
            shop.agent(),
            ORIG,
            tenant="acme",
            from_step=1,
            stubs={"pay": lambda order, amount: got.append(amount) or {"ok": 1}},
        )
        assert run.status is RunStatus.completed
        assert got == [40], f"the stub got {got!r}, the tool got 40"


async def test_a_from_step_given_as_text_is_a_typed_refusal(tmp_path: Path) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        with pytest.raises((ConfigurationError, NoCheckpointError)):
            await runner(w.stores).replay(
                shop.agent(),
                ORIG,
                tenant="acme",
                from_step="1",  # type: ignore[arg-type]
                stubs={"pay": lambda **kw: {}},
            )


# --- stubs are called like the tool -----------------------------------------------------


async def test_an_async_callable_stub_declaring_ctx_gets_the_replays_own_context(
    tmp_path: Path,
) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        records = await w.stores.idempotency.records("acme", ORIG)
        original_keys = {r.key for r in records}
        seen: list[ToolContext] = []

        class Stub:
            async def __call__(self, order: str, amount: int, ctx: ToolContext) -> Any:
                seen.append(ctx)
                return {"stub": False, "receipt": "R-1"}

        run = await runner(w.stores).replay(
            shop.agent(),
            ORIG,
            tenant="acme",
            from_step=await pay_step(w.stores),
            stubs={"pay": Stub()},
            new_run_id="rep-ctx",
        )
        assert run.status is RunStatus.completed
        [ctx] = seen
        assert (ctx.run_id, ctx.tenant) == ("rep-ctx", "acme")
        assert ctx.idempotency_key is not None and ctx.idempotency_key not in original_keys
        [rec] = [
            r for r in await w.stores.idempotency.records("acme", "rep-ctx") if r.tool == "pay"
        ]
        assert rec.outcome is not None
        told = json.loads(rec.outcome)
        assert '"stub": true' in json.dumps(told) and "R-1" in json.dumps(told), told
        assert '"stub": false' not in json.dumps(told), told
        assert shop.paid == [("o-1", 40)]


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_secrets_in_stub_results_and_the_replayed_transcript_are_masked_in_storage(
    kind: str, tmp_path: Path
) -> None:
    async with where(kind, tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop)
        for n, stub in enumerate(
            [
                lambda **kw: {"receipt": f"card {SECRET}", "password": "hunter2-plain"},
                lambda **kw: f"token {SECRET}",
            ]
        ):
            run = await runner(w.stores).replay(
                shop.agent(),
                ORIG,
                tenant="acme",
                from_step=await pay_step(w.stores),
                stubs={"pay": stub},
                new_run_id=f"rep-secret-{n}",
            )
            assert run.status is RunStatus.completed
        dumped = repr(await w.dump())
        if kind == "sqlite":
            dumped += raw_files(tmp_path)
        assert SECRET not in dumped and SECRET[4:] not in dumped
        assert "hunter2-plain" not in dumped
        assert "rep-secret-1" in dumped and "[redacted" in dumped


async def test_a_replay_from_a_step_whose_call_is_in_doubt_leaves_the_doubt_alone(
    tmp_path: Path,
) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop(pay_unknown=True)
        stopped = None
        try:
            await runner(w.stores).run(shop.agent(), "pay o-1", tenant="acme", run_id=ORIG)
        except ToolOutcomeUnknownError as exc:
            stopped = exc
        assert stopped is not None and shop.paid == [("o-1", 40)]
        with pytest.raises(IndeterminateToolCallError):
            await runner(w.stores).resume(shop.agent(), ORIG, tenant="acme")
        before = await w.dump()
        got: list[Any] = []
        run = await runner(w.stores).replay(
            shop.agent(),
            ORIG,
            tenant="acme",
            from_step=await pay_step(w.stores),
            stubs={"pay": lambda **kw: got.append(kw) or {"ok": 1}},
            new_run_id="rep-doubt",
        )
        assert run.status is RunStatus.completed and run.replay_of is not None
        assert got == [{"order": "o-1", "amount": 40}]
        only_added_under(before, await w.dump(), ["rep-doubt"])
        with pytest.raises(IndeterminateToolCallError):
            await runner(w.stores).resume(shop.agent(), ORIG, tenant="acme")
        assert shop.paid == [("o-1", 40)]


async def test_a_replay_under_another_tenant_reads_that_tenants_run_of_the_same_id(
    tmp_path: Path,
) -> None:
    async with where("sqlite", tmp_path) as w:
        shop = Shop()
        await original(w.stores, shop, tenant="acme")
        beta = ScriptedProvider(
            [[("look", {"order": "b-9"})], [("pay", {"order": "b-9", "amount": 7})], "done"]
        )
        await runner(w.stores, beta).run(shop.agent(), "beta's", tenant="beta", run_id=ORIG)
        got: list[Any] = []
        run = await runner(w.stores, beta).replay(
            shop.agent(),
            ORIG,
            tenant="beta",
            from_step=await pay_step(w.stores, "beta"),
            stubs={"pay": lambda **kw: got.append(kw) or {"ok": 1}},
            new_run_id="rep-beta",
        )
        assert run.status is RunStatus.completed
        assert got == [{"order": "b-9", "amount": 7}]
        assert await w.stores.checkpoints.latest("acme", "rep-beta") is None


# --- the command line -------------------------------------------------------------------

AGENT_FILE = '''
from tesserix_adk import Agent, ScriptedProvider, tool


@tool(side_effects=False)
def look(order: str) -> str:
    """Read an order."""
    return "ok"


@tool
def pay(order: str, amount: int) -> dict:
    """Pay (the real thing)."""
    with open("paid.txt", "a") as f:
        f.write(order + "\\n")
    return {"paid": amount}


def fake_pay(order, amount):
    return {"receipt": "R-1"}


NOT_CALLABLE = 3
agent = Agent("shop", "Pay.", [look, pay])
PROVIDER = ScriptedProvider(
    [[("look", {"order": "o-1"})], [("pay", {"order": "o-1", "amount": 40})], "done"]
)
'''

START = f"""
import asyncio
from tesserix_adk import AgentRunner, open_stores
from shopagent import agent, PROVIDER


async def main():
    async with open_stores("sqlite:///s.sqlite3") as stores:
        await stores.create_schema()
        r = AgentRunner.from_stores(PROVIDER, stores, worker="w")
        await r.run(agent, "go", tenant="acme", run_id="{ORIG}")


asyncio.run(main())
"""


def tesserix(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("tesserix")
    env = {k: v for k, v in os.environ.items() if k != "ADK_DEBUG"}
    return subprocess.run(
        [str(exe), "--store", "sqlite:///s.sqlite3", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def cli_dir(tmp_path: Path) -> Path:
    (tmp_path / "shopagent.py").write_text(AGENT_FILE)
    (tmp_path / "start.py").write_text(START)
    subprocess.run([sys.executable, "start.py"], cwd=tmp_path, check=True, timeout=60)
    assert (tmp_path / "paid.txt").read_text() == "o-1\n"
    return tmp_path


def _dump_file(path: Path) -> dict[str, list[str]]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: sorted(map(repr, db.execute(f'SELECT * FROM "{t}"'))) for t in tables}


def test_cli_replay_bad_steps_runs_stubs_and_live_are_one_sentence_and_write_nothing(
    cli_dir: Path,
) -> None:
    replay = ("replay", ORIG, "--tenant", "acme", "--agent", "shopagent:agent")
    stub = ("--stub", "pay=shopagent:fake_pay")
    before = _dump_file(cli_dir / "s.sqlite3")
    cases = [
        ((*replay, "--from-step", "-1", *stub), 1),
        ((*replay, "--from-step", "0", *stub), 1),
        (
            (
                "replay",
                "nobody",
                "--tenant",
                "acme",
                "--agent",
                "shopagent:agent",
                "--from-step",
                "1",
                *stub,
            ),
            1,
        ),
        ((*replay, "--from-step", "1", "--stub", "pay=shopagent:nothere"), 2),
        ((*replay, "--from-step", "1", "--stub", "pay=shopagent:NOT_CALLABLE"), 2),
        ((*replay, "--from-step", "1", "--stub", "nosuch=shopagent:fake_pay"), 2),
        ((*replay, "--from-step", "1", "--live", "look"), 2),
    ]
    for argv, code in cases:
        done = tesserix(cli_dir, *argv)
        err = done.stderr.strip()
        assert done.returncode == code, (argv, done.returncode, err)
        assert err.startswith("tesserix: ") and "\n" not in err, (argv, err)
        assert "Traceback" not in err
    assert _dump_file(cli_dir / "s.sqlite3") == before
    assert (cli_dir / "paid.txt").read_text() == "o-1\n"


def test_show_says_a_replay_is_a_replay(cli_dir: Path) -> None:
    done = tesserix(
        cli_dir,
        *("replay", ORIG, "--tenant", "acme", "--agent", "shopagent:agent"),
        *("--from-step", "3", "--stub", "pay=shopagent:fake_pay", "--new-run-id", "rep-show"),
    )
    assert done.returncode == 0, done.stderr
    inspected = tesserix(cli_dir, "inspect", "rep-show", "--tenant", "acme")
    assert f"replay of {ORIG}@3" in inspected.stdout
    shown = tesserix(cli_dir, "show", "rep-show", "--tenant", "acme")
    shown_json = tesserix(cli_dir, "show", "rep-show", "--tenant", "acme", "--json")
    assert shown.returncode == 0 and shown_json.returncode == 0
    assert f"{ORIG}@3" in shown.stdout, shown.stdout
    assert f'"replay_of": "{ORIG}@3"' in shown_json.stdout
    assert (cli_dir / "paid.txt").read_text() == "o-1\n"


HOLDER = f"""
import asyncio, os, sys, time
from tesserix_adk import AgentRunner, LeasePolicy, open_stores, tool
from tesserix_adk import Agent, ScriptedProvider
import shopagent


@tool
def pay(order: str, amount: int) -> dict:
    \"\"\"Pay (the real thing), once the test says go.\"\"\"
    open("inside", "w").close()
    while not os.path.exists("go"):
        time.sleep(0.05)
    with open("paid.txt", "a") as f:
        f.write(order + "\\n")
    return {{"paid": amount}}


agent = Agent("shop", "Pay.", [shopagent.look, pay])


async def main():
    async with open_stores(sys.argv[1]) as stores:
        await stores.create_schema()
        r = AgentRunner.from_stores(
            shopagent.PROVIDER, stores, worker="holder",
            lease_policy=LeasePolicy(ttl=3, renew_within=1),
        )
        run = await r.run(agent, "go", tenant="acme", run_id="{ORIG}")
        print(run.status, run.fence, flush=True)


asyncio.run(main())
"""


async def test_a_cli_replay_while_another_process_carries_the_run_on_redis_leaves_it_alone(
    tmp_path: Path,
) -> None:
    (tmp_path / "shopagent.py").write_text(AGENT_FILE)
    (tmp_path / "holder.py").write_text(HOLDER)
    prefix = services.redis_prefix()
    url = services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")
    client = await services.redis_client()
    holder = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "holder.py", url],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if (tmp_path / "inside").exists() or holder.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert (tmp_path / "inside").exists(), holder.communicate(timeout=5)
        from tesserix_adk.adapters.redis import open_redis_stores

        stores = open_redis_stores(url)
        try:
            lease = await stores.leases.current("acme", ORIG)
            records = await stores.idempotency.records("acme", ORIG)
            assert lease is not None and lease.fence == 1
            w = Where("redis", stores, prefix)
            before = await w.dump()
            done = await asyncio.to_thread(
                subprocess.run,
                [
                    str(Path(sys.executable).with_name("tesserix")),
                    *("--store", url, "replay", ORIG, "--tenant", "acme"),
                    *("--agent", "shopagent:agent", "--from-step", "3"),
                    *("--stub", "pay=shopagent:fake_pay", "--new-run-id", "rep-live"),
                ],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            assert f"replay of {ORIG}@3" in done.stdout
            now = await stores.leases.current("acme", ORIG)
            assert now is not None
            assert (now.holder, now.fence) == (lease.holder, lease.fence)
            assert await stores.idempotency.records("acme", ORIG) == records
            after = await w.dump()
            # the holder renews its lease meanwhile: its expiry may move, nothing else
            moved = {k for k in before if before[k] != after.get(k) and "lease" in k}
            only_added_under(
                {k: v for k, v in before.items() if k not in moved},
                {k: v for k, v in after.items() if k not in moved},
                ["rep-live"],
            )
        finally:
            await stores.aclose()
        (tmp_path / "go").touch()
        out, err = await asyncio.to_thread(holder.communicate, timeout=60)
        assert holder.returncode == 0, err
        assert out.split() == ["completed", "1"], (out, err)
        assert (tmp_path / "paid.txt").read_text() == "o-1\n"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        await services.delete_prefixed(client, prefix)
        await client.aclose()
