"""Attacks on resolve(holder=) (b0977aa), positions and validation before the claim
(d679d1c, 3231627) and cut-off replies (34e727d, b0977aa).

A strict xfail is a defect found (its reason names what goes wrong and where in src); a plain
test is a promise that held under the attack.

Defects found (each was a strict xfail; both are fixed since, their tests plain: a call's
arguments are judged by its tool's validation only once its record says it is to go out,
and its refusal is recorded like any answer, so a call that ran is replayed; Redis is told
whether to check the holder apart from the holder itself). One promise this file pinned
changed with that fix: a call refused by its tool's validation now leaves a completed
record holding the refusal (it is claimed before it is judged), not none:

1. (medium) A call that ran is told to the model as refused on resume. ``charge(order)``
   has a pydantic validator that asks the world (the order must still be open); the call
   is claimed, sent (it closes the order) and recorded completed, and the process dies
   before the ``after_tool_result`` frontier. On resume ``run/dispatch.py`` ``_answer``
   asks ``tool.invalid_arguments`` before ``call_tool`` reads the record: the validator
   now fails, and the call is answered "invalid arguments ... order 5 is not open",
   disposition ``refused``, instead of its recorded outcome replayed. The model is told a
   charge that happened did not go out (and may ask again with other arguments, a new key).
2. (low) ``resolve(holder="")`` settles a claim held by ``worker-a`` on Redis
   (``adapters/redis/idempotency.py`` sends ``""`` for ``None`` and ``scripts/resolve.lua``
   skips the holder check when ``ARGV[4] == ''``); memory, SQLite and PostgreSQL refuse it
   with ``ValueError``.

Promises that held (plain tests): resolve(holder=) after a takeover=True claim refuses the
superseded holder and settles the new one, a renewal by the same holder stays its claim, a
settled, absent or lapsed claim is refused, field for field alike in memory, SQLite, Redis
and PostgreSQL; no call of a reply cut off (OpenAI length / content_filter, Anthropic
max_tokens / model_context_window_exceeded / refusal) goes out, plain or streamed, with
text beside two parallel calls (a whole reply's calls do); a call whose arguments the
tool's validation coerces (``"2"`` to 2, a default, a ``ctx`` parameter) is sent, a bad one
is refused with no record left; three calls the model gave one id keep their own positions
on ``ToolCallAsked``, ``ToolCallStarted`` and ``ToolCallFinished``, each with its own result.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator

from adapters import services
from providers.fake_server import (
    ModelServer,
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
)
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ToolContext, open_stores, tool
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.run.events import (
    CallDisposition,
    ToolCallAsked,
    ToolCallFinished,
    ToolCallStarted,
)
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags
from tesserix_adk.testing.faults import FaultyIdempotencyStore, SimulatedCrash

T = "acme"

# Orders the payment system will still charge: a validator that asks the world.
OPEN_ORDERS: set[str] = set()


def must_be_open(order: str) -> str:
    if order not in OPEN_ORDERS:
        raise ValueError(f"order {order} is not open")
    return order


def _runner(provider: Any, stores: Any, idempotency: Any = None) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=idempotency or stores.idempotency,
        checkpoints=Checkpointer.from_stores(stores),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        work=stores.work,
    )


async def test_a_recorded_call_whose_validation_now_fails_is_replayed_on_resume() -> None:
    OPEN_ORDERS.clear()
    OPEN_ORDERS.add("5")
    open_orders = OPEN_ORDERS
    charged: list[str] = []

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    def charge(order: Annotated[str, AfterValidator(must_be_open)]) -> str:
        """Charge an open order (it is closed once charged)."""
        charged.append(order)
        open_orders.discard(order)
        return f"charged order {order}"

    agent = Agent("shop", "Charge.", [charge])
    stores = open_stores("memory://")

    def die_once_recorded(phase: str, op: str, key: str) -> None:
        if (phase, op) == ("after", "complete"):
            raise SimulatedCrash("died once the outcome was recorded")

    faulty = FaultyIdempotencyStore(stores.idempotency, hook=die_once_recorded)
    provider = ScriptedProvider([[("charge", {"order": "5"})], "done"])
    with pytest.raises(SimulatedCrash):
        await _runner(provider, stores, faulty).run(agent, "go", tenant=T, run_id="r1")
    [rec] = (await stores.idempotency.lookup([f"{T}/order-5"], tenant=T)).values()
    assert rec.status is RecordStatus.completed and charged == ["5"]
    seen: list[Any] = []
    provider = ScriptedProvider([[("charge", {"order": "5"})], "done"])
    run = await _runner(provider, stores).resume(agent, "r1", tenant=T, on_event=seen.append)
    [finished] = [e for e in seen if isinstance(e, ToolCallFinished)]
    assert finished.disposition is CallDisposition.replayed, finished
    assert finished.content == "charged order 5"
    assert charged == ["5"]
    assert run.status.value == "completed"


# --- resolve(holder=) in every backend -------------------------------------------------------


async def _holder_cycles(store: Any) -> list[Any]:
    """What resolve(holder=) does after a takeover, a renewal, a lapse, a settle, and for a
    holder named by the empty string."""
    seen: list[Any] = []

    async def claim(key: str, holder: str, **kw: Any) -> Any:
        return await store.claim(
            key, holder=holder, tenant=T, run_id="r1", iteration=0, tool="book",
            call_id="c1", flags=ToolFlags(), **kw,
        )  # fmt: skip

    async def resolve(key: str, holder: str | None, **kw: Any) -> None:
        kw.setdefault("never_ran", True)
        try:
            rec = await store.resolve(key, tenant=T, by="ops", holder=holder, **kw)
        except KeyError:
            seen.append((key, holder, "KeyError"))
        except ValueError:
            seen.append((key, holder, "ValueError"))
        else:
            seen.append((key, holder, str(rec.status), rec.holder, rec.by))

    await claim("k1", "A", fence=1)
    await claim("k1", "B", fence=2, takeover=True)
    await resolve("k1", "A")  # the claim A held was taken over: refused
    await resolve("k1", "B", outcome=b"done", never_ran=False)
    await claim("k2", "C", fence=3)
    await claim("k2", "C", fence=4)  # renewed by its own holder: still C's claim
    await resolve("k2", "C")
    await claim("k3", "D", fence=5)
    await resolve("k3", "D")
    await resolve("k3", "D")  # settled already
    await resolve("absent", "D")
    await claim("k4", "E", fence=6, ttl=0.2)
    await asyncio.sleep(0.3)
    await resolve("k4", "E")  # lapsed: nobody holds it
    for key in ("k1", "k2", "k3"):
        rec = (await store.lookup([key], tenant=T))[key]
        seen.append((key, str(rec.status), rec.holder, rec.outcome, rec.by))
    return seen


async def test_resolve_for_a_holder_behaves_alike_in_every_backend(tmp_path: Path) -> None:
    seen = await services.on_every_idempotency_store(tmp_path / "adk.sqlite3", _holder_cycles)
    for backend, got in seen.items():
        assert got == seen["memory"], backend


# --- cut-off replies with text and parallel calls (providers) --------------------------------


_TWO_CALLS = [("call_1", "transfer", {"amount": 10}), ("call_2", "transfer", {"amount": 20})]


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize(
    ("vendor", "reason"),
    [
        ("openai", "length"),
        ("openai", "content_filter"),
        ("anthropic", "max_tokens"),
        ("anthropic", "model_context_window_exceeded"),
        ("anthropic", "refusal"),
        ("openai", "tool_calls"),  # the control: a whole reply's calls go out
        ("anthropic", "tool_use"),
    ],
)
async def test_no_call_of_a_cut_off_reply_with_text_and_parallel_calls_is_sent(
    model_server: ModelServer, vendor: str, reason: str, streamed: bool
) -> None:
    transfers: list[int] = []

    @tool
    def transfer(amount: int) -> str:
        """Send money."""
        transfers.append(amount)
        return f"sent {amount}"

    provider: Any
    if vendor == "openai":
        field, whole = "finish_reason", "tool_calls"
        provider = OpenAIProvider(
            "openai:gpt-4o", base_url=model_server.url, api_key="test-key", max_retries=0,
            timeout=5.0, parallel_tool_calls=True,
        )  # fmt: skip
        make, make_stream = openai_completion, openai_stream
    else:
        field, whole = "stop_reason", "tool_use"
        provider = AnthropicProvider(
            "anthropic:claude-haiku-4-5", base_url=model_server.url, api_key="test-key",
            max_retries=0, timeout=5.0,
        )  # fmt: skip
        make, make_stream = anthropic_message, anthropic_stream
    before, after = f'"{field}": "{whole}"', f'"{field}": "{reason}"'
    if streamed:
        frames = [f.replace(before, after) for f in make_stream("Paying both.", _TWO_CALLS)]
        assert any(after in f for f in frames)
        model_server.queue(Reply(events=frames), Reply(events=make_stream("Stopped.")))
    else:
        body = json.dumps(make("Paying both.", _TWO_CALLS)).replace(before, after)
        assert after in body
        model_server.queue(Reply(body=body), make("Stopped."))
    agent = Agent("bank", "Pay.", [transfer], parallel_tool_calls=2)
    runner = AgentRunner.from_stores(provider, open_stores("memory://"))
    try:
        with contextlib.suppress(Exception):  # refusing the reply is fine; sending is not
            await runner.run(
                agent, "pay", tenant=T, run_id="r1",
                on_event=(lambda _e: None) if streamed else None,
            )  # fmt: skip
    finally:
        await provider.aclose()
    assert sorted(transfers) == ([10, 20] if reason == whole else [])


class _TwinIds(ScriptedProvider):
    """A model that gives every call of a turn the id ``same``."""

    async def complete(self, request: Any) -> Any:
        response = await super().complete(request)
        message = response.message
        calls = [dataclasses.replace(c, id="same") for c in message.tool_calls]
        return dataclasses.replace(response, message=dataclasses.replace(message, tool_calls=calls))


# --- validation before the claim, and each call's place in its turn (run/dispatch.py) --------


async def test_a_call_the_tools_validation_coerces_is_sent_and_a_bad_one_never_sent() -> None:
    sent: list[tuple[int, str, str]] = []

    @tool
    def book(seats: int, ctx: ToolContext, cabin: str = "economy") -> str:
        """Book seats."""
        sent.append((seats, cabin, ctx.run_id))
        return "booked"

    provider = ScriptedProvider(
        [[("book", {"seats": "2"}), ("book", {"seats": "many"}), ("book", {"seats": 1, "x": 1})],
         "done"]
    )  # fmt: skip
    stores = open_stores("memory://")
    seen: list[Any] = []
    run = await _runner(provider, stores).run(
        Agent("a", "Book.", [book]), "go", tenant=T, run_id="r1", on_event=seen.append
    )
    assert run.status.value == "completed"
    assert sent == [(2, "economy", "r1")]
    # The sent call is recorded; a refused call's claim goes (nothing is kept under its
    # key, which a business key would share with the model's corrected call).
    records = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book"]
    assert [r.status for r in records] == [RecordStatus.completed]
    finished = [(e.position, e.disposition) for e in seen if isinstance(e, ToolCallFinished)]
    assert finished == [
        (0, CallDisposition.dispatched),
        (1, CallDisposition.refused),
        (2, CallDisposition.refused),
    ]


async def test_twin_call_ids_keep_their_own_places_in_every_event_on_run_and_resume() -> None:
    @tool
    def note(text: str) -> str:
        """Take a note."""
        return text

    # The model gives the turn's three calls one id.
    script = [[("note", {"text": "a"}), ("note", {"text": "b"}), ("note", {"text": "c"})], "done"]
    stores = open_stores("memory://")
    seen: list[Any] = []
    run = await _runner(_TwinIds(script), stores).run(
        Agent("a", "Note.", [note], parallel_tool_calls=3), "go", tenant=T, run_id="r1",
        on_event=seen.append,
    )  # fmt: skip
    assert run.status.value == "completed"
    asked = {e.position: e.arguments["text"] for e in seen if isinstance(e, ToolCallAsked)}
    started = sorted(e.position for e in seen if isinstance(e, ToolCallStarted))
    done = {e.position: e.content for e in seen if isinstance(e, ToolCallFinished)}
    assert asked == {0: "a", 1: "b", 2: "c"}
    assert started == [0, 1, 2]
    assert done == asked
    assert {e.call_id for e in seen if isinstance(e, ToolCallFinished)} == {"same"}


async def _resolve_for_the_empty_holder(store: Any) -> str:
    await store.claim(
        "k", holder="worker-a", tenant=T, run_id="r1", iteration=0, tool="book",
        call_id="c1", flags=ToolFlags(), fence=1,
    )  # fmt: skip
    try:
        await store.resolve("k", never_ran=True, tenant=T, by="ops", holder="")
    except ValueError:
        return "refused"
    return "landed"


async def test_resolve_for_the_empty_holder_is_refused_alike_in_every_backend(
    tmp_path: Path,
) -> None:
    seen = await services.on_every_idempotency_store(
        tmp_path / "adk.sqlite3", _resolve_for_the_empty_holder
    )
    assert seen == dict.fromkeys(seen, "refused"), seen
