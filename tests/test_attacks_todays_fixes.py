"""Attacks on three fixes of one day: NUL and key length (823cd49), tool results Python
cannot write as JSON (27d5c91), and two tools sharing a business key (8fe698a).

Defects (strict xfails):

* Two tools sharing a key, a resume past the frontier: a charge ran at iteration 1 and the
  process died before that turn's frontier; the resumed model asks for a refund under the
  same key instead. The divergence check matches by key only, so the refund passes for the
  charge, is answered "not sent", and the run completes: the charge that ran is never told.
* ``inspect`` (the resume plan) tells a refund whose key holds the charge's record as
  "completed - outcome recorded", while the resume answers it "not sent".
* A refund whose key another run's charge holds in flight is refused as indeterminate
  ("nobody can say whether it ran"), though the refund certainly never went out and the
  completed case answers it "not sent".
* ``AgentRunner.cancel(by=...)`` with a NUL on PostgreSQL is a store outage
  (``StoreUnavailableError``): ``by`` goes into the claim's holder, which ``words`` misses.
* A NUL the key function adds itself, beside an argument holding the six characters
  ``\\u0000``, is taken for the model's NUL: "not sent" instead of ``ConfigurationError``.
* A tool result with an int past 4,300 digits as a dict key is told to the model as the
  call's failure (``ValueError: Exceeds the limit``), though the call completed.
* Bytes that are UTF-8 beside bytes that are not, in one result: the UTF-8 ones become
  base64 too (README: "bytes as their UTF-8 text, or as base64 text when they are not").
* A tool returning a huge int at the top: the first model is told ``"0x…"`` (quoted JSON),
  a resumed model replaying the record is told ``0x…`` (bare text).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from run.helpers import Recording, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    ConfigurationError,
    DivergedRunError,
    LeasePolicy,
    Role,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.checkpoint.planning import ToolDisposition, plan_resume
from tesserix_adk.messages import content_json
from tesserix_adk.run.invoking import result_content
from tesserix_adk.run.screening import MAX_KEY_BYTES
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "acme"
HUGE = 10**5000


def _told(model: Recording) -> list[tuple[str, bool]]:
    return [(m.text, m.is_error) for m in model.requests[-1].messages if m.role is Role.tool]


def _shop(sent: list[str], *, crash: bool = False, parallel: int = 1) -> Agent:
    """charge and refund keyed alike (``order-5``), and a read-only look."""

    def by_order(**kw: Any) -> str:
        return f"order-{kw['arguments']['order']}"

    @tool(key=by_order)
    def charge(order: str) -> str:
        """Charge an order."""
        sent.append(f"charge {order}")
        if crash:
            raise SimulatedCrash
        return f"charged order {order}"

    @tool(key=by_order)
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return f"refunded order {order}"

    @tool(side_effects=False)
    def look(order: str) -> str:
        """Look an order up."""
        return f"order {order} is open"

    return Agent("shop", "Shop.", [charge, refund, look], parallel_tool_calls=parallel)


# ==========================================================================================
# 3. Two tools sharing a key
# ==========================================================================================


async def test_a_resume_asking_another_tool_under_the_key_of_a_call_that_ran_is_diverged(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        # Frontiers only after each turn's results: the charge at iteration 1 runs, then the
        # process dies before its frontier; the record is ahead of the frontier.
        policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
        dying = FaultyCheckpointStore(stores.checkpoints, crash_before=at("after_tool_result", 1))
        first = AgentRunner(
            ScriptedProvider([[("look", {"order": "5"})], [("charge", {"order": "5"})], "done"]),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(dying, history=stores.history, policy=policy),
            leases=stores.leases,
        )
        with pytest.raises(SimulatedCrash):
            await first.run(_shop(sent), "go", tenant=T, run_id="r")
        assert sent == ["charge 5"]
        # The resumed model, asked again at iteration 1, asks for the refund instead.
        model = Recording(
            ScriptedProvider([[("look", {"order": "5"})], [("refund", {"order": "5"})], "done"])
        )
        outcome: Any
        try:
            outcome = await AgentRunner.from_stores(model, stores).resume(
                _shop(sent), "r", tenant=T
            )
        except DivergedRunError as exc:
            outcome = exc
        assert sent == ["charge 5"]
        # The charge ran; a run that goes on without the model being told so diverged.
        told = [text for text, _ in _told(model)] if model.requests else []
        assert isinstance(outcome, DivergedRunError) or any("charged" in t for t in told), (
            outcome,
            told,
        )


async def test_the_plan_never_tells_a_refund_completed_by_the_charges_record(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    turns: list[Any] = [[("charge", {"order": "5"})], [("refund", {"order": "5"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 1)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(_shop(sent), "go", tenant=T, run_id="r")
        frontier = await Checkpointer.from_stores(stores).latest(T, "r")
        assert frontier is not None
        plan = await plan_resume(frontier, stores.idempotency)
        (refund,) = [p for p in plan.calls if p.tool == "refund"]
        # What the resume then does with it: "not sent", the refund never went out.
        model = Recording(ScriptedProvider(turns))
        run = await AgentRunner.from_stores(
            model, stores, lease_policy=LeasePolicy(ttl=0.2, renew_within=0.1)
        ).resume(_shop(sent), "r", tenant=T)
        assert run.status is RunStatus.completed and sent == ["charge 5"]
        assert _told(model)[-1][0].startswith("not sent")
        assert refund.disposition is not ToolDisposition.completed, refund.describe()


async def test_a_refund_under_another_runs_charge_in_flight_is_not_sent_rather_than_in_doubt(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    lease = LeasePolicy(ttl=0.2, renew_within=0.1)
    async with fresh_stores("sqlite", tmp_path) as stores:
        dies = ScriptedProvider([[("charge", {"order": "5"})], "done"])
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(dies, stores, lease_policy=lease).run(
                _shop(sent, crash=True), "go", tenant=T, run_id="A"
            )
        await asyncio.sleep(0.4)  # run A is no longer carried; its charge stays in flight
        model = Recording(ScriptedProvider([[("refund", {"order": "5"})], "done"]))
        run = await AgentRunner.from_stores(model, stores, lease_policy=lease).run(
            _shop(sent), "go", tenant=T, run_id="B"
        )
        assert sent == ["charge 5"]
        assert run.status is RunStatus.completed
        assert _told(model)[-1][0].startswith("not sent")


async def test_charge_and_refund_side_by_side_in_one_turn_send_the_charge_once_only(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    turns: list[Any] = [[("charge", {"order": "5"}), ("refund", {"order": "5"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        model = Recording(ScriptedProvider(turns))
        run = await AgentRunner.from_stores(model, stores).run(
            _shop(sent, parallel=2), "go", tenant=T, run_id="r"
        )
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        charged, refund = _told(model)
        assert charged == ("charged order 5", False)
        assert refund[1] and refund[0].startswith("not sent") and "charge" in refund[0]


# ==========================================================================================
# 1. NUL and key length
# ==========================================================================================


@pytest.mark.postgres
async def test_a_cancel_by_a_name_holding_nul_is_kept_on_postgres(tmp_path: Path) -> None:
    async with fresh_stores("postgres", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores)
        await runner.cancel("r", tenant=T, by="on\x00call", reason="it broke\x00here")


async def test_a_nul_the_key_function_adds_is_its_own_beside_a_literal_escape(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    def glued(**kw: Any) -> str:
        return f"order-{kw['arguments']['order']}\x00v2"  # the NUL is the function's own

    @tool(key=glued)
    def book(order: str) -> str:
        """Book an order."""
        sent.append(order)
        return order

    async with fresh_stores("sqlite", tmp_path) as stores:
        model = Recording(ScriptedProvider([[("book", {"order": "\\u0000"})], "done"]))
        runner = AgentRunner.from_stores(model, stores)
        with pytest.raises(ConfigurationError, match="NUL"):
            await runner.run(Agent("a", "Book.", [book]), "go", tenant=T, run_id="r")
        assert sent == []


def _random_text(rng: random.Random, size: int) -> str:
    """``size`` bytes of UTF-8 that hardly compress: random three-byte characters, then
    ASCII to the exact size."""
    chars = [chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(size // 3)]
    chars += [chr(rng.randrange(0x21, 0x7E)) for _ in range(size - 3 * (size // 3))]
    text = "".join(chars)
    assert len(text.encode("utf-8")) == size
    return text


@pytest.mark.postgres
@pytest.mark.parametrize(
    "tenant",
    [
        "a",
        "t/%2F?#é",
        "漢" * 170,  # 510 bytes, 1,530 when percent-escaped in front of the key
        "x" * 512,
    ],
)
async def test_a_key_at_the_byte_limit_is_kept_on_postgres_and_one_byte_more_not_sent(
    tmp_path: Path, tenant: str
) -> None:
    sent: list[str] = []

    def raw(**kw: Any) -> str:
        return str(kw["arguments"]["order"])

    @tool(key=raw)
    def book(order: str) -> str:
        """Book an order."""
        sent.append(order)
        return "booked"

    room = MAX_KEY_BYTES - len(tenant.encode("utf-8")) - len(quote(tenant, safe="")) - 1
    rng = random.Random(len(tenant))
    fits, over = _random_text(rng, room), _random_text(rng, room + 1)
    agent = Agent("a", "Book.", [book])
    async with fresh_stores("postgres", tmp_path) as stores:
        for run_id, order in (("fits", fits), ("over", over)):
            model = Recording(ScriptedProvider([[("book", {"order": order})], "done"]))
            run = await AgentRunner.from_stores(model, stores).run(
                agent, "go", tenant=tenant, run_id=run_id
            )
            assert run.status is RunStatus.completed
            text, is_error = _told(model)[-1]
            if run_id == "fits":
                assert (text, is_error) == ("booked", False)
            else:
                assert is_error and text.startswith("not sent") and str(room) in text
        assert sent == [fits]
        (record,) = await stores.idempotency.records(tenant, "fits")
        assert record.status.value == "completed"


# ==========================================================================================
# 2. Tool results
# ==========================================================================================


async def test_a_huge_int_as_a_dict_key_is_not_told_as_the_calls_failure(tmp_path: Path) -> None:
    sent: list[str] = []

    @tool
    def give(n: str) -> Any:
        """Give something back."""
        sent.append(n)
        return {HUGE: "x"}

    async with fresh_stores("sqlite", tmp_path) as stores:
        model = Recording(ScriptedProvider([[("give", {"n": "1"})], "done"]))
        run = await AgentRunner.from_stores(model, stores).run(
            Agent("a", "x", [give]), "go", tenant=T, run_id="r"
        )
        assert run.status is RunStatus.completed and sent == ["1"]
        text, is_error = _told(model)[-1]
        assert not is_error, text


def test_utf8_bytes_beside_binary_bytes_stay_their_text() -> None:
    content = result_content({"name": b"hello", "image": b"\xff\xd8\xff"})
    assert content["name"] == "hello"


async def test_a_huge_int_at_the_top_is_told_alike_first_and_on_replay(tmp_path: Path) -> None:
    sent: list[str] = []

    @tool
    def give(n: str) -> int:
        """Give a number back."""
        sent.append(n)
        return HUGE

    agent = Agent("a", "x", [give])
    turns: list[Any] = [[("give", {"n": "1"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        first = Recording(ScriptedProvider(turns))
        await AgentRunner.from_stores(first, stores).run(agent, "go", tenant=T, run_id="a")
        crashing = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="b")
        resumed = Recording(ScriptedProvider(turns))
        run = await AgentRunner.from_stores(resumed, stores).resume(agent, "b", tenant=T)
        assert run.status is RunStatus.completed
        assert sent == ["1", "1"]  # once per run; the resume replayed b's record
        assert _told(first) == _told(resumed)


_nested = st.recursive(
    st.integers(min_value=-50, max_value=50) | st.booleans() | st.text("ab", max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("ab", max_size=3), inner),
    max_leaves=6,
)


def _blown(value: Any) -> Any:
    """Each odd int past Python's digits for text (negative ones too); booleans kept."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value * 10**4300 + value if value % 2 else value
    if isinstance(value, dict):
        return {k: _blown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blown(v) for v in value]
    return value


def _from_hex(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip("-").startswith("0x"):
        return int(value, 16)
    if isinstance(value, dict):
        return {k: _from_hex(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_hex(v) for v in value]
    return value


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shape=_nested)
def test_content_json_keeps_every_int_exactly_nested_or_negative(shape: Any) -> None:
    value = _blown(shape)
    back = json.loads(content_json(value, sort_keys=True))
    assert _from_hex(back) == value
    # Booleans stay booleans beside a huge int, never hex.
    assert content_json([True, HUGE]).startswith("[true, ")
