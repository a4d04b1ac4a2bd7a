"""Idempotency records: which calls were claimed and what they produced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

__all__ = ["IdempotencyRecord", "IdempotencyStore", "RecordStatus", "RecordsFrom", "ToolFlags"]


class RecordStatus(StrEnum):
    """Where an idempotency record stands."""

    in_flight = "in_flight"
    completed = "completed"
    never_ran = "never_ran"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolFlags:
    """The flags of the tool a record belongs to, so planning needs no agent."""

    side_effects: bool = True
    idempotent: bool = False

    @property
    def safe_to_resend(self) -> bool:
        """A call of this tool may be sent again when nobody knows whether it ran."""
        return not self.side_effects or self.idempotent


@dataclass(frozen=True, slots=True, kw_only=True)
class IdempotencyRecord:
    """One claim: a tool call's (``tool`` set) or a run's resume claim (``tool`` is ``None``).

    ``since``, ``completed_at`` and ``expires_at`` are the store's clock (epoch seconds).
    ``outcome`` is bytes the kit encoded and redacted. ``by`` is who settled the call by
    hand (an operator, or ``reconciler:<tool>``); ``never_ran_by`` is who last said it never
    ran before it was claimed again, kept for the audit since that word let it go out again.

    ``run_id``, ``iteration`` and ``call_id`` say whose call it is: the run that claimed it
    first, whose listing (``records``) keeps finding it. ``holder_run`` is the run whose
    holder took the claim over (a business key two runs share), ``None`` while it is
    ``run_id``'s own, with that run's ``holder_iteration`` and ``holder_call_id``: the
    taker's listing finds it too, as its own call. ``holding_run`` is whichever of the two
    holds it now.
    """

    key: str
    status: RecordStatus
    holder: str
    tenant: str
    run_id: str
    iteration: int | None = None
    tool: str | None = None
    call_id: str | None = None
    flags: ToolFlags | None = None
    fence: int | None = None
    outcome: bytes | None = None
    since: float = 0.0
    completed_at: float | None = None
    expires_at: float | None = None
    by: str | None = None
    never_ran_by: str | None = None
    holder_run: str | None = None
    holder_iteration: int | None = None
    holder_call_id: str | None = None

    @property
    def holding_run(self) -> str:
        """The run whose holder holds the claim (or last held it): the one whose lease
        says whether it may be sending the call now."""
        return self.run_id if self.holder_run is None else self.holder_run

    def resendable_as(self, tool: str) -> bool:
        """Whether this claim is a call of ``tool`` sent as safe to send again: only such a
        claim may be taken over by a call of ``tool`` (a key two tools share names another
        tool's call). A record without flags is taken as sent safe."""
        return self.tool == tool and (self.flags is None or self.flags.safe_to_resend)


@runtime_checkable
class IdempotencyStore(Protocol):
    """Records which calls were claimed and what they produced.

    Tenant-scoped: every method takes the tenant, and records are keyed by (tenant, key),
    so two tenants using the same key (a business key such as ``order-5``) never see,
    complete, take over or resolve each other's record.

    State machine::

        absent ──claim──▶ in_flight(holder, fence, since, …)
        in_flight ──complete(outcome), same holder──▶ completed(outcome, at)
        in_flight ──resolve by an operator──▶ completed(outcome, by) | never_ran(by)
        in_flight ──release / ttl expiry──▶ absent   (only claims taken with a ttl)
        in_flight ──release(undispatched), same holder──▶ absent   (a call never sent)
        completed ──claim──▶ returned unchanged
        never_ran ──claim──▶ in_flight               (the operator said it never ran)
    """

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim ``key`` and return the record as it stands after the call.

        The caller owns the claim iff the result is ``in_flight`` under ``holder``. A claim
        by the same holder on its own in-flight record renews its ttl. A record in flight
        under another holder is returned unchanged unless ``takeover=True``; taken over by
        another run, the record stays its first run's call and names the taker in
        ``holder_run``. For a tool-call
        claim (``tool`` set) the fence is checked (``StaleFenceError``) before anything else.
        A run's resume claim (``tool is None``, with a ttl) is taken before any lease exists,
        so it is not fenced: its ``fence`` is ignored and never raises the highest seen.
        """
        ...

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder``.

        Not fenced: a superseded holder may still record what a call it started produced.
        Completing a record this holder does not hold in flight raises ``StaleFenceError``;
        completing one already completed by this holder returns it unchanged.
        """
        ...

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held in flight by ``holder``. Claims without a ttl (a tool
        call's, an unkeyed call's mark) are never released, except with
        ``undispatched=True``: the holder says it claimed the call and then did not send it
        (its lease check stopped it), so nothing is in doubt."""
        ...

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in one round trip; absent keys are left
        out."""
        ...

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run (tool calls and the run claim): its own, and those
        it took over from another run, each as ``listed_by`` shows it to the run."""
        ...

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
        holder: str | None = None,
    ) -> IdempotencyRecord:
        """An operator settles an in-flight call: its outcome, or that it never ran.

        Raises ``KeyError`` for an unknown key and ``ValueError`` when it is not in flight,
        or, with ``holder``, not in flight under that holder: the claim the caller looked
        at and decided on was settled or taken again meanwhile.
        """
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


@runtime_checkable
class RecordsFrom(Protocol):
    """A store that reads a run's tool-call records from an iteration on, without their
    outcomes: what planning a resume needs, however long the run already is. Optional:
    planning reads ``records`` where a store lacks it."""

    async def records_from(
        self, tenant: str, run_id: str, iteration: int
    ) -> list[IdempotencyRecord]:
        """The live tool-call records of the run whose iteration is ``iteration`` or later,
        as ``records`` lists and orders them, each with ``outcome`` left out (``None``)."""
        ...
