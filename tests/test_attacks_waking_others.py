"""Attacks on two changes: ``tesserix resolve`` waking the other parked runs whose frontier
waits on the resolved call's business key (``cli.waking.wake_waiting_on``), and the work
index's one-run read ``WorkIndex.entry`` (used by the worker's too-many park,
``cli.reasons.parked_item``, ``cli.waking.wake`` and ``run.unstarted.unstarted_runs``).

Real ``Worker``s and the real ``tesserix`` CLI (in process) over a SQLite file, the test
Redis (a key prefix of its own) and PostgreSQL (a schema of its own), with the booking
world of ``tests/test_attacks_stateful_operators.py``: run ``a`` books business key ``k1``
and its process dies inside the call, run ``b`` books ``k1`` too and is parked on ``a``'s
claim.

Defects, found as strict xfails and fixed (markers removed):
- a damaged work index entry of an unrelated parked run of the tenant made a resolve exit 4
  after it recorded the call (no ``--json`` document). The resolve now succeeds and says
  what kept it from looking (``also_woken_trouble``); no run is woken past the damage (a
  run parked on the claim is carried on by hand: ``tesserix run --resume``).
- a run parked for too many attempts whose frontier lists the key was woken by another
  run's resolve, its count started again at 0: only runs parked in doubt are woken now.
- ``inspect``/``show`` of a run whose own entry is damaged exited 4 though its frontier
  reads (``parked_item`` through ``WorkIndex.entry``): the run now shows as not parked.

Held: ``also_woken``/"woken too" name exactly the runs parked on the key (another tenant, another
key, a run its workflow carries are left; ids escaped in the CLI and in the console), the
console's resolve button wakes them, ``--never-ran`` then both runs carried (together, or the
woken one first by hand) books once, two operators at once record one resolution, a run
another holder has is not due, a cancelled run parked on the claim ends cancelled without
booking, 200 runs parked in doubt on the key are all woken, another parked run's frontier the store
cannot read (Redis WRONGTYPE) is passed over; ``WorkIndex.entry`` of odd ids, of done runs,
of Redis hashes with fields gone or of another type; inspect/show of runs cancelled before
start, waiting, and finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from processes import BACKENDS
from processes import store_url as backend_url
from tesserix_adk import (
    AgentRunner,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    Worker,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Carrier, encode_checkpoint
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.waking import wake_waiting_on
from tesserix_adk.messages import Message, Role
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.stores.urls import open_stores
from test_attacks_stateful_operators import FAST, TTL, Died, PlanModel, World, _agent, cli

T = "acme"
KEY = f"{T}/book-k1"  # the idempotency key of business key k1 in tenant T
DAMAGEABLE = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


class Rig:
    """A store, the booking world and its agent, workers and the CLI on them."""

    def __init__(self, backend: str, url: str, stores: Any) -> None:
        self.backend = backend
        self.url = url
        self.stores = stores
        self.world = World()
        self.agent = _agent(self.world)

    def runner(self, model: Any = None) -> AgentRunner:
        return AgentRunner.from_stores(
            model or PlanModel(self.world),
            self.stores,
            lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
            resume_claim_ttl=TTL,
            never_ran_margin=0.05,
        )

    async def submit(self, run_id: str, plan: str, tenant: str = T) -> None:
        await self.runner().submit(self.agent, plan, tenant=tenant, run_id=run_id)

    async def work(self, fault: str = "none", model: Any = None, **kw: Any) -> list[str]:
        """A worker until idle; the next tool call meets ``fault`` (a death is a process
        killed: the worker's task ends with it and nothing is given back)."""
        self.world.fault = fault
        worker = Worker(
            self.runner(model),
            [self.agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=FAST,
            drain_timeout=0.05,
            **kw,
        )
        with suppress(Died):
            await asyncio.wait_for(worker.run(), 30)
        self.world.fault = "none"
        return [str(how) for _, how in worker.carried]

    async def cli(self, *argv: str) -> tuple[int, str, str]:
        return await asyncio.to_thread(cli, self.url, *argv)

    async def resolve(self, run_id: str, *how: str, json_out: bool = True) -> Any:
        argv = ["resolve", run_id, "--tenant", T, "--call", "c0", *how, "--by", "ops"]
        code, out, err = await self.cli(*argv, *(["--json"] if json_out else []))
        return code, (json.loads(out) if json_out and code == 0 else out), err

    async def state(self, run_id: str, tenant: str = T) -> WorkState | None:
        item = await self.stores.work.entry(tenant, run_id)
        return None if item is None else item.state

    async def frontier(self, run_id: str, tenant: str = T) -> Any:
        return await Checkpointer.from_stores(self.stores).latest(tenant, run_id)

    async def status(self, run_id: str) -> str:
        code, out, err = await self.cli("inspect", run_id, "--tenant", T, "--json")
        assert code == 0, err
        return str(json.loads(out)["status"])


_TESSERIX = Path(sys.executable).with_name("tesserix")


async def proc(url: str, *argv: str) -> tuple[int, str, str]:
    """The ``tesserix`` entry point as a process of its own."""
    child = await asyncio.create_subprocess_exec(
        str(_TESSERIX),
        *argv,
        "--store",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode is not None
    return child.returncode, out.decode(), err.decode()


@asynccontextmanager
async def rig(backend: str, tmp: Path) -> AsyncIterator[Rig]:
    async with backend_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield Rig(backend, url, stores)


async def parked_on_a(r: Rig, fault: str = "died_after", b_plan: str = "book:k1") -> None:
    """``a`` dies inside its booking of k1 (``fault``), its lease lapses; ``b`` (``b_plan``)
    is parked on ``a``'s claim, ``a`` in doubt."""
    await r.submit("a", "book:k1")
    assert await r.work(fault) == ["parked"] or fault != "none"
    await r.submit("b", b_plan)
    await asyncio.sleep(TTL + 0.2)
    await r.work()
    assert await r.state("a") is WorkState.parked
    assert await r.state("b") is WorkState.parked
    cp = await r.frontier("b")
    assert cp is not None and KEY in {oc.key for oc in cp.outstanding}


# --- what held: the run parked on the claim is woken, carried once, and named -------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_resolve_json_names_the_run_parked_on_its_claim_and_both_finish_once(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        code, said, err = await r.resolve("a", "--outcome", '{"booked": "BK-1"}')
        assert code == 0, err
        assert said["woken"] is True and said["also_woken"] == ["b"], said
        assert await r.state("b") is WorkState.wanted
        await asyncio.sleep(TTL + 0.2)
        await r.work()
        assert (await r.status("a"), await r.status("b")) == ("completed", "completed")
        assert r.world.effects == Counter({"book-k1": 1})


@pytest.mark.parametrize("backend", BACKENDS)
async def test_resolve_never_ran_then_both_runs_carried_send_the_booking_exactly_once(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r, fault="died_before")
        assert r.world.effects == Counter()
        code, said, err = await r.resolve("a", "--never-ran", "--margin", "0")
        assert code == 0, err
        assert said["also_woken"] == ["b"], said
        for _ in range(4):  # both wanted at once; one waits while the other sends it
            await asyncio.sleep(TTL + 0.2)
            await r.work(concurrency=2)
        assert (await r.status("a"), await r.status("b")) == ("completed", "completed")
        assert r.world.effects == Counter({"book-k1": 1})


async def test_text_output_names_the_woken_run_with_its_control_characters_escaped(
    tmp_path: Path,
) -> None:
    async with rig("sqlite", tmp_path) as r:
        await r.submit("a", "book:k1")
        await r.work("died_after")
        evil = "b\x1b[2J\nrecorded: forged"
        await r.submit(evil, "book:k1")
        await asyncio.sleep(TTL + 0.2)
        await r.work()
        assert await r.state(evil) is WorkState.parked
        code, out, err = await r.resolve("a", "--outcome", "{}", json_out=False)
        assert code == 0, err
        lines = out.splitlines()
        said = "woken too, parked on this call under the same key: b\\x1b[2J\\nrecorded: forged"
        assert lines[-1] == said, lines
        assert "\x1b" not in out and sum(ln.startswith("recorded:") for ln in lines) == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_run_waiting_on_the_key_among_several_calls_is_woken(
    backend: str, tmp_path: Path
) -> None:
    class TwoAtOnce:
        """Asks for two bookings in one turn (k2, then k1), then answers."""

        async def complete(self, request: ModelRequest) -> ModelResponse:
            if any(m.role is Role.tool for m in request.messages):
                return ModelResponse(message=Message(role=Role.assistant, content="done"))
            calls = [
                ToolCall(id=f"c{n}", name="book", arguments={"key": k})
                for n, k in enumerate(("k2", "k1"))
            ]
            return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=calls))

    async with rig(backend, tmp_path) as r:
        await r.submit("a", "book:k1")
        await r.work("died_after")
        await r.submit("b", "two")
        await asyncio.sleep(TTL + 0.2)
        await r.work(model=TwoAtOnce())
        cp = await r.frontier("b")
        assert cp is not None and KEY in {oc.key for oc in cp.outstanding}
        assert len(cp.outstanding) >= 1 and await r.state("b") is WorkState.parked
        code, said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 0, err
        assert said["also_woken"] == ["b"], said


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_parked_run_of_another_tenant_or_key_is_not_woken(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        # Another tenant whose name starts with T, the same business key; and a run of T
        # parked on another key.
        other = f"{T}x"
        for tenant, run_id, plan in ((other, "b", "book:k1"), (T, "c", "book:k2")):
            await r.submit(run_id, plan, tenant=tenant)
            await r.work("died_after")  # it dies in its booking: it is parked in doubt
            await asyncio.sleep(TTL + 0.2)
            await r.work()
        assert await r.state("b", other) is WorkState.parked
        assert await r.state("c") is WorkState.parked
        code, said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 0, err
        assert said["also_woken"] == ["b"], said
        assert await r.state("b", other) is WorkState.parked
        assert await r.state("c") is WorkState.parked


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_run_its_workflow_carries_is_not_woken(backend: str, tmp_path: Path) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        cp = await r.frontier("b")
        carried = dataclasses.replace(cp, carried_by=Carrier.temporal, step=cp.step + 1)
        await r.stores.checkpoints.put(
            T, "b", encode_checkpoint(carried, Redactor()), step=cp.step + 1, fence=cp.fence
        )
        code, said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 0, err
        assert said["also_woken"] == [], said
        assert await r.state("b") is WorkState.parked


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_cancelled_run_parked_on_the_claim_ends_cancelled_without_booking(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r, fault="died_before")
        code, out, err = await r.cli("cancel", "b", "--tenant", T, "--by", "ops", "--json")
        assert code == 0, err
        code, _said, err = await r.resolve("a", "--never-ran", "--margin", "0")
        assert code == 0, err
        for _ in range(3):
            await asyncio.sleep(TTL + 0.2)
            await r.work()
        assert await r.status("b") == "cancelled"
        assert (await r.status("a"), r.world.effects) == ("completed", Counter({"book-k1": 1}))
        code, out, err = await r.cli("runs", "--tenant", T, "--stuck", "--json")
        assert code == 0 and json.loads(out)["runs"] == [], out


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_run_another_operator_is_resuming_is_left_to_that_operator(
    backend: str, tmp_path: Path
) -> None:
    """The wake-up of a run whose lease another holder has makes no worker take it then."""
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        lease = await r.stores.leases.acquire(T, "b", "operator-bob", 30.0)
        try:
            code, _said, err = await r.resolve("a", "--outcome", "{}")
            assert code == 0, err
            due = {i.run_id for i in await r.stores.work.due(limit=10)}
            assert "b" not in due, due
        finally:
            await r.stores.leases.release(lease)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_two_operators_resolving_at_once_record_one_and_wake_the_other_run(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r, fault="died_before")
        argv = ("resolve", "a", "--tenant", T, "--call", "c0", "--json")
        got = await asyncio.gather(  # two processes: stdout is one per process
            proc(r.url, *argv, "--outcome", '{"by": "alice"}', "--by", "alice"),
            proc(r.url, *argv, "--never-ran", "--margin", "0", "--by", "bob"),
        )
        codes = sorted(c for c, _, _ in got)
        assert codes[0] == 0 and codes[1] in (3, 4), got
        ok = json.loads(next(out for c, out, _ in got if c == 0))
        assert ok["also_woken"] == ["b"], ok
        for _ in range(3):
            await asyncio.sleep(TTL + 0.2)
            await r.work()
        assert (await r.status("a"), await r.status("b")) == ("completed", "completed")
        assert sum(r.world.effects.values()) <= 1


async def test_the_console_resolve_button_wakes_the_run_parked_on_the_claim(
    tmp_path: Path,
) -> None:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    base = "http://127.0.0.1:8765"
    async with rig("sqlite", tmp_path) as r:
        await parked_on_a(r)

        def press() -> tuple[int, str]:
            with TestClient(create_app(r.url), base_url=base) as client:
                client.get(f"/t/{T}/runs/a")
                done = client.post(
                    f"/t/{T}/runs/a/resolve",
                    data={
                        "csrf": client.cookies.get("tesserix_csrf"),
                        "call": "c0",
                        "by": "ops",
                        "what": "outcome",
                        "outcome": "{}",
                    },
                    headers={"origin": base},
                    follow_redirects=True,
                )
                return done.status_code, done.text

        status, text = await asyncio.to_thread(press)
        assert status == 200 and "recorded" in text, text[-2000:]
        assert await r.state("b") is WorkState.wanted
        await asyncio.sleep(TTL + 0.2)
        await r.work()
        assert await r.status("b") == "completed" and r.world.effects["book-k1"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_many_parked_runs_waiting_on_the_key_are_all_woken(
    backend: str, tmp_path: Path
) -> None:
    """Two hundred runs parked in doubt on the key: the resolve reads each one's frontier
    and wakes every one (timing is ``benchmarks/``' business, never a test's)."""
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        cp = await r.frontier("b")
        for n in range(200):
            run_id = f"p{n}"
            moved = dataclasses.replace(cp, run_id=run_id)
            await r.stores.checkpoints.put(
                T, run_id, encode_checkpoint(moved, Redactor()), step=cp.step, fence=None
            )
            # As a worker parks a run in doubt: the error's type, then the error.
            reason = "IndeterminateToolCallError: claimed in flight by run 'a'"
            await r.stores.work.park(T, run_id, agent="booker", reason=reason)
        woken, trouble = await wake_waiting_on(r.stores, T, KEY, but="a")
        assert sorted(woken) == sorted(["b", *(f"p{n}" for n in range(200))])
        assert trouble is None


# --- damage: one run's entry or frontier, met by a resolve of another run ------------------


async def damage_entry(r: Rig, run_id: str) -> None:
    """Damage the run's work index entry as a hand edit would: SQLite, a count that is not
    a number; Redis, a hash whose ``agent`` field is gone."""
    if r.backend == "sqlite":
        sql = "UPDATE adk_work SET attempts = 'many' WHERE tenant = ? AND run_id = ?"
        await r.stores.work.database.write(lambda conn: conn.execute(sql, (T, run_id)))
    else:
        work = r.stores.work
        await work._client.hdel(work._entry(T, run_id), "agent")


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_a_damaged_entry_of_an_unrelated_parked_run_does_not_fail_a_recorded_resolve(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        await r.submit("z", "book:k9")
        await r.stores.work.park(T, "z", agent="booker", reason="an operator parked it")
        await damage_entry(r, "z")
        code, said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 0, (code, err)
        assert said["woken"] is True, said
        # The parked runs cannot be listed past the damage: none is woken, and the
        # resolve says why; b is carried on by hand (``tesserix run --resume``).
        assert said["also_woken"] == [], said
        assert "cannot be read" in said["also_woken_trouble"], said
        assert await r.state("b") is WorkState.parked


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_a_resolve_failing_on_damage_elsewhere_still_recorded_its_call(
    backend: str, tmp_path: Path
) -> None:
    """What the operator meets today after the failure above: a second try is refused as
    settled (exit 4), so the record holds and nothing is sent twice."""
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        await r.submit("z", "book:k9")
        await r.stores.work.park(T, "z", agent="booker", reason="an operator parked it")
        await damage_entry(r, "z")
        await r.resolve("a", "--outcome", "{}")
        code, _said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 4 and "not in flight" in err, (code, err)
        record = (await r.stores.idempotency.lookup([KEY], tenant=T))[KEY]
        assert str(record.status) != "in_flight"


@pytest.mark.redis
async def test_a_frontier_of_another_parked_run_the_store_cannot_read_does_not_fail_the_resolve(
    tmp_path: Path,
) -> None:
    """Redis: another parked run's frontier key holds a string (a hand ``SET``), so reading
    it is the server's WRONGTYPE error, not a corrupt payload."""
    async with rig("redis", tmp_path) as r:
        await parked_on_a(r)
        await r.submit("z", "book:k9")
        await r.stores.work.park(T, "z", agent="booker", reason="an operator parked it")
        work = r.stores.work
        await work._client.set(work._keys.run(T, "z", "cp:frontier"), b"junk")
        code, said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 0, (code, err)
        assert said["also_woken"] == ["b"], said


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_inspect_and_show_of_a_run_whose_own_entry_is_damaged_still_show_its_frontier(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        if backend == "redis":
            await r.stores.work._client.hdel(r.stores.work._entry(T, "b"), "state")
        else:
            await damage_entry(r, "b")
        for command in ("inspect", "show"):
            code, out, err = await r.cli(command, "b", "--tenant", T, "--json")
            assert code == 0, (command, code, err)
            assert json.loads(out)["run_id"] == "b"


@pytest.mark.redis
async def test_a_redis_entry_with_some_fields_gone_or_of_another_type_is_a_typed_error(
    tmp_path: Path,
) -> None:
    from tesserix_adk.errors import AdkError, CheckpointCorruptError

    async with rig("redis", tmp_path) as r:
        work = r.stores.work
        await r.submit("x", "book:k1")
        await work._client.hdel(work._entry(T, "x"), "since", "attempts")
        with pytest.raises(CheckpointCorruptError):
            await work.entry(T, "x")
        await work._client.hset(work._entry(T, "y"), "input", b"only an input")
        assert await work.entry(T, "y") is None  # no field of an entry: no entry
        await work._client.set(work._entry(T, "w"), b"a string")
        with pytest.raises(AdkError):
            await work.entry(T, "w")
        await work._client.hset(work._entry(T, "v"), mapping={"state": "sleeping"})
        with pytest.raises(CheckpointCorruptError):
            await work.entry(T, "v")


# --- who else is woken: a run parked for another reason, ids in the page ------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_run_parked_for_too_many_attempts_is_not_woken_by_another_runs_resolve(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r)
        work = r.stores.work
        await work.want(T, "b", agent="booker")
        for _ in range(20):
            await work.want(T, "b", agent="booker", count=1)
        reason = "taken 20 times without finishing: the process carrying it died each time"
        await work.park(T, "b", agent="booker", reason=reason)
        before = await work.entry(T, "b")
        assert before is not None and before.attempts == 20
        code, said, err = await r.resolve("a", "--outcome", "{}")
        assert code == 0, err
        after = await work.entry(T, "b")
        assert after is not None
        got = ("b" in said["also_woken"], after.state, after.attempts)
        assert got == (False, WorkState.parked, 20), got


async def test_the_console_shows_a_woken_runs_id_as_text_not_markup(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    base = "http://127.0.0.1:8765"
    evil = "b<img src=x onerror=alert(1)>"
    async with rig("sqlite", tmp_path) as r:
        await r.submit("a", "book:k1")
        await r.work("died_after")
        await r.submit(evil, "book:k1")
        await asyncio.sleep(TTL + 0.2)
        await r.work()
        assert await r.state(evil) is WorkState.parked

        def press() -> str:
            with TestClient(create_app(r.url), base_url=base) as client:
                client.get(f"/t/{T}/runs/a")
                done = client.post(
                    f"/t/{T}/runs/a/resolve",
                    data={
                        "csrf": client.cookies.get("tesserix_csrf"),
                        "call": "c0",
                        "by": "ops",
                        "what": "outcome",
                        "outcome": "{}",
                    },
                    headers={"origin": base},
                    follow_redirects=True,
                )
                assert done.status_code == 200
                return done.text

        page = await asyncio.to_thread(press)
        assert "recorded" in page
        assert "<img src=x" not in page, page[-3000:]
        assert await r.state(evil) is WorkState.wanted


# --- WorkIndex.entry: done is done, waiting is waiting, odd ids are one run ---------------

ODD_IDS = ("a:b", "{acme:r}", "r%3Ab", "r*?[x]", "ünï-☃", "sp ace", "x" * 300)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_entry_of_odd_ids_is_that_run_alone_in_every_state(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        work = r.stores.work
        for run_id in ODD_IDS:
            await r.submit(run_id, "book:k1")
        await work.park(T, ODD_IDS[0], agent="booker", reason="why")
        await work.done(T, ODD_IDS[1])
        listed = {i.run_id: i for i in await work.items(T)}
        for run_id in ODD_IDS:
            got = await work.entry(T, run_id)
            assert got is not None and got.run_id == run_id and got.tenant == T
            if run_id == ODD_IDS[1]:
                assert got.state is WorkState.done and run_id not in listed
            else:
                assert got == listed[run_id]
        assert (await work.entry(T, ODD_IDS[0])).state is WorkState.parked  # type: ignore[union-attr]
        assert await work.entry(T, "a%3Ab") is None and await work.entry(T, "a") is None
        assert await work.entry("acme:a", "b") is None and await work.entry(f"{T} ", "a:b") is None


@pytest.mark.parametrize("backend", BACKENDS)
async def test_inspect_and_show_tell_a_cancelled_before_start_run_from_a_waiting_one(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await r.submit("gone", "book:k1")
        await r.submit("waits", "book:k1")
        code, _out, err = await r.cli("cancel", "gone", "--tenant", T, "--by", "ops")
        assert code == 0, err
        for command in ("inspect", "show"):
            code, _out, err = await r.cli(command, "gone", "--tenant", T)
            assert code == 1 and "cancelled" in err and "worker" not in err, (command, err)
            code, _out, err = await r.cli(command, "waits", "--tenant", T)
            assert code == 1 and "cancelled" not in err and "worker" in err, (command, err)
        await r.work()
        assert r.world.effects == Counter({"book-k1": 1})  # "waits" booked; "gone" never ran
        for command in ("inspect", "show"):
            code, out, err = await r.cli(command, "waits", "--tenant", T, "--json")
            assert code == 0, err
            shown = json.loads(out)
            assert shown["status"] == "completed" and not shown.get("parked"), shown
        assert await r.state("gone") is WorkState.done
        assert await r.state("waits") is WorkState.done


@pytest.mark.parametrize("backend", BACKENDS)
async def test_never_ran_then_the_woken_run_carried_first_and_alone_books_once(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await parked_on_a(r, fault="died_before")
        code, said, err = await r.resolve("a", "--never-ran", "--margin", "0")
        assert code == 0 and said["also_woken"] == ["b"], (code, said, err)
        first = await r.runner().resume(r.agent, "b", tenant=T)
        assert str(first.status) == "completed", first
        assert r.world.effects == Counter({"book-k1": 1})
        await asyncio.sleep(TTL + 0.2)
        await r.work()
        assert (await r.status("a"), await r.status("b")) == ("completed", "completed")
        assert r.world.effects == Counter({"book-k1": 1})
