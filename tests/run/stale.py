"""The rig of the attacks on a stale attempt (one whose lease lapsed while it waited on a
slow store): a store view that holds one attempt's replies back, a short lease ttl, and a
runner over such views."""

from __future__ import annotations

import asyncio
from typing import Any

from tesserix_adk import AgentRunner, LeasePolicy
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.run.cancelling import cancel_key
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

__all__ = ["POLICY", "TTL", "Late", "runner_over"]

TTL = 0.5
POLICY = LeasePolicy(ttl=TTL, renew_within=TTL / 2)


class Late:
    """One attempt's view of a store. Once ``stall`` is set its lease renewals and resume
    claim renewals hang until ``healed`` (a network holding its replies back); a read of
    the run's cancel request made while ``gate_cancel`` is armed waits on ``gate`` first
    (and sets ``stall``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stall = False
        self.healed = asyncio.Event()
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()
        self.gate_cancel: asyncio.Event | None = None
        self.gate_records = False
        self.gate_lookup = False
        self.die_at_claim = False
        self.partner: Late | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _stall_now(self) -> None:
        self.stall = True
        if self.partner is not None:
            self.partner.stall = True

    async def claim(self, key: str, **kw: Any) -> Any:
        if kw.get("tool") is not None and self.die_at_claim:
            self.die_at_claim = False
            raise SimulatedCrash  # a death right before the call's claim
        if kw.get("tool") is None and self.stall:
            await self.healed.wait()  # the resume claim's renewal comes back late
        return await self.inner.claim(key, **kw)

    async def renew(self, lease: Any, ttl: float) -> Any:
        if self.stall:
            await self.healed.wait()
        return await self.inner.renew(lease, ttl)

    async def lookup(self, keys: Any, *, tenant: str) -> Any:
        armed = self.gate_cancel
        if armed is not None and armed.is_set() and cancel_key(tenant, "r") in keys:
            self.gate_cancel = None
            self._stall_now()
            self.reading.set()
            await self.gate.wait()
        elif self.gate_lookup and not {cancel_key(tenant, "r"), run_claim_key(tenant, "r")} & set(
            keys
        ):
            self.gate_lookup = False
            self._stall_now()
            self.reading.set()
            await self.gate.wait()  # the plan's read is made late
        return await self.inner.lookup(keys, tenant=tenant)

    async def records(self, tenant: str, run_id: str) -> Any:
        if self.gate_records:
            self.gate_records = False
            self._stall_now()
            self.reading.set()
            await self.gate.wait()  # the read is made late, after another holder's claim
        return await self.inner.records(tenant, run_id)

    def heal(self) -> None:
        self.gate.set()
        self.healed.set()
        if self.partner is not None:
            self.partner.healed.set()


def runner_over(stores: Stores, model: Any, idempotency: Any, leases: Any) -> AgentRunner:
    runner = AgentRunner.from_stores(model, stores, lease_policy=POLICY, resume_claim_ttl=TTL)
    runner.idempotency = idempotency
    runner.leases = leases
    return runner
