"""``tesserix runs``: a tenant's runs, newest first, with filters and a limit; a run
submitted and not yet started by a worker is listed as ``submitted``, and one cancelled
before any worker started it as ``cancelled``, saying so.

Columns: run, agent, status and step, when the frontier was written (ISO 8601 UTC), then
what stands out (calls in flight, the live lease, why it is parked or cannot be carried
on). A header heads the table on a terminal (``--header``/``--no-header`` decide
elsewhere), so a script reading rows gets rows; ``--json`` gives the same as objects.
``--stuck`` keeps parked runs, runs with calls in flight and no live lease, and runs that
cannot be carried on (failed, a refused frontier, pinned to another agent revision: the
revision they need is named, with ``--agent module:attr`` the current one too; or wanting
a worker, unheld, with nothing in the work index a worker takes: ``lost_to_workers``).
"""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime
from typing import Any, TextIO

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import CheckpointStatus
from tesserix_adk.cli.failures import ExitCode
from tesserix_adk.cli.jsonout import emit, lease_json, when
from tesserix_adk.cli.reasons import (
    blocked,
    failure_reason,
    left_for_a_person,
    lost_to_workers,
    waits,
)
from tesserix_adk.cli.text import escaped
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError
from tesserix_adk.run.entries import damage, tenant_entries
from tesserix_adk.run.unstarted import unstarted_runs
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import run_listing
from tesserix_adk.stores.protocols import RecordStatus

__all__ = ["HEADER", "add_runs_arguments", "run_runs", "since_time"]

HEADER = "RUN  AGENT  STATUS  UPDATED  NOTES"

# The same fields as every other row, so a script reads each row the same way.
_NO_FRONTIER: dict[str, Any] = {
    "agent": None,
    "revision": None,
    "step": None,
    "updated_at": None,
    "in_flight": 0,
    "lease": None,
    "parked": None,
    "blocked": None,
    "output": None,
}
_UNREADABLE = {**_NO_FRONTIER, "status": "unreadable"}

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def since_time(value: str, now: float | None = None) -> float:
    """``--since``: an ISO 8601 time (``2026-12-01T10:00:00Z``) or a duration back from
    now (``90s``, ``30m``, ``12h``, ``7d``), as epoch seconds."""
    match = _DURATION.fullmatch(value.strip())
    if match is not None:
        now = datetime.now(UTC).timestamp() if now is None else now
        return now - float(match[1]) * _UNIT[match[2]]
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither an ISO 8601 time (2026-12-01T10:00:00Z) nor a duration "
            "(30m, 12h, 7d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _limit(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def add_runs_arguments(p: argparse.ArgumentParser, named: Any) -> None:
    """The options of ``runs``."""
    p.add_argument("--tenant", required=True, type=named)
    p.add_argument(
        "--stuck",
        action="store_true",
        help="only parked runs, runs with calls in flight and no live lease, and runs that "
        "cannot be carried on (failed, refused, pinned to another agent revision)",
    )
    p.add_argument(
        "--status",
        action="append",
        default=[],
        choices=[s.value for s in CheckpointStatus],
        help="only this status (repeatable)",
    )
    p.add_argument(
        "--agent",
        type=named,
        help="only this agent's runs: its name, or module:attr (then runs pinned to another "
        "revision than its current one count as stuck)",
    )
    p.add_argument(
        "--since",
        type=since_time,
        metavar="WHEN",
        help="only runs written since: ISO 8601 UTC, or a duration back (30m, 12h, 7d)",
    )
    p.add_argument("--limit", type=_limit, metavar="N", help="at most N runs (newest first)")
    header = p.add_mutually_exclusive_group()
    header.add_argument(
        "--header", action="store_true", default=None, help="print the header (default on a tty)"
    )
    header.add_argument("--no-header", action="store_false", dest="header")
    p.add_argument("--json", action="store_true", help="machine-readable output")


async def run_runs(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    """List the tenant's runs (text or JSON)."""
    name, revision = _agent_filter(args.agent)
    rows = await _rows(args, stores, name, revision)
    if args.json:
        emit(out, {"runs": rows})
        return ExitCode.CARRIED_ON
    header = args.header if args.header is not None else _isatty(out)
    if not rows:
        out.write("no runs\n")
        return ExitCode.CARRIED_ON
    if header:
        out.write(HEADER + "\n")
    for row in rows:
        out.write(_line(row) + "\n")
    return ExitCode.CARRIED_ON


def _agent_filter(agent: str | None) -> tuple[str | None, str | None]:
    if agent is None or ":" not in agent:
        return agent, None
    from tesserix_adk.cli.loading import load_agent

    loaded = load_agent(agent, {})
    return loaded.name, loaded.revision


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


async def _rows(
    args: argparse.Namespace, stores: Stores, agent: str | None, revision: str | None
) -> list[dict[str, Any]]:
    checkpointer = Checkpointer.from_stores(stores)
    rows: list[dict[str, Any]] = []
    listed = await run_listing(stores.checkpoints).runs(args.tenant)
    entries = await tenant_entries(stores, args.tenant, listed)
    for run_id in listed:
        try:
            cp = await checkpointer.latest(args.tenant, run_id)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            rows.append({**_UNREADABLE, "run_id": run_id, "reason": str(exc)})
            continue
        if cp is None:
            continue
        if agent is not None and cp.agent_name != agent:
            continue
        if args.status and str(cp.status) not in args.status:
            continue
        if args.since is not None and (cp.written_at or 0) < args.since:
            continue
        try:
            lease = await stores.leases.current(args.tenant, run_id)
            records = await stores.idempotency.records(args.tenant, run_id)
            if run_id in entries.damaged:
                raise CheckpointCorruptError(entries.damaged[run_id])
            # A run that ended may have left a call in doubt (cancelled while its reply
            # was lost): it waits for `tesserix resolve` as an unfinished one does.
            left = await left_for_a_person(stores.idempotency, stores.leases, cp, records, lease)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            # One run's damaged row hides no other run: it is listed as a damaged frontier is.
            rows.append({**_UNREADABLE, "run_id": run_id, "reason": damage(exc)})
            continue
        in_flight = sum(
            1 for r in records if r.tool is not None and r.status is RecordStatus.in_flight
        )
        park = entries.parked.get(run_id)
        lost = await lost_to_workers(stores, args.tenant, cp, lease, entries)
        stuck = blocked(cp, park, revision, unindexed=lost, refused=left.refused)
        if args.stuck and not waits(
            parked=park is not None, open_calls=left.calls, lease=lease, blocked=stuck
        ):
            continue
        rows.append(
            {
                "run_id": run_id,
                "agent": cp.agent_name,
                "revision": cp.agent_revision,
                "status": str(cp.status),
                "step": cp.step,
                "updated_at": when(cp.written_at),
                "in_flight": in_flight,
                "lease": lease_json(lease),
                "parked": None if park is None else park.reason,
                "blocked": stuck,
                "reason": failure_reason(cp, park),
                "output": cp.output,
                "_written": cp.written_at or 0.0,
            }
        )
    rows += await _submitted(args, stores, agent, set(listed))
    rows.sort(key=lambda r: -float(r.get("_written", 0.0)))
    if args.limit is not None:
        rows = rows[: args.limit]
    for row in rows:
        row.pop("_written", None)
    return rows


async def _submitted(
    args: argparse.Namespace, stores: Stores, agent: str | None, listed: set[str]
) -> list[dict[str, Any]]:
    """Runs with no frontier (``run.unstarted``): submitted and not yet started, listed as
    ``submitted`` when they were submitted, with why they are parked if a worker parked
    them before their first frontier; and runs cancelled before they started, listed as
    ``cancelled`` when the cancel ended them, saying who cancelled them and why. A
    ``--status`` (a frontier's) keeps only those cancelled, for ``cancelled``; ``--stuck``
    keeps the parked."""
    cancelled = not args.stuck and (not args.status or "cancelled" in args.status)
    rows: list[dict[str, Any]] = []
    try:
        unstarted = await unstarted_runs(
            stores, args.tenant, with_frontier=listed, cancelled=cancelled
        )
    except CheckpointCorruptError as exc:
        # Known only by listing the index, which one damaged entry stops: said in a row
        # of its own, every run with a frontier still listed.
        reason = f"runs not started yet cannot be listed: {damage(exc)}"
        return [{**_UNREADABLE, "run_id": "-", "reason": reason}]
    for run in unstarted:
        item = run.item
        if run.unreadable is not None:  # shown whatever the filters, as a frontier's is
            reason = damage(run.unreadable)
            rows.append({**_UNREADABLE, "run_id": item.run_id, "reason": reason})
            continue
        if agent is not None and item.agent != agent:
            continue
        if args.status and run.cancel is None:
            continue
        if (args.since is not None and item.since < args.since) or (
            args.stuck and run.parked is None
        ):
            continue
        rows.append(
            {
                **_NO_FRONTIER,
                "run_id": item.run_id,
                "agent": item.agent,
                "status": run.status,
                "updated_at": when(item.since),
                "lease": lease_json(run.lease),
                "parked": run.parked,
                "reason": run.said or run.parked,
                "_written": item.since,
            }
        )
    return rows


def _line(row: dict[str, Any]) -> str:
    shown = escaped(row["run_id"])
    if row["status"] == "unreadable":
        return f"{shown}  unreadable: {escaped(row['reason'])}"
    notes = []
    if row["in_flight"]:
        notes.append(f"{row['in_flight']} call(s) in flight")
    lease = row["lease"]
    if lease is not None:
        notes.append(
            f"held by {escaped(lease['holder'])} (fence {lease['fence']}) until "
            f"{lease['expires_at']} by the store's clock, unless renewed"
        )
    if row["parked"] is not None:
        notes.append(f"parked: {escaped(row['parked'])}")
    if row["step"] is None and row["status"] == "cancelled" and row.get("reason"):
        notes.append(escaped(row["reason"]))  # cancelled before it started
    blocked_by = row["blocked"]
    # A run parked for a changed revision also says which revision it needs.
    if blocked_by is not None and (row["parked"] is None or blocked_by.startswith("needs")):
        notes.append(escaped(blocked_by))
    updated = row["updated_at"] or "-"
    where = row["status"] if row["step"] is None else f"{row['status']} at step {row['step']}"
    line = f"{shown}  {escaped(row['agent'])}  {where}  {updated}  " + "  ".join(notes)
    return line.rstrip()
