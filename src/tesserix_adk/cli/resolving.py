"""``tesserix resolve``: an operator records what a call in doubt did, its outcome or that
it never ran, on the run whose call it is, while nobody carries that run or the run that
took the call over."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import secrets
import time
from typing import Any, TextIO

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import (
    DEFAULT_MAX_BYTES,
    MAX_NESTING,
    encode_outcome,
    record_tag,
    recorded_outcome,
    within_nesting,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.failures import ExitCode, Refused, UsageError
from tesserix_adk.cli.jsonout import emit, key_digest
from tesserix_adk.cli.text import escaped
from tesserix_adk.cli.waking import readable_frontier, wake, wake_waiting_on
from tesserix_adk.errors import AdkError, LeaseHeldError, NoCheckpointError, ResumeConflictError
from tesserix_adk.leases import never_ran_wait, previous_end_ago
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, WorkState
from tesserix_adk.timestamps import iso_time

__all__ = ["RESOLVE_LEASE_TTL", "run_resolve"]

# Long enough for one resolution; short enough that a resolver killed half-way holds the
# run up only briefly (its lease lapses by the store's clock).
RESOLVE_LEASE_TTL = 30.0


async def run_resolve(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    try:
        record = _the_call(await stores.idempotency.records(args.tenant, args.run), args)
    except NoCheckpointError as exc:
        other = await _claimed_by_another_run(stores, args)
        if other is None:
            raise
        raise _resolved_elsewhere(args, other) from exc
    if record.run_id != args.run:  # a call this run took over from the run whose it is
        raise _resolved_elsewhere(args, await _as_stored(stores, args, record))
    content: Any = None
    if not args.never_ran:
        try:
            content = json.loads(
                args.outcome,
                parse_constant=_not_json,
                parse_float=_finite,
                parse_int=_whole,
                object_pairs_hook=_once_each,
            )
            # Within its record's envelope: a deeper one would be stored replaced by an
            # error saying so, not as the operator gave it.
            too_deep = not within_nesting(content, MAX_NESTING - 1)
        except ValueError as exc:
            raise UsageError(f"--outcome is not valid JSON: {exc}") from exc
        except RecursionError:
            too_deep = True
        if too_deep:
            raise UsageError(
                f"--outcome nests deeper than {MAX_NESTING - 1} levels of arrays and "
                "objects, more than a recorded outcome may"
            )
        _within_the_cap(args, record, content)
    await _no_live_resumer(stores, args)
    await _taker_not_carried(stores, args, record)
    if await stores.leases.current(args.tenant, args.run) is None:
        # Asked before the lease is taken: a refused try must not itself end a lease (and
        # so push back the margin of every other call in doubt).
        _in_flight(record, args)
        if args.never_ran:
            _margin_passed(args, record, await stores.leases.ended_ago(args.tenant, args.run))
    # The operator carries the run while recording what happened, so no worker can take it
    # (and run on with, or re-send, the call being decided) in between; the acquisition also
    # raises the run's fence, so a worker whose lease lapsed is fenced out of its writes.
    holder = f"tesserix-resolve-{secrets.token_hex(6)}"
    try:
        lease = await stores.leases.acquire(args.tenant, args.run, holder, RESOLVE_LEASE_TTL)
    except LeaseHeldError as exc:
        who = "another worker" if exc.holder is None else escaped(exc.holder)
        raise ResumeConflictError(
            f"another worker holds the run {args.run!r} ({who}); resolve a call only once "
            "nobody carries the run",
            holder=exc.holder,
        ) from exc
    try:
        # Read again under the lease: what was in flight before may have completed since.
        record = _the_call(await stores.idempotency.records(args.tenant, args.run), args)
        if record.run_id != args.run:
            raise _resolved_elsewhere(args, await _as_stored(stores, args, record))
        await _taker_not_carried(stores, args, record)
        if args.never_ran:
            # Another holder may have come and gone since the first look.
            _margin_passed(args, record, previous_end_ago(lease, RESOLVE_LEASE_TTL))
        _in_flight(record, args)
        return await _record_resolution(args, stores, out, record, content)
    finally:
        try:
            await stores.leases.release(lease)
        except AdkError as exc:  # it lapses by itself within RESOLVE_LEASE_TTL
            if not getattr(args, "json", False):  # the JSON object stays the only output
                out.write(
                    f"the operator's lease on the run could not be released "
                    f"({escaped(str(exc))}); it lapses within {RESOLVE_LEASE_TTL:g} s\n"
                )


async def _taker_not_carried(
    stores: Stores, args: argparse.Namespace, record: IdempotencyRecord
) -> None:
    """A call another run took over (a business key two runs share) is that run's to send:
    while it is carried its holder may be sending it, and "never ran" waits the margin past
    the end of its lease too."""
    taker = record.holding_run
    if taker == args.run or record.status is not RecordStatus.in_flight:
        return
    if await stores.leases.current(args.tenant, taker) is not None:
        raise ResumeConflictError(
            f"{record.tool} ({args.call}) was taken over by run {taker!r} ({record.holder}), "
            "which is carried now and may be sending it; resolve it once nobody carries "
            "that run",
            holder=record.holder,
        )
    if args.never_ran:
        ended = await stores.leases.ended_ago(args.tenant, taker)
        _margin_passed(args, record, ended, whose=f"run {taker!r}'s")


async def _no_live_resumer(stores: Stores, args: argparse.Namespace) -> None:
    """A run carried without a lease store is held by its resume claim alone: while that
    claim is live, its holder may be sending the very call being decided."""
    key = run_claim_key(args.tenant, args.run)
    claim = (await stores.idempotency.lookup([key], tenant=args.tenant)).get(key)
    if claim is None or claim.status is not RecordStatus.in_flight:
        return
    # The claim's expiry is the store's clock; this host's clock only reads it, and a host
    # clock that is behind keeps the refusal longer, never shorter.
    if claim.expires_at is not None and claim.expires_at <= time.time():
        return
    until = "" if claim.expires_at is None else f" until {iso_time(claim.expires_at)}"
    raise ResumeConflictError(
        f"run {args.run!r} is being resumed by {claim.holder}{until}; resolve a call only "
        "once nobody carries the run",
        holder=claim.holder,
    )


async def _as_stored(
    stores: Stores, args: argparse.Namespace, listed: IdempotencyRecord
) -> IdempotencyRecord:
    """The record as stored, naming its own run's call, where the run's listing showed a
    call it took over at its own turn and call id."""
    found = (await stores.idempotency.lookup([listed.key], tenant=args.tenant)).get(listed.key)
    return listed if found is None else found


def _resolved_elsewhere(args: argparse.Namespace, other: IdempotencyRecord) -> Refused:
    """The refusal of a call whose record is another run's (a business key two runs share):
    it is resolved on that run, the one whose call it is."""
    return Refused(
        f"{args.call} of run {args.run!r} is claimed under the same key by run "
        f"{other.run_id!r} ({other.status}): it is that run's call, and this run replays "
        f"what it records; resolve it on run {other.run_id!r} (call {other.call_id}) "
        "once nobody carries that run"
    )


async def _claimed_by_another_run(
    stores: Stores, args: argparse.Namespace
) -> IdempotencyRecord | None:
    """The record another run holds under the key of the call ``args`` names among this
    run's outstanding calls (a business key two runs share), if any."""
    with contextlib.suppress(AdkError):
        cp = await Checkpointer.from_stores(stores).latest(args.tenant, args.run)
        if cp is None:
            return None
        for oc in cp.outstanding:
            if oc.key is None or args.call not in (oc.call.id, oc.key, key_digest(oc.key)):
                continue
            found = (await stores.idempotency.lookup([oc.key], tenant=args.tenant)).get(oc.key)
            if found is not None and found.run_id != args.run:
                return found
    return None


def _in_flight(record: IdempotencyRecord, args: argparse.Namespace) -> None:
    if record.status is not RecordStatus.in_flight:
        raise Refused(f"{record.tool} ({args.call}) is not in flight; it is {record.status}")


def _margin_passed(
    args: argparse.Namespace,
    record: IdempotencyRecord,
    ended_ago: float | None,
    whose: str = "the run's",
) -> None:
    wait = never_ran_wait(ended_ago, args.margin)
    if wait > 0:
        _in_flight(record, args)  # a call already settled is refused as such, not "wait"
        raise ResumeConflictError(
            f"{whose} last lease ended {ended_ago or 0:.1f} s ago by the store's clock, and "
            f"its holder may still be sending {record.tool} ({args.call}); --never-ran is "
            f"taken only after a margin of {args.margin:g} s: look at the outside world "
            f"again in {wait:.1f} s, then resolve"
        )


def _finite(text: str) -> float:
    """A JSON number as a float, refused when it overflows (``1e400`` would be kept as
    ``Infinity``, which is not JSON) or underflows (``1e-400`` would be kept as ``0.0``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is too large a number for a record")
    mantissa = text.lower().split("e")[0]
    if value == 0.0 and any(digit in mantissa for digit in "123456789"):
        raise ValueError(f"{text[:40]} is too small a number for a record (it reads as 0)")
    return value


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a member twice (one value would be dropped)."""
    kept = dict(pairs)
    if len(kept) != len(pairs):
        twice = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise ValueError(f"the member {twice[:40]!r} is given twice")
    return kept


def _whole(text: str) -> int:
    """A JSON integer, refused in one sentence past Python's limit for reading one."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"an integer of {len(text)} digits is longer than a record can keep"
        ) from None


def _within_the_cap(args: argparse.Namespace, record: IdempotencyRecord, content: Any) -> None:
    """Refuse an outcome its record could not keep whole (it would be stored replaced by a
    note that the result was too large, and the operator's answer lost)."""
    encoded = recorded_outcome(
        ToolOutcome(call_id=record.call_id or "", content=content),
        Redactor(),
        record=record_tag(args.tenant, record.key),
    )
    if encoded.replaced:
        raise UsageError(
            f"--outcome is too large for a record (over {DEFAULT_MAX_BYTES} bytes as "
            "stored); nothing was recorded"
        )


def _not_json(name: str) -> Any:
    """``NaN`` and ``Infinity`` are Python's, not JSON: an outcome holding one would be
    stored as bytes no JSON reader takes."""
    raise ValueError(f"{name} is not a JSON value")


def _the_call(records: list[IdempotencyRecord], args: argparse.Namespace) -> IdempotencyRecord:
    matches = [
        r
        for r in records
        if r.tool is not None and args.call in (r.call_id, r.key, key_digest(r.key))
    ]
    if not matches:
        raise NoCheckpointError(
            f"run {args.run!r} of tenant {args.tenant!r} has no call {args.call!r} on record"
        )
    if len(matches) > 1:
        digests = ", ".join(str(key_digest(r.key)) for r in matches)
        raise UsageError(
            f"call id {args.call!r} matches {len(matches)} records; pass the digest of the "
            f"one meant instead ({digests})"
        )
    return matches[0]


async def _record_resolution(
    args: argparse.Namespace,
    stores: Stores,
    out: TextIO,
    record: IdempotencyRecord,
    content: Any,
) -> ExitCode:
    call = f"{escaped(record.tool or '')} ({escaped(args.call)})"
    as_json = getattr(args, "json", False)
    encoded = None
    if not args.never_ran:
        outcome = ToolOutcome(call_id=record.call_id or "", content=content)
        encoded = encode_outcome(outcome, Redactor(), record=record_tag(args.tenant, record.key))
    try:
        # On the claim the operator looked at: another run sharing the key may have
        # settled it and claimed it again meanwhile, and be sending it now.
        await stores.idempotency.resolve(
            record.key,
            encoded,
            tenant=args.tenant,
            never_ran=args.never_ran,
            by=args.by,
            holder=record.holder,
        )
    except (KeyError, ValueError) as exc:
        raise ResumeConflictError(
            f"{call} changed while it was resolved ({exc}); nothing was recorded: look at it "
            "again with `tesserix inspect`"
        ) from exc
    if args.never_ran:
        said = f"recorded: {call} never ran, by {escaped(args.by)}\n"
    else:
        said = f"recorded: {call} completed with the given outcome, by {escaped(args.by)}\n"
    if not as_json:
        out.write(said)
    cp = await readable_frontier(stores, args.tenant, args.run)
    woken = await wake(stores, args.tenant, args.run, WorkState.wanted, cp)
    # Runs sharing the call's business key may be parked on this very claim.
    others, trouble = await wake_waiting_on(stores, args.tenant, record.key, but=args.run)
    if as_json:
        emit(
            out,
            {
                "run_id": args.run,
                "tenant": args.tenant,
                "tool": record.tool,
                "call_id": record.call_id,
                "key_digest": key_digest(record.key),
                "resolved_as": "never_ran" if args.never_ran else "completed",
                "by": args.by,
                "woken": woken,
                "also_woken": others,
                "also_woken_trouble": trouble,
            },
        )
        return ExitCode.CARRIED_ON
    if woken:
        out.write("a worker carries the run on (a running `tesserix worker`; else resume it)\n")
    elif cp is not None and cp.carried_by is not None and not cp.status.finished:
        out.write(
            f"its {cp.carried_by} workflow carries the run on; once that workflow closed, "
            f"`tesserix submit --temporal ... --run-id {escaped(args.run)}` starts a new "
            "one from its frontier\n"
        )
    if others:
        names = ", ".join(escaped(r) for r in others)
        out.write(f"woken too, parked on this call under the same key: {names}\n")
    if trouble is not None:
        out.write(
            f"{escaped(trouble)}; a run parked on this call under the same key stays parked "
            "until it is carried on (`tesserix run --resume`)\n"
        )
    return ExitCode.CARRIED_ON
