"""Attacks on this morning's fixes, again: a run's state that would lose a secret once stored
(refused by ``run``/``submit``, a masked frontier marked format 5 and never carried on),
the kit's log lines masked, and the comparison of a retried ``submit``.

SQLite throughout; PostgreSQL too for the mark lost mid-run.

Defects found, each fixed (their tests pass now; the walk for secret types dumps the
state keeping its objects and reads sets and keys, and submissions compare states as the
schema reads them):
- a state whose pydantic secret hides inside a set, is a dict key, or is a ``Secret``
  subclass with its own display (pydantic's documented way) is accepted by ``run`` though
  the stores keep only its mask;
- a tool putting such a secret into ``ctx.state`` leaves a frontier unmarked, and a resume
  after a crash hands the next call the mask as if it were the credential;
- a retried ``submit`` of the same set-valued state, built in another order, is refused
  ``RunStartedError``;
- a worker that cannot reset a run's count of attempts logs the store's error unmasked.

Held: a submission a worker's own ``extra_patterns`` would mask is parked, not started;
``Secret[int]``, a ``SecretStr`` in a tuple, a dataclass and a nested model refused;
``SecretStr`` refused under ``redact=False``; a custom ``Checkpointer``'s ``extra_patterns``
refused; ``token: int``, mask-looking strings and pydantic's mask as plain text accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest
from pydantic import Secret, SecretStr

from run.helpers import at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ConfigurationError,
    ScriptedProvider,
    StateRedactedError,
    ToolContext,
    Worker,
    tool,
)
from tesserix_adk.checkpoint.state_json import state_to_json
from tesserix_adk.errors import RunStartedError, StoreUnavailableError
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker_parking import Backoff

T = "acme"
PW = "QZMORNINGPW77"
STORE_SAYS = f"cannot reach postgresql://adk:{PW}@db.internal:5432/adk (timeout)"


@tool(side_effects=False)
def look(ctx: ToolContext) -> str:
    """Read-only: tells what the state holds."""
    return "looked"


class Hidden(Secret[str]):
    """A secret shown as ``<hidden>`` (pydantic's documented way to change the display)."""

    def _display(self) -> str:
        return "<hidden>"


class InASet(pydantic.BaseModel):
    keys: frozenset[SecretStr]


class AsKey(pydantic.BaseModel):
    quota: dict[SecretStr, int]


class OwnDisplay(pydantic.BaseModel):
    conn: Hidden  # not a name the redactor masks by


class PinInt(pydantic.BaseModel):
    pin: Secret[int]


class InTuple(pydantic.BaseModel):
    pair: tuple[str, SecretStr]


class Inner(pydantic.BaseModel):
    key: SecretStr


class Outer(pydantic.BaseModel):
    inner: list[Inner]


@dataclasses.dataclass
class DataState:
    api: SecretStr


class Plain(pydantic.BaseModel):
    token: int = 0
    note: str = ""
    tags: list[str] = []


def _agent(schema: type[Any] | None) -> Agent:
    return Agent("s", "Look.", [look], state_schema=schema)


async def _started(tmp_path: Path, schema: type[Any] | None, state: Any, **kw: Any) -> Any:
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores, **kw)
        return await runner.run(_agent(schema), "go", tenant=T, run_id="r", state=state)


# --- 1. states that slip through the check ---------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "state"),
    [
        (InASet, InASet(keys=frozenset({SecretStr("sk-live-abc123")}))),
        (AsKey, AsKey(quota={SecretStr("hunter2-key"): 5})),
        (OwnDisplay, OwnDisplay(conn=Hidden("pg-pass-9981"))),
    ],
    ids=["frozenset", "dict-key", "own-display"],
)
async def test_a_state_whose_secret_hides_from_the_walk_is_refused(
    tmp_path: Path, schema: type[Any], state: Any
) -> None:
    with pytest.raises(ConfigurationError):
        await _started(tmp_path, schema, state)


@pytest.mark.parametrize(
    ("schema", "state"),
    [
        (PinInt, PinInt(pin=Secret[int](1234))),
        (InTuple, InTuple(pair=("a", SecretStr("x-secret")))),
        (Outer, Outer(inner=[Inner(key=SecretStr("k1"))])),
        (DataState, DataState(api=SecretStr("api-value"))),
        (None, {"nested": [{"deep": SecretStr("v")}]}),
    ],
    ids=["secret-int", "tuple", "nested-model", "dataclass", "untyped-dict"],
)
async def test_a_secret_the_walk_reaches_is_refused_before_anything_starts(
    tmp_path: Path, schema: type[Any] | None, state: Any
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        await _started(tmp_path, schema, state)
    for value in ("1234", "x-secret", "k1", "api-value"):
        assert f"'{value}'" not in str(refused.value)


async def test_redact_false_still_refuses_a_pydantic_secret_and_extra_patterns_count(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        off = Checkpointer(stores.checkpoints, redact=False)
        ids = stores.idempotency
        runner = AgentRunner(ScriptedProvider(["done"]), idempotency=ids, checkpoints=off)
        with pytest.raises(ConfigurationError):
            await runner.run(
                _agent(Inner), "go", tenant=T, run_id="off", state=Inner(key=SecretStr("v"))
            )
        # With redaction off, a plain string the redactor would mask is kept whole: accepted.
        run = await runner.run(
            _agent(None), "go", tenant=T, run_id="off2", state={"api_token": "tok-1"}
        )
        assert str(run.status) == "completed"
        custom = Checkpointer(stores.checkpoints, extra_patterns=[r"ACCT-\d+"])
        runner = AgentRunner(ScriptedProvider(["done"]), idempotency=ids, checkpoints=custom)
        with pytest.raises(ConfigurationError, match="note"):
            await runner.run(_agent(None), "go", tenant=T, run_id="c", state={"note": "ACCT-991"})


async def test_ordinary_states_that_merely_look_like_masks_are_not_refused(
    tmp_path: Path,
) -> None:
    state = Plain(token=77, note="**********", tags=["[redacted:secret]", "<hidden>"])
    run = await _started(tmp_path, Plain, state)
    assert str(run.status) == "completed"


async def test_a_submission_a_workers_own_patterns_would_mask_is_parked_not_started(
    tmp_path: Path,
) -> None:
    """Redaction that differs between the submitting process and the worker's: the worker's
    own patterns mask the submitted state, so it refuses to start it (parked, typed)."""
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = _agent(None)
        client = AgentRunner.from_stores(ScriptedProvider(["done"]), stores)
        await client.submit(agent, "go", tenant=T, run_id="x", state={"note": "ACCT-991"})
        masking = Checkpointer(stores.checkpoints, extra_patterns=[r"ACCT-\d+"])
        runner = AgentRunner(
            ScriptedProvider(["done"]),
            idempotency=stores.idempotency,
            checkpoints=masking,
            leases=stores.leases,
            work=stores.work,
            ledger=stores.ledger,
            approvals=stores.approvals,
        )
        worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 20)
        assert stores.work is not None
        item = await stores.work.entry(T, "x")
        assert item is not None and str(item.state) == "parked"
        assert (item.reason or "").startswith("ConfigurationError:")
        assert "ACCT-991" not in (item.reason or "")
        assert await masking.latest(T, "x") is None  # nothing started, nothing sent


# --- 2. a masked mark lost mid-run ---------------------------------------------------------


class Keys(pydantic.BaseModel):
    keys: frozenset[SecretStr] = frozenset()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_secret_put_into_a_set_mid_run_is_never_carried_on_as_its_mask(
    tmp_path: Path, backend: str
) -> None:
    seen: list[str] = []

    @tool
    def call_api(n: int, ctx: ToolContext) -> str:
        """Call an API with the run's key (fetched the first time)."""
        if not ctx.state.keys:
            ctx.state.keys = frozenset({SecretStr("sk-live-realkey-42")})
        seen.extend(k.get_secret_value() for k in ctx.state.keys)
        return f"called {n}"

    agent = Agent("keys", "Call.", [call_api], state_schema=Keys)
    turns = [[("call_api", {"n": 1})], [("call_api", {"n": 2})], "done"]
    run_id = f"k-{uuid.uuid4().hex[:8]}"
    async with fresh_stores(backend, tmp_path) as stores:
        crash = at("after_model_call", 1)
        runner = faulty_runner(stores, ScriptedProvider(turns), crash_before=crash)
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "go", tenant=T, run_id=run_id, state=Keys())
        assert seen == ["sk-live-realkey-42"]
        again = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        with contextlib.suppress(StateRedactedError):
            await again.resume(agent, run_id, tenant=T)
        assert seen == ["sk-live-realkey-42"], f"the resumed call was handed {seen[1:]}"


# --- 3. the submit comparison ----------------------------------------------------------------


class Tags(pydantic.BaseModel):
    tags: set[str]


def _orders() -> tuple[list[str], list[str]]:
    """Two orders of the same strings whose ``Tags`` states dump their sets in different
    orders, also after a round trip through the stored form (a hash collision: what another
    process, with another hash seed, does to any set)."""
    adapter = pydantic.TypeAdapter(Tags)

    def dumped(state: Tags) -> Any:
        return state_to_json(state, Tags)["tags"]

    words = [f"tag{i}" for i in range(30)]
    for i, a in enumerate(words):
        for b in words[i + 1 :]:
            for c in words[:8]:
                if c in (a, b):
                    continue
                one, two = [a, b, c], [c, b, a]
                first, second = dumped(Tags(tags=set(one))), dumped(Tags(tags=set(two)))
                again = dumped(adapter.validate_python({"tags": first}))
                if first != second and again != second:
                    return one, two
    pytest.skip("no colliding strings under this hash seed")


async def test_a_retried_submit_of_the_same_set_state_is_a_no_op(tmp_path: Path) -> None:
    one, two = _orders()
    assert set(one) == set(two)
    agent = _agent(Tags)
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores)
        await runner.submit(agent, "go", tenant=T, run_id="t", state=Tags(tags=set(one)))
        try:
            answered: object = await runner.submit(
                agent, "go", tenant=T, run_id="t", state=Tags(tags=set(two))
            )
        except RunStartedError as exc:
            answered = exc
        assert answered == "t", f"the same request was answered {answered!r}"


# --- 4. the kit's log lines ------------------------------------------------------------------


class _ResetFails:
    """A work store whose reset of a run's attempts (a negative ``count``) fails, naming its
    URL, password and all, as a driver may."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def want(self, *args: Any, **kwargs: Any) -> None:
        count = kwargs.get("count")
        if count is not None and count < 0:
            self.failed += 1
            raise StoreUnavailableError(STORE_SAYS)
        await self._inner.want(*args, **kwargs)


async def test_a_failed_reset_of_attempts_is_logged_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = _agent(None)
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores)
        await runner.submit(agent, "go", tenant=T, run_id="w")
        assert stores.work is not None
        await stores.work.want(T, "w", agent="s", state=WorkState.submitted, count=2)
        work = _ResetFails(stores.work)
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores)
        runner.work = work  # type: ignore[assignment]
        worker = Worker(
            runner,
            [agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=Backoff(base=0.01, cap=0.02),
        )
        await asyncio.wait_for(worker.run(), 20)
    assert work.failed >= 1
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tesserix_adk"))
    assert "db.internal" in logged, logged
    assert PW not in logged, logged
