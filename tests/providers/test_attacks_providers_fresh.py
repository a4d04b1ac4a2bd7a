"""Fresh eyes on the model providers, end to end through ``AgentRunner`` on SQLite.

The real ``openai`` and ``anthropic`` SDKs talk HTTP to the fake model server on loopback
(``fake_server.ModelServer``) or, where a reply has to be lost mid-body, to an
``httpx.MockTransport`` whose body stream breaks half way. The side-effecting tool is keyed
by the business object (``order-<n>``), the store is one SQLite file, and a "process" is a
fresh provider and runner over the same file.

Found, and fixed (``arguments_from_text`` reads arguments sent as an object; a worker's
``TakeProgress`` is a ``run.events.ProgressListener``, for which the wire stays plain):

MEDIUM
- ``test_openai_arguments_sent_as_an_object_are_answered_not_a_paid_retry_loop``: an
  OpenAI-compatible server that sends a call's ``function.arguments`` as a JSON object
  (not as JSON text, as some local servers do) makes ``providers/_common.py``
  ``arguments_from_text`` raise ``AttributeError`` (``'dict' object has no attribute
  'strip'``); ``SDKProvider.complete`` reads it as a *retryable* "malformed completion"
  (charged, ``paid``). Every resume or worker retry asks the same server again, pays again
  and fails the same way, until the worker parks the run after ``max_attempts``; the call
  is never answered and the operator is told to retry. README (``providers/openai.py``
  docstring) promises arguments that are not JSON text are kept as ``_malformed_arguments``
  and answered with an error result so the model can ask again.
- ``test_a_workers_take_calls_the_same_endpoint_as_run``: ``worker.py`` passes its own
  bookkeeping (``TakeProgress``) as ``on_event``; that sets ``Attempt.streams``, so
  ``run/loop.py`` ``_ask`` calls the *streaming* endpoint on every worker take, where
  ``runner.run()`` calls the plain one (README: "``run()`` calls the non-streaming
  endpoints (telemetry does not change that)"; ``attempt.py``: streaming is "asked for by
  whoever started the attempt ... not by telemetry added to events later, which must not
  change the wire"). The same run behaves differently under a worker: a server that
  answers only the plain endpoint (or refuses ``stream_options``) fails or loops every
  worker take of a run ``run()`` completes, until it is parked or ends ``failed``.

Held (plain tests):
- ``test_a_429_with_the_key_echoed_stops_retryably_and_a_worker_finishes_charging_once``:
  a 429 (and Anthropic's 529) past the SDK's retries, with the API key echoed in the
  vendor's message (as is, percent-encoded and base64), stops the run retryably after the
  keyed call ran; a ``Worker`` on SQLite retries it later, the call is not sent again,
  exactly the answered calls are charged, and the key is in no byte of the SQLite files
  (the work index's retry reason included), no log line and no error text.
- ``test_a_reply_lost_mid_body_is_asked_again_and_the_keyed_call_runs_once``: a reply
  whose body breaks half way (before and after the call ran), with the SDK not retrying:
  the run stops retryably, a resume in a new "process" asks again, the call runs once,
  the lost replies are charged nothing and the answered ones once.
- ``test_the_sdks_own_retry_of_a_lost_body_sends_the_call_once``: the same loss retried
  inside the SDK: one call, one charge per answered reply.
- ``test_call_ids_reused_every_turn_pair_their_results_across_a_crash``: a server that
  gives every turn's call the id ``call_0_0`` (the ``ScriptedProvider``'s own shape) and a
  death while the model thinks: each keyed call runs once, the resume's request pairs
  each result with its own turn, and the spend is each answered call once.
- ``test_malformed_arguments_and_unknown_tools_are_answered_and_the_run_completes``:
  arguments that are a JSON list, a JSON string, cut-off JSON, or huge (200 KB, with a
  field the tool lacks), and a tool name the agent lacks, are each answered with an error
  result in the model's order; none is sent, the one good call of the turn runs once, and
  the run completes.

Not looked at for lack of time: a call id holding a key on SQLite, a death between a
charge and its frontier with a budget.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anthropic
import httpx2 as httpx
import openai
import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ModelRequest,
    ProviderError,
    RunStatus,
    open_stores,
    tool,
)
from tesserix_adk.errors import LeaseHeldError
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.providers.pricing import Price
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker import Worker
from tesserix_adk.worker_parking import Backoff

from .fake_server import ModelServer
from .vendors import OPENAI, SDKProvider, Vendor

PRICE = Price(input_per_million_micros=1_000_000, output_per_million_micros=1_000_000)
PER_CALL = 150  # 120 + 30 tokens at one micro each
TENANT = "acme"
# No redaction pattern knows it: only the provider's own scrubbing can mask it.
KEY = "zq-local-7Hk2pW9xR4mN8vB3"
# A dead attempt's lease lapses quickly, so a resume need not wait 30 s.
SHORT = LeasePolicy(ttl=0.6, renew_within=0.3)


class Shop:
    """The outside world: every charge it was asked to make."""

    def __init__(self) -> None:
        self.charges: list[tuple[int, int]] = []

    def agent(self, **kwargs: Any) -> Agent:
        @tool(key=lambda *, arguments, **_: f"order-{arguments['order']}")
        def charge(order: int, amount: int) -> str:
            """Charge an order (side-effecting, keyed by the order)."""
            self.charges.append((order, amount))
            return f"charged order {order}"

        return Agent("shop", "Charge what the user asks.", [charge], **kwargs)


@asynccontextmanager
async def sqlite(tmp_path: Path) -> AsyncIterator[Stores]:
    async with open_stores(f"sqlite:///{tmp_path}/adk.sqlite3") as stores:
        await stores.create_schema()
        yield stores


def every_byte(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(tmp_path.iterdir()) if p.is_file())


def charge_call(call_id: str, order: int, amount: int = 10) -> tuple[str, str, dict[str, int]]:
    return (call_id, "charge", {"order": order, "amount": amount})


def _echoes(secret: str) -> list[str]:
    raw = secret.encode()
    return [secret, quote(secret, safe=""), base64.b64encode(raw).decode()]


# --- MEDIUM: arguments as a JSON object on the wire -----------------------------------------


async def test_openai_arguments_sent_as_an_object_are_answered_not_a_paid_retry_loop(
    model_server: ModelServer, tmp_path: Path
) -> None:
    shop = Shop()
    body = OPENAI.turn(None, [charge_call("c1", 5)])
    body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = {
        "order": 5,
        "amount": 10,
    }
    model_server.queue(body, OPENAI.turn("Charged."))
    async with sqlite(tmp_path) as stores:
        provider = OPENAI.provider(model_server, prices=PRICE, max_retries=0)
        try:
            runner = AgentRunner.from_stores(provider, stores)
            run = await runner.run(shop.agent(), "charge 5", tenant=TENANT, run_id="r1")
        finally:
            await provider.aclose()
        assert run.status is RunStatus.completed
        # Sent once (read as its arguments) or answered as malformed: never twice.
        assert shop.charges in ([], [(5, 10)])
        assert await stores.ledger.spent(TENANT, "r1") == 2 * PER_CALL


# --- 429 / overloaded through a Worker on SQLite --------------------------------------------


async def test_a_429_with_the_key_echoed_stops_retryably_and_a_worker_finishes_charging_once(
    vendor: Vendor,
    model_server: ModelServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    shop = Shop()
    agent = shop.agent()
    echoed = "rate limited for key " + " / ".join(_echoes(KEY))
    busy = [vendor.error(429, echoed)]
    if vendor.name == "anthropic":
        busy.append(vendor.error(529, "Overloaded: " + echoed))
    else:
        busy.append(vendor.error(429, echoed))
    model_server.queue(vendor.turn(None, [charge_call("c1", 5)]), *busy)
    async with sqlite(tmp_path) as stores:
        provider = vendor.provider(model_server, api_key=KEY, prices=PRICE, max_retries=1)
        try:
            runner = AgentRunner.from_stores(provider, stores)
            with pytest.raises(ProviderError) as stopped:
                await runner.run(agent, "charge 5", tenant=TENANT, run_id="r1")
            assert stopped.value.retryable
            assert shop.charges == [(5, 10)]
            assert await stores.ledger.spent(TENANT, "r1") == PER_CALL
            for form in _echoes(KEY):
                assert form not in str(stopped.value)
            # Resumed later, the call is not sent again.
            model_server.queue(vendor.turn("Charged."))
            done = await runner.resume(agent, "r1", tenant=TENANT)
            assert done.status is RunStatus.completed
            # A worker meets the same 429s, retries after its backoff and finishes.
            await runner.submit(agent, "charge 6", tenant=TENANT, run_id="r2")
            # A worker's take calls the plain endpoint, as run() does (see the worker test).
            model_server.queue(
                *busy, vendor.turn(None, [charge_call("c1", 6)]), vendor.turn("Charged 6.")
            )
            for _ in range(100):
                worker = Worker(
                    runner,
                    [agent],
                    exit_when_idle=True,
                    poll_interval=0.01,
                    backoff=Backoff(base=0.01, cap=0.02),
                )
                await worker.run()
                if model_server.pending == 0 and (6, 10) in shop.charges:
                    break
                await asyncio.sleep(0.02)
        finally:
            await provider.aclose()
        assert sorted(shop.charges) == [(5, 10), (6, 10)]
        assert await stores.ledger.spent(TENANT, "r1") == 2 * PER_CALL
        assert await stores.ledger.spent(TENANT, "r2") == 2 * PER_CALL
    assert model_server.pending == 0 and model_server.unexpected == 0
    stored = every_byte(tmp_path)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "trying again" in logged  # the worker did retry r2 past its 429s
    for form in _echoes(KEY):
        assert form.encode() not in stored
        assert form not in logged


# --- a reply lost mid-body ------------------------------------------------------------------


class LosingTransport:
    """Answers with the queued bodies; a body marked ``lost`` breaks half way through."""

    def __init__(self, vendor: Vendor) -> None:
        self.vendor = vendor
        self.replies: list[tuple[dict[str, Any], bool]] = []
        self.requests: list[dict[str, Any]] = []

    def queue(self, body: dict[str, Any], *, lost: bool = False) -> None:
        self.replies.append((body, lost))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(json.loads(request.content))
        body, lost = self.replies.pop(0)
        payload = json.dumps(body).encode()
        headers = {"content-type": "application/json", "content-length": str(len(payload))}
        if not lost:
            return httpx.Response(200, content=payload, headers=headers)
        return httpx.Response(200, stream=_HalfBody(payload), headers=headers)

    def provider(self, *, max_retries: int) -> SDKProvider:
        http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))
        if self.vendor.name == "openai":
            return OpenAIProvider(
                self.vendor.model,
                client=openai.AsyncOpenAI(
                    api_key=KEY,
                    base_url="http://model.test/v1",
                    http_client=http,
                    max_retries=max_retries,
                ),
                prices=PRICE,
            )
        return AnthropicProvider(
            self.vendor.model,
            client=anthropic.AsyncAnthropic(
                api_key=KEY, base_url="http://model.test", http_client=http, max_retries=max_retries
            ),
            prices=PRICE,
        )


class _HalfBody(httpx.AsyncByteStream):
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.payload[: len(self.payload) // 2]
        raise httpx.ReadError("connection reset mid-body")


async def test_a_reply_lost_mid_body_is_asked_again_and_the_keyed_call_runs_once(
    vendor: Vendor, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    wire = LosingTransport(vendor)
    asks = vendor.turn(None, [charge_call("c1", 5)])
    wire.queue(asks, lost=True)
    async with sqlite(tmp_path) as stores:
        provider = wire.provider(max_retries=0)
        runner = AgentRunner.from_stores(provider, stores)
        with pytest.raises(ProviderError) as lost:
            await runner.run(agent, "charge 5", tenant=TENANT, run_id="r1")
        assert lost.value.retryable
        assert shop.charges == [] and await stores.ledger.spent(TENANT, "r1") == 0
        # No frontier yet: run() again (README), in a new "process": answered, the call
        # runs; the next reply is lost after it.
        wire.queue(vendor.turn(None, [charge_call("c9", 5)]))
        wire.queue(vendor.turn("Charged."), lost=True)
        with pytest.raises(ProviderError):
            await AgentRunner.from_stores(wire.provider(max_retries=0), stores).run(
                agent, "charge 5", tenant=TENANT, run_id="r1"
            )
        assert shop.charges == [(5, 10)]
        wire.queue(vendor.turn("Charged."))
        run = await AgentRunner.from_stores(wire.provider(max_retries=0), stores).resume(
            agent, "r1", tenant=TENANT
        )
        assert run.status is RunStatus.completed and run.output == "Charged."
        assert shop.charges == [(5, 10)]
        assert await stores.ledger.spent(TENANT, "r1") == 2 * PER_CALL
    assert not wire.replies
    assert KEY.encode() not in every_byte(tmp_path)


async def test_the_sdks_own_retry_of_a_lost_body_sends_the_call_once(
    vendor: Vendor, tmp_path: Path
) -> None:
    shop = Shop()
    wire = LosingTransport(vendor)
    asks = vendor.turn(None, [charge_call("c1", 5)])
    wire.queue(asks, lost=True)
    wire.queue(asks)
    wire.queue(vendor.turn("Charged."), lost=True)
    wire.queue(vendor.turn("Charged."))
    async with sqlite(tmp_path) as stores:
        runner = AgentRunner.from_stores(wire.provider(max_retries=2), stores)
        run = await runner.run(shop.agent(), "charge 5", tenant=TENANT, run_id="r1")
        assert run.status is RunStatus.completed
        assert shop.charges == [(5, 10)]
        assert await stores.ledger.spent(TENANT, "r1") == 2 * PER_CALL
    assert len(wire.requests) == 4 and not wire.replies


# --- call ids -------------------------------------------------------------------------------


class DiesOnCall:
    """A provider that dies (the process) when asked for the ``n``-th time."""

    def __init__(self, inner: SDKProvider, n: int) -> None:
        self.inner, self.n, self.asked = inner, n, 0

    async def complete(self, request: ModelRequest) -> Any:
        self.asked += 1
        if self.asked == self.n:
            raise SimulatedCrash("died while the model thought")
        return await self.inner.complete(request)


def _results_in_order(vendor: Vendor, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(call id, result content) of every tool result of a request, in order."""
    if vendor.name == "openai":
        return [(m["tool_call_id"], m["content"]) for m in body["messages"] if m["role"] == "tool"]
    return [
        (b["tool_use_id"], b["content"])
        for m in body["messages"]
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    ]


async def test_call_ids_reused_every_turn_pair_their_results_across_a_crash(
    vendor: Vendor, model_server: ModelServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    model_server.queue(
        vendor.turn(None, [charge_call("call_0_0", 5)]),
        vendor.turn(None, [charge_call("call_0_0", 6)]),
    )
    async with sqlite(tmp_path) as stores:
        provider = vendor.provider(model_server, api_key=KEY, prices=PRICE)
        try:
            dying = DiesOnCall(provider, 3)
            with pytest.raises(SimulatedCrash):
                await AgentRunner.from_stores(dying, stores, lease_policy=SHORT).run(
                    agent, "charge 5 then 6", tenant=TENANT, run_id="r1"
                )
            assert shop.charges == [(5, 10), (6, 10)]
            model_server.queue(vendor.turn("Both charged."))
            again = vendor.provider(model_server, api_key=KEY, prices=PRICE)
            try:
                runner = AgentRunner.from_stores(again, stores, lease_policy=SHORT)
                run = await _resume_when_free(runner, agent)
            finally:
                await again.aclose()
        finally:
            await provider.aclose()
        assert run.status is RunStatus.completed
        assert shop.charges == [(5, 10), (6, 10)]
        assert await stores.ledger.spent(TENANT, "r1") == 3 * PER_CALL
    last = model_server.bodies[-1]
    assert _results_in_order(vendor, last) == [
        ("call_0_0", "charged order 5"),
        ("call_0_0", "charged order 6"),
    ]


async def _resume_when_free(runner: AgentRunner, agent: Agent) -> Any:
    """Resume once the dead attempt's lease lapsed (its ttl is ``SHORT``)."""
    for _ in range(200):
        try:
            return await runner.resume(agent, "r1", tenant=TENANT)
        except LeaseHeldError:
            await asyncio.sleep(0.05)
    raise AssertionError("the dead attempt's lease never lapsed")


# --- a worker's take and the wire -----------------------------------------------------------


async def test_a_workers_take_calls_the_same_endpoint_as_run(
    vendor: Vendor, model_server: ModelServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    # The same turns, as the plain endpoint answers them: a server that only speaks that
    # one (or ignores ``stream``) gives a worker's take what run() got.
    async with sqlite(tmp_path) as stores:
        provider = vendor.provider(model_server, prices=PRICE)
        try:
            runner = AgentRunner.from_stores(provider, stores)
            model_server.queue(vendor.turn(None, [charge_call("c1", 5)]), vendor.turn("Done."))
            first = await runner.run(agent, "charge 5", tenant=TENANT, run_id="r1")
            assert first.output == "Done."
            assert not any(b.get("stream") for b in model_server.bodies)
            await runner.submit(agent, "charge 6", tenant=TENANT, run_id="r2")
            before = len(model_server.requests)
            model_server.queue(vendor.turn(None, [charge_call("c1", 6)]), vendor.turn("Done."))
            worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
            await worker.run()
        finally:
            await provider.aclose()
    streamed = [b.get("stream") for b in model_server.bodies[before:]]
    assert not any(streamed), f"a worker's take asked for a stream: {streamed}"
    assert shop.charges == [(5, 10), (6, 10)]


# --- malformed replies ----------------------------------------------------------------------


async def test_malformed_arguments_and_unknown_tools_are_answered_and_the_run_completes(
    vendor: Vendor, model_server: ModelServer, tmp_path: Path
) -> None:
    shop = Shop()
    odd: list[tuple[str, str, Any]] = [
        ("a1", "charge", "[5, 10]"),
        ("a2", "charge", '"order 5"'),
        ("a3", "charge", '{"order": 5, "amount": '),
        ("a4", "charge", {"order": 5, "amount": 10, "memo": "x" * 200_000}),
        ("a5", "refund", {"order": 5}),
        ("a6", "charge", {"order": 7, "amount": 3}),
    ]
    model_server.queue(vendor.turn(None, odd), vendor.turn("Done."))
    async with sqlite(tmp_path) as stores:
        provider = vendor.provider(model_server, prices=PRICE)
        try:
            runner = AgentRunner.from_stores(provider, stores)
            run = await runner.run(shop.agent(), "charge", tenant=TENANT, run_id="r1")
        finally:
            await provider.aclose()
        assert run.status is RunStatus.completed and run.output == "Done."
        assert await stores.ledger.spent(TENANT, "r1") == 2 * PER_CALL
    # Only the one well-formed call went out (the huge one is refused by its extra field).
    assert shop.charges == [(7, 3)]
    results = _results_in_order(vendor, model_server.bodies[-1])
    assert [i for i, _ in results] == ["a1", "a2", "a3", "a4", "a5", "a6"]
    assert results[-1][1] == "charged order 7"
