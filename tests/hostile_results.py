"""Tool results that try to hold up the event loop, shared by the tests that throw them
at the kit: a run of one read-only call under a short lease, and a value that notes
whether it was written on the event loop's thread."""

from __future__ import annotations

import asyncio
from typing import Any

from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, open_stores, tool

SHORT_LEASE = LeasePolicy(ttl=0.5, renew_within=0.25)


async def run_under_short_lease(value: Any) -> Any:
    """A run whose one read-only tool returns ``value``, under ``SHORT_LEASE``: the run,
    or the error it ended with (a lost lease among them)."""

    @tool(side_effects=False)
    def listing(n: str) -> Any:
        """List everything."""
        return value

    async with open_stores("memory://") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("listing", {"n": "1"})], "ok"]), stores, lease_policy=SHORT_LEASE
        )
        try:
            return await runner.run(Agent("a", "x", [listing]), "go", tenant="t", run_id="r")
        except Exception as exc:
            return exc


class Witness:
    """A value pydantic cannot write: its ``str`` (the fallback) notes in ``seen`` whether
    it ran on the thread of a running event loop, where a result of millions of such items
    holds the loop (and its lease renewals) for as long as they take."""

    def __init__(self, seen: list[bool]) -> None:
        self.seen = seen

    def __str__(self) -> str:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.seen.append(False)
        else:
            self.seen.append(True)
        return "w"
