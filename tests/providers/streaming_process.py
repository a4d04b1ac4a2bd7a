"""A process that streams a run, or its resume, against the fake model server.

    python tests/providers/streaming_process.py STORE VENDOR BASE_URL RUN_ID stream|resume

It prints each event on a line of its own as it arrives (``TextDelta <iteration>``,
``FrontierWritten <step> <boundary>``, ``RunFinished <status>``, ...), so a test can SIGKILL
it at an exact point of the stream. The booking agent is the demo's: its airline is a
SQLite file (``ADK_DEMO_AIRLINE``), so bookings outlive the process.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import aclosing

from tesserix_adk import AgentRunner
from tesserix_adk.cli.demo_agent import agent
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.run.events import FrontierWritten, RunEvent, RunFinished, TextDelta
from tesserix_adk.stores.urls import open_stores

TENANT = "demo"


def line(event: RunEvent) -> str:
    if isinstance(event, TextDelta):
        return f"TextDelta {event.iteration}"
    if isinstance(event, FrontierWritten):
        return f"FrontierWritten {event.step} {event.boundary}"
    if isinstance(event, RunFinished):
        return f"RunFinished {event.run.status} {event.run.output}"
    return type(event).__name__


async def main(store: str, vendor: str, base_url: str, run_id: str, verb: str) -> None:
    provider: OpenAIProvider | AnthropicProvider
    if vendor == "openai":
        provider = OpenAIProvider("openai:gpt-4o", base_url=base_url + "/v1", api_key="test-key")
    else:
        provider = AnthropicProvider("anthropic:claude-haiku-4-5", base_url=base_url, api_key="k")
    async with provider, open_stores(store) as stores:
        # A ttl a busy machine (the suite's other worker, its subprocesses) cannot starve
        # the renewal of: a lost lease stops the resume before its last frontier.
        runner = AgentRunner.from_stores(
            provider, stores, lease_policy=LeasePolicy(ttl=3.0, renew_within=1.5)
        )
        stream = (
            runner.stream(agent, "book me FRA to JFK", tenant=TENANT, run_id=run_id)
            if verb == "stream"
            else runner.stream_resume(agent, run_id, tenant=TENANT)
        )
        async with aclosing(stream) as events:
            async for event in events:
                print(line(event), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
