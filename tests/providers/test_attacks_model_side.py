"""An attacker's tries at the model side: providers, streaming, retries, the ledger, budgets.

The real ``openai`` and ``anthropic`` SDKs talk HTTP to the fake model server on loopback
(``fake_server.ModelServer``); one test SIGKILLs a real process right after its model call
was charged. Effects are counted (transfers made, ledger micros, requests the vendor saw),
never timed. A strict xfail is a defect found (its reason names it); a plain test is a
promise that held.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anthropic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    ProviderError,
    RunStatus,
    open_stores,
    tool,
)
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.pricing import Price
from tesserix_adk.run.events import RunEvent, RunFinished
from tesserix_adk.run.result import Run

from .fake_server import ModelServer, Reply, anthropic_error, openai_completion
from .vendors import ANTHROPIC, OPENAI, SDKProvider, Vendor

NewProvider = Callable[..., SDKProvider]

# One micro per token: a reply of 120 + 30 tokens costs 150 micros.
PRICE = Price(input_per_million_micros=1_000_000, output_per_million_micros=1_000_000)
PER_CALL = 150
UNKNOWN_SHAPE_TOKEN = "tsx-gw-Hq3Vb8Rt5Ym2Kp9Wz4Lc"


class Bank:
    """The outside world: every transfer it was asked to make."""

    def __init__(self) -> None:
        self.transfers: list[int] = []

    def agent(self, **kwargs: Any) -> Agent:
        @tool
        def transfer(amount: int) -> str:
            """Send money (side-effecting)."""
            self.transfers.append(amount)
            return f"sent {amount}"

        return Agent("bank", "Pay what the user asks.", [transfer], **kwargs)


class World:
    """One tenant's stores, shared by every "process" (runner) of a test."""

    def __init__(self) -> None:
        self.idempotency = MemoryIdempotencyStore()
        self.store = MemoryCheckpointStore()
        self.history = MemoryHistoryStore()
        self.leases = MemoryLeaseStore()
        self.ledger = MemoryLedger()

    def runner(self, provider: Any) -> AgentRunner:
        return AgentRunner(
            provider,
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store, history=self.history),
            leases=self.leases,
            ledger=self.ledger,
        )

    def every_byte(self) -> bytes:
        seen: set[int] = set()
        out: list[bytes] = []

        def walk(value: Any, depth: int = 0) -> None:
            if depth > 12 or id(value) in seen:
                return
            seen.add(id(value))
            if isinstance(value, bytes | bytearray):
                out.append(bytes(value))
            elif isinstance(value, str):
                out.append(value.encode("utf-8", "surrogatepass"))
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(k, depth + 1)
                    walk(v, depth + 1)
            elif isinstance(value, list | tuple | set | frozenset):
                for v in value:
                    walk(v, depth + 1)
            elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
                names = list(getattr(value, "__dict__", {}))
                for cls in type(value).__mro__:
                    names += list(getattr(cls, "__slots__", ()))
                for name in names:
                    walk(getattr(value, name, None), depth + 1)

        for store in (self.store, self.history, self.idempotency, self.leases, self.ledger):
            walk(store)
        return b"\n".join(out)


async def _run(runner: AgentRunner, agent: Agent, run_id: str, *, streamed: bool) -> Run:
    if not streamed:
        return await runner.run(agent, "pay", tenant="acme", run_id=run_id)
    last: RunEvent | None = None
    async with aclosing(runner.stream(agent, "pay", tenant="acme", run_id=run_id)) as events:
        async for event in events:
            last = event
    assert isinstance(last, RunFinished)
    return last.run


MODES = pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])


# --- charged once: SDK retries, cut streams ---------------------------------------------------


@MODES
async def test_a_call_the_sdk_retried_after_5xx_and_429_is_charged_once(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, streamed: bool
) -> None:
    bank, world = Bank(), World()
    answer = vendor.streamed if streamed else vendor.turn
    model_server.queue(
        vendor.error(500),
        vendor.error(429),
        answer(calls=[("call_1", "transfer", {"amount": 7})]),
        vendor.error(503),
        answer("Sent 7."),
    )
    run = await _run(
        world.runner(new_provider(prices=PRICE, max_retries=2)),
        bank.agent(),
        "r1",
        streamed=streamed,
    )
    assert (run.status, run.output) == (RunStatus.completed, "Sent 7.")
    assert len(model_server.requests) == 5  # three errors the SDK retried by itself
    assert bank.transfers == [7]
    assert await world.ledger.spent("acme", "r1") == 2 * PER_CALL  # the two answers only
    assert run.spent_micros == 2 * PER_CALL


def _before_usage(vendor: Vendor) -> int:
    """How many frames of a streamed reply come before its usage (OpenAI's usage chunk,
    Anthropic's ``message_delta``): both are the last but one frame."""
    return len(vendor.streamed(calls=[("call_1", "transfer", {"amount": 5})]).events) - 2


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
@pytest.mark.parametrize("vendor", [OPENAI, ANTHROPIC], ids=["openai", "anthropic"])
async def test_a_stream_cut_anywhere_before_its_usage_sends_no_call_and_charges_nothing(
    vendor: Vendor, model_server: ModelServer, data: st.DataObject
) -> None:
    """Whatever frame the stream is cut after (calls named, arguments half sent, the
    finish reason in), no call of it is sent; the retry carries the run on, one transfer."""
    cut = data.draw(st.integers(min_value=1, max_value=_before_usage(vendor)), label="cut")
    bank, world = Bank(), World()
    calls = [("call_1", "transfer", {"amount": 5}), ("call_2", "transfer", {"amount": 6})]
    model_server.queue(vendor.streamed(calls=calls, cut_after=cut))
    provider = vendor.provider(model_server, prices=PRICE, max_retries=0)
    try:
        with pytest.raises(ProviderError) as err:
            await _run(world.runner(provider), bank.agent(), "r1", streamed=True)
        assert err.value.retryable
        assert bank.transfers == []
        assert await world.ledger.spent("acme", "r1") == 0
        model_server.queue(vendor.streamed(calls=calls), vendor.streamed("Sent 5 and 6."))
        # No frontier was written: the same run() is asked again.
        run = await _run(world.runner(provider), bank.agent(), "r1", streamed=True)
    finally:
        await provider.aclose()
    assert (run.status, run.output) == (RunStatus.completed, "Sent 5 and 6.")
    assert bank.transfers == [5, 6]
    assert await world.ledger.spent("acme", "r1") == 2 * PER_CALL


async def test_a_stream_cut_after_its_usage_counts_against_the_budget(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    bank, world = Bank(), World()
    frames = vendor.streamed(calls=[("call_1", "transfer", {"amount": 5})]).events
    # Everything but the last frame: the finish reason and the usage are in.
    model_server.queue(
        vendor.streamed(calls=[("call_1", "transfer", {"amount": 5})], cut_after=len(frames) - 1)
    )
    agent = bank.agent(budget_micros=PER_CALL)
    runner = world.runner(new_provider(prices=PRICE, max_retries=0))
    with pytest.raises(ProviderError):
        await _run(runner, agent, "r1", streamed=True)
    assert len(model_server.requests) == 1
    # The vendor billed that reply (its usage came): the retry must find the budget spent.
    model_server.queue(vendor.streamed(calls=[("call_1", "transfer", {"amount": 5})]))
    model_server.queue(vendor.streamed("Sent 5."))
    run = await _run(runner, agent, "r1", streamed=True)
    assert await world.ledger.spent("acme", "r1") >= PER_CALL * (len(model_server.requests))
    assert run.status is RunStatus.budget_exhausted
    assert len(model_server.requests) == 1


async def test_a_billed_but_unreadable_reply_counts_against_the_budget(
    model_server: ModelServer,
) -> None:
    bank, world = Bank(), World()
    body = openai_completion(None, [("call_1", "transfer", {"amount": 5})])
    # A call whose function is no object: the SDK builds it unchecked, the reply unreadable.
    # (Arguments sent as an object, not as text, are read as those arguments.)
    body["choices"][0]["message"]["tool_calls"][0]["function"] = 5
    model_server.queue(body, body, body)
    provider = OPENAI.provider(model_server, prices=PRICE, max_retries=0)
    agent = bank.agent(budget_micros=PER_CALL)
    attempts: list[bool] = []
    try:
        for _ in range(3):  # a worker retrying a retryable stop
            try:
                await world.runner(provider).run(agent, "pay", tenant="acme", run_id="r1")
                break
            except ProviderError as exc:
                attempts.append(exc.retryable)
    finally:
        await provider.aclose()
    assert bank.transfers == []
    # Three replies with usage were paid for; the budget allowed one.
    assert len(model_server.requests) == 1 or await world.ledger.spent("acme", "r1") >= (
        PER_CALL * len(model_server.requests)
    )


async def test_a_plain_completion_without_usage_is_not_taken_as_free(
    model_server: ModelServer,
) -> None:
    bank, world = Bank(), World()
    body = openai_completion("Done.")
    body["usage"] = None
    model_server.queue(body)
    provider = OPENAI.provider(model_server, prices=PRICE, max_retries=0)
    try:
        run = await world.runner(provider).run(
            bank.agent(budget_micros=PER_CALL), "pay", tenant="acme", run_id="r1"
        )
    finally:
        await provider.aclose()
    # As streamed (require_stream_usage=True), a reply without its usage is not taken
    # whole; and since asking again would pay again for a call the ledger cannot count,
    # the run stops, saying why, rather than be carried on for free.
    assert run.status is RunStatus.failed, run.status
    assert "without its usage" in str(run.output), run.output


# --- the vendor's stop reasons ---------------------------------------------------------------

STOPS = [
    (OPENAI, "finish_reason", "tool_calls", "content_filter"),
    (ANTHROPIC, "stop_reason", "tool_use", "refusal"),
    (ANTHROPIC, "stop_reason", "tool_use", "model_context_window_exceeded"),
]


@MODES
@pytest.mark.parametrize(("vendor", "field", "whole", "cut"), STOPS, ids=[s[3] for s in STOPS])
async def test_calls_of_a_refused_or_filtered_reply_are_never_sent(
    model_server: ModelServer,
    vendor: Vendor,
    field: str,
    whole: str,
    cut: str,
    streamed: bool,
) -> None:
    bank, world = Bank(), World()
    calls = [("call_1", "transfer", {"amount": 10})]
    old, new = f'"{field}": "{whole}"', f'"{field}": "{cut}"'
    if streamed:
        frames = [f.replace(old, new) for f in vendor.streamed(None, calls).events]
        assert any(new in f for f in frames)
        model_server.queue(Reply(events=frames), vendor.streamed("Stopped."))
    else:
        body = json.dumps(vendor.turn(None, calls)).replace(old, new)
        assert new in body
        model_server.queue(Reply(body=body), vendor.turn("Stopped."))
    provider = vendor.provider(model_server, prices=PRICE, max_retries=0)
    try:
        run = await _run(world.runner(provider), bank.agent(), "r1", streamed=streamed)
    finally:
        await provider.aclose()
    assert (run.status, bank.transfers) == (RunStatus.completed, [])
    told, _ = vendor.tool_results(model_server.bodies[1])["call_1"]
    assert "not sent" in told
    assert await world.ledger.spent("acme", "r1") == 2 * PER_CALL


# --- tool-call ids the vendor makes up ------------------------------------------------------


@pytest.mark.parametrize("ids", [("", ""), ("x", "x"), ("", "y")], ids=["empty", "dup", "one"])
async def test_empty_or_duplicated_call_ids_are_each_sent_once_and_answered(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, ids: tuple[str, str]
) -> None:
    bank, world = Bank(), World()
    calls = [(ids[0], "transfer", {"amount": 1}), (ids[1], "transfer", {"amount": 2})]
    model_server.queue(vendor.turn(calls=calls), vendor.turn("Paid."))
    run = await world.runner(new_provider(prices=PRICE, max_retries=0)).run(
        bank.agent(), "pay", tenant="acme", run_id="r1"
    )
    assert run.status is RunStatus.completed
    assert sorted(bank.transfers) == [1, 2]
    assert await world.ledger.spent("acme", "r1") == 2 * PER_CALL
    sent_back = json.dumps(model_server.bodies[1])
    assert "sent 1" in sent_back and "sent 2" in sent_back


# --- secrets in a vendor's error body -------------------------------------------------------


@pytest.mark.parametrize("how", ["client", "environment"])
async def test_an_echoed_anthropic_auth_token_is_never_stored(
    model_server: ModelServer, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    bank, world = Bank(), World()
    model_server.queue(
        anthropic_error(401, f"invalid credentials {UNKNOWN_SHAPE_TOKEN}", "authentication_error")
    )
    if how == "client":
        client = anthropic.AsyncAnthropic(
            auth_token=UNKNOWN_SHAPE_TOKEN, base_url=model_server.url, max_retries=0
        )
        provider = AnthropicProvider("anthropic:claude-haiku-4-5", client=client)
    else:
        monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", UNKNOWN_SHAPE_TOKEN)
        provider = AnthropicProvider(
            "anthropic:claude-haiku-4-5", base_url=model_server.url, max_retries=0
        )
    try:
        run = await world.runner(provider).run(bank.agent(), "pay", tenant="acme", run_id="r1")
    finally:
        await provider.aclose()
        if how == "client":
            await client.close()
    assert UNKNOWN_SHAPE_TOKEN in model_server.requests[0].headers.get("authorization", "")
    assert run.status is RunStatus.failed
    assert UNKNOWN_SHAPE_TOKEN.encode() not in world.every_byte()  # the stores first
    assert UNKNOWN_SHAPE_TOKEN not in (run.output or "")


async def test_an_echoed_api_key_is_never_stored(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    bank, world = Bank(), World()
    model_server.queue(vendor.error(401, f"invalid key {UNKNOWN_SHAPE_TOKEN}"))
    run = await world.runner(new_provider(api_key=UNKNOWN_SHAPE_TOKEN, max_retries=0)).run(
        bank.agent(), "pay", tenant="acme", run_id="r1"
    )
    assert run.status is RunStatus.failed
    assert "[redacted:api_key]" in (run.output or "")
    assert b"[redacted:api_key]" in world.every_byte()  # the walk reaches the failed frontier
    assert UNKNOWN_SHAPE_TOKEN.encode() not in world.every_byte()


async def test_a_placeholder_key_does_not_mangle_the_vendors_error_text(
    model_server: ModelServer,
) -> None:
    model_server.queue(
        OPENAI.error(400, "Unrecognized request argument supplied: unused_tools_hint")
    )
    bank, world = Bank(), World()
    provider = OPENAI.provider(model_server, api_key="unused", max_retries=0)
    try:
        run = await world.runner(provider).run(bank.agent(), "pay", tenant="acme", run_id="r1")
    finally:
        await provider.aclose()
    assert run.status is RunStatus.failed
    assert "unused_tools_hint" in (run.output or ""), run.output


# --- SIGKILL after the charge, before the after_model_call frontier ---------------------------

AGENT_MODULE = '''
import os
from tesserix_adk import Agent, tool


@tool
def transfer(amount: int) -> str:
    """Send money (side-effecting)."""
    with open(os.environ["BANK_FILE"], "a") as bank:
        bank.write(f"{amount}\\n")
    return f"sent {amount}"


def agent(budget):
    return Agent("bank", "Pay what the user asks.", [transfer], budget_micros=budget)
'''

CHILD = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from payagent import agent
from tesserix_adk import AgentRunner, open_stores
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.providers.pricing import Price

async def main(store, url, budget):
    price = Price(input_per_million_micros=1_000_000, output_per_million_micros=1_000_000)
    provider = OpenAIProvider("gpt-4o", base_url=url + "/v1", api_key="k-child", prices=price,
                              max_retries=0)
    async with provider, open_stores(store) as stores:
        await stores.create_schema()
        ledger = stores.ledger
        charge = ledger.charge

        made = []

        async def charged(*args, **kwargs):
            await charge(*args, **kwargs)
            made.append(args)
            if len(made) == 2:
                print("CHARGED", flush=True)
                await asyncio.sleep(3600)  # killed here: charged, no after_model_call frontier

        ledger.charge = charged
        runner = AgentRunner.from_stores(
            provider, stores, lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0)
        )
        await runner.run(agent(budget), "pay", tenant="acme", run_id="r1")

asyncio.run(main(sys.argv[2], sys.argv[3], None if sys.argv[4] == "none" else int(sys.argv[4])))
"""


def _load_agent(directory: Path) -> Any:
    spec = importlib.util.spec_from_file_location("payagent", directory / "payagent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kill_once_charged(argv: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Start the child, wait for its CHARGED line, SIGKILL it: its first line and stderr."""
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(60, proc.kill)  # a child stuck before the kill point fails
    watchdog.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
    finally:
        watchdog.cancel()
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL, err
    return line, err


async def _resume_when_lapsed(runner: AgentRunner, agent: Agent) -> Run:
    for _ in range(100):
        try:
            return await runner.resume(agent, "r1", tenant="acme")
        except ResumeConflictError:
            await asyncio.sleep(0.3)
    raise AssertionError("the dead process's lease never lapsed")


@pytest.mark.parametrize("budget", [None, 2 * PER_CALL], ids=["no-budget", "budget-two-calls"])
async def test_sigkill_after_the_charge_resumes_charging_each_call_once_within_budget(
    model_server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    (tmp_path / "payagent.py").write_text(AGENT_MODULE)
    bank_file = tmp_path / "bank.txt"
    bank_file.touch()
    monkeypatch.setenv("BANK_FILE", str(bank_file))
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    # Turn 1 asks for a transfer; the child dies once turn 2's reply is charged.
    model_server.queue(
        openai_completion(None, [("call_1", "transfer", {"amount": 9})]),
        openai_completion(None, [("call_2", "transfer", {"amount": 4})]),
    )
    line, err = _kill_once_charged(
        [
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path),
            store,
            model_server.url,
            str(budget or "none"),
        ],
        {**os.environ, "BANK_FILE": str(bank_file)},
    )
    assert line == "CHARGED", err
    assert bank_file.read_text().split() == ["9"]

    module = _load_agent(tmp_path)
    agent = module.agent(budget)
    # The resume asks the model again (the answer was never checkpointed) unless the
    # budget the dead process spent is already used up.
    model_server.queue(
        openai_completion(None, [("call_2", "transfer", {"amount": 4})]),
        openai_completion("Sent 9 and 4."),
    )
    provider = OPENAI.provider(model_server, prices=PRICE, max_retries=0)
    try:
        async with open_stores(store) as stores:
            run = await _resume_when_lapsed(AgentRunner.from_stores(provider, stores), agent)
            spent = await stores.ledger.spent("acme", "r1")
    finally:
        await provider.aclose()
    asked = len(model_server.requests)
    assert spent == asked * PER_CALL  # every model call made is charged, each once
    if budget is None:
        assert (run.status, run.output) == (RunStatus.completed, "Sent 9 and 4.")
        assert bank_file.read_text().split() == ["9", "4"]
        assert asked == 4
    else:
        # The dead process spent the budget: the resume counts it and asks nothing more.
        assert run.status is RunStatus.budget_exhausted
        assert asked == 2
        assert bank_file.read_text().split() == ["9"]
