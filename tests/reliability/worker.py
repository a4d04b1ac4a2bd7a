"""The process under test: one attempt at carrying a run, every store call on the record.

``python tests/reliability/worker.py --store URL --run R --history FILE [--fault kill:after_claim]``
(the suite starts it through a fork server, which is the same code in a fresh process).

It wraps the stores ``open_stores`` built, so every claim, completion, lease acquisition and
renewal, frontier write, refused write and resolution is appended to the history, with the
time the request went out (``sent``) and the time its reply came back (``t``). The agent's
one side-effecting tool, ``book``, *is* the outside world: its effect is the ``effect`` line
it appends, carrying the call's idempotency key and fence.

Faults are named points at which the process SIGKILLs or SIGSTOPs itself, so a kill lands
exactly there: ``kill:<point>[@n]`` / ``stop:<point>[@n]`` (the n-th time this process
reaches it, 1 by default). Exit codes: 0 completed, 3 not now (held, store unreachable,
superseded), 4 refused naming calls in doubt, 5 anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import signal
import sqlite3
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``reliability`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reliability.history import Recorder, now
from tesserix_adk import Agent, Checkpointer, tool
from tesserix_adk.cli.commands import frontier_main
from tesserix_adk.errors import (
    AdkError,
    IndeterminateToolCallError,
    LeaseHeldError,
    LeaseLostError,
    NoCheckpointError,
    ResumeConflictError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.providers.scripted import ScriptedProvider
from tesserix_adk.runner import AgentRunner
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.grouping import joined
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.tools import ToolContext

TENANT = "torture"
INPUT = "Book a, b and c."
# Two calls in the first turn, one in the second: a frontier between every effect.
TURNS: list[Any] = [
    [("book", {"item": "a"}), ("book", {"item": "b"})],
    [("book", {"item": "c"})],
    "Booked a, b and c.",
]
ITEMS = ("a", "b", "c")

POINTS = (
    "before_claim",  # a tool call's claim is about to be sent
    "after_claim",  # its claim's reply came back; nothing dispatched yet
    "tool_before",  # inside the tool, before its effect
    "tool_after",  # inside the tool, after its effect
    "after_complete",  # the outcome is recorded
    "before_frontier",  # a checkpoint put is about to be sent
    "after_frontier",  # a checkpoint put's reply came back
    "before_renew",  # inside lease renewal, before the renew is sent
    "after_renew",  # inside lease renewal, after its reply
    "before_start",  # resume found no frontier; the run is about to be started
)

EXIT_COMPLETED, EXIT_NOT_NOW, EXIT_REFUSED, EXIT_OTHER = 0, 3, 4, 5


class Faults:
    """Where this process kills or stops itself."""

    def __init__(
        self, specs: Sequence[str], rec: Recorder, run: str, release: str | None = None
    ) -> None:
        self.rec = rec
        self.release = release
        self.run = run
        self.seen: dict[str, int] = {}
        self.armed: dict[str, tuple[str, int]] = {}
        for spec in specs:
            kind, _, where = spec.partition(":")
            point, _, nth = where.partition("@")
            assert kind in ("kill", "stop", "hold") and point in POINTS, spec
            self.armed[point] = (kind, int(nth or 1))

    def at(self, point: str) -> None:
        self.seen[point] = self.seen.get(point, 0) + 1
        armed = self.armed.get(point)
        if armed is None or armed[1] != self.seen[point]:
            return
        kind, _ = armed
        self.rec.event("fault", self.run, kind=kind, point=point, nth=self.seen[point])
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hold":
            # Only inside the tool (a worker thread): the loop goes on renewing the lease
            # while this holds the run, until the harness releases it.
            deadline = time.monotonic() + 60
            while not (self.release and os.path.exists(self.release)):
                assert time.monotonic() < deadline, "never released"
                time.sleep(0.01)
            self.rec.event("released", self.run, point=point)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)  # the harness sends SIGCONT later
            self.rec.event("continued", self.run, point=point)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class _Recording:
    """Delegates everything it does not record to the store it wraps."""

    def __init__(self, inner: Any, rec: Recorder, faults: Faults) -> None:
        self._inner = inner
        self._rec = rec
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _RecordingGroup:
    """A write group whose claims and completions go on the record once it commits: a
    claim or outcome in a group that never committed was never durable (``run.grouping``)."""

    def __init__(self, inner: Any, owner: RecordingIdempotency) -> None:
        self.inner = inner
        self.owner = owner

    async def begin(self) -> None:
        await self.inner.begin()
        self.owner.held = []

    async def commit(self) -> None:
        held, self.owner.held = self.owner.held, None
        await self.inner.commit()
        for ev, run, fields in held or ():
            self.owner._rec.event(ev, run, **fields)


class RecordingIdempotency(_Recording):
    def __init__(self, inner: Any, rec: Recorder, faults: Faults) -> None:
        super().__init__(inner, rec, faults)
        # The events of the open write group, told when it commits (None: no group open).
        self.held: list[tuple[str, str, dict[str, Any]]] | None = None

    def write_group(self) -> _RecordingGroup:
        return _RecordingGroup(self._inner.write_group(), self)

    def joins(self, group: Any) -> bool:
        inner = group.inner if isinstance(group, _RecordingGroup) else group
        return bool(self._inner.joins(inner))

    def _acked(self, ev: str, run: str, **fields: Any) -> None:
        # Only this attempt's writes join its group: the run claim's renewals do not.
        if self.held is not None and joined(self._inner.database) is not None:
            self.held.append((ev, run, fields))
        else:
            self._rec.event(ev, run, **fields)

    async def claim(self, key: str, **kw: Any) -> Any:
        tool_call = kw.get("tool") is not None
        kind = "claim" if tool_call else "run_claim"
        run, holder, fence = kw["run_id"], kw["holder"], kw.get("fence")
        if tool_call:
            self._faults.at("before_claim")
        self._rec.event(f"{kind}_sent", run, key=key, holder=holder, fence=fence)
        sent = now()
        try:
            record = await self._inner.claim(key, **kw)
        except BaseException as exc:
            self._rec.event(f"{kind}_err", run, key=key, fence=fence, sent=sent, error=_err(exc))
            raise
        self._acked(
            f"{kind}_ok",
            run,
            key=key,
            fence=fence,
            sent=sent,
            status=str(record.status),
            mine=record.holder == holder,
            tool=kw.get("tool"),
        )
        if tool_call:
            self._faults.at("after_claim")
        return record

    async def complete(self, key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
        run = self._faults.run
        self._rec.event("complete_sent", run, key=key, holder=holder)
        sent = now()
        try:
            record = await self._inner.complete(key, outcome, tenant=tenant, holder=holder)
        except BaseException as exc:
            self._rec.event("complete_err", run, key=key, sent=sent, error=_err(exc))
            raise
        self._acked("complete_ok", run, key=key, sent=sent)
        self._faults.at("after_complete")
        return record

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        # A claim the attempt drops unsent was never in doubt once the drop lands; told
        # when sent, so a refusal that no longer names it is not taken for a wrong one.
        self._rec.event(
            "release_sent", self._faults.run, key=key, holder=holder, undispatched=undispatched
        )
        await self._inner.release(key, tenant=tenant, holder=holder, undispatched=undispatched)

    async def resolve(self, key: str, outcome: bytes | None = None, **kw: Any) -> Any:
        run = self._faults.run
        sent = now()
        record = await self._inner.resolve(key, outcome, **kw)
        never_ran = bool(kw.get("never_ran"))
        self._rec.event("resolve_ok", run, key=key, sent=sent, never_ran=never_ran)
        return record


class RecordingLeases(_Recording):
    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> Any:
        sent = now()
        try:
            lease = await self._inner.acquire(tenant, run_id, holder, ttl)
        except LeaseHeldError as exc:
            self._rec.event("acquire_held", run_id, holder=holder, sent=sent, by=exc.holder)
            raise
        except BaseException as exc:
            self._rec.event("acquire_err", run_id, holder=holder, sent=sent, error=_err(exc))
            raise
        self._rec.event("acquire_ok", run_id, holder=holder, sent=sent, fence=lease.fence, ttl=ttl)
        return lease

    async def renew(self, lease: Any, ttl: float) -> Any:
        self._faults.at("before_renew")
        sent = now()
        try:
            renewed = await self._inner.renew(lease, ttl)
        except BaseException as exc:
            self._rec.event(
                "renew_err", lease.run_id, fence=lease.fence, sent=sent, error=_err(exc)
            )
            raise
        self._rec.event("renew_ok", lease.run_id, fence=renewed.fence, sent=sent)
        self._faults.at("after_renew")
        return renewed


class RecordingCheckpoints(_Recording):
    async def put(self, tenant: str, run_id: str, payload: bytes, **kw: Any) -> Any:
        fence, step = kw.get("fence"), kw.get("step")
        self._faults.at("before_frontier")
        sent = now()
        try:
            result = await self._inner.put(tenant, run_id, payload, **kw)
        except StaleFenceError as exc:
            self._rec.event("put_refused", run_id, fence=fence, step=step, error=_err(exc))
            raise
        except BaseException as exc:
            self._rec.event("put_err", run_id, fence=fence, step=step, sent=sent, error=_err(exc))
            raise
        self._rec.event("put_ok", run_id, fence=fence, step=step, sent=sent)
        self._faults.at("after_frontier")
        return result


class RecordingHistory(_Recording):
    async def append(self, tenant: str, run_id: str, encoded: Any, **kw: Any) -> Any:
        fence = kw.get("fence")
        sent = now()
        try:
            handle = await self._inner.append(tenant, run_id, encoded, **kw)
        except StaleFenceError as exc:
            self._rec.event("append_refused", run_id, fence=fence, error=_err(exc))
            raise
        self._rec.event("append_ok", run_id, fence=fence, sent=sent)
        return handle


def recording(stores: Stores, rec: Recorder, faults: Faults) -> Stores:
    """``stores`` with the calls the checker needs on the record."""
    stores.idempotency = RecordingIdempotency(stores.idempotency, rec, faults)  # type: ignore[assignment]
    stores.leases = RecordingLeases(stores.leases, rec, faults)  # type: ignore[assignment]
    stores.checkpoints = RecordingCheckpoints(stores.checkpoints, rec, faults)  # type: ignore[assignment]
    stores.history = RecordingHistory(stores.history, rec, faults)  # type: ignore[assignment]
    return stores


class _Slow:
    """A model that takes its time, so a kill at a random moment lands anywhere."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    async def complete(self, request: ModelRequest) -> ModelResponse:
        await asyncio.sleep(self.delay)
        response: ModelResponse = await self.inner.complete(request)
        return response


def build_agent(rec: Recorder, faults: Faults, run: str, delay: float) -> Agent:
    @tool
    def book(item: str, *, ctx: ToolContext) -> dict[str, str]:
        """Book one item; the booking is the line this appends to the history."""
        start = now()
        faults.at("tool_before")
        rec.event("effect", run, key=ctx.idempotency_key, fence=ctx.fence, item=item, sent=start)
        faults.at("tool_after")
        if delay:
            time.sleep(delay)
        return {"booked": item}

    return Agent("torture", "Book what is asked.", [book])


def _dump_tasks(signum: int, frame: Any) -> None:
    """SIGUSR1: every asyncio task's stack, for a hang's failure message."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    sys.stderr.write(f"--- asyncio tasks (signal {signum}) ---\n")
    if loop is not None:
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=sys.stderr)
    traceback.print_stack(frame, file=sys.stderr)
    sys.stderr.flush()


async def _carry(args: argparse.Namespace, rec: Recorder) -> int:
    faults = Faults(args.fault, rec, args.run, args.release)
    stores = recording(open_stores(args.store), rec, faults)
    provider: Any = ScriptedProvider(TURNS)
    if args.delay:
        provider = _Slow(provider, args.delay)
    runner = AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=Checkpointer.from_stores(stores),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        lease_policy=LeasePolicy(ttl=args.lease_ttl, renew_within=args.lease_ttl / 2),
        worker=args.worker,
        resume_claim_ttl=args.claim_ttl,
    )
    agent = build_agent(rec, faults, args.run, args.delay)
    code, verdict, extra = EXIT_OTHER, "error", {}
    try:
        try:
            run = await runner.resume(agent, args.run, tenant=TENANT)
        except NoCheckpointError:
            faults.at("before_start")
            run = await runner.run(agent, INPUT, tenant=TENANT, run_id=args.run)
    except IndeterminateToolCallError as exc:
        code, verdict = EXIT_REFUSED, "refused"
        extra = {"keys": sorted(str(c.key) for c in exc.calls), "error": _err(exc)}
    except (ResumeConflictError, LeaseHeldError) as exc:
        # Also a start that lost the race to another start (RunStartedError: resume it).
        code, verdict, extra = EXIT_NOT_NOW, "held", {"error": _err(exc)}
    except (LeaseLostError, StaleFenceError) as exc:
        code, verdict, extra = EXIT_NOT_NOW, "superseded", {"error": _err(exc)}
    except StoreUnavailableError as exc:
        code, verdict, extra = EXIT_NOT_NOW, "unavailable", {"error": _err(exc)}
    except AdkError as exc:
        extra = {"error": _err(exc)}
    else:
        if str(run.status) == "completed":
            code, verdict = EXIT_COMPLETED, "completed"
        extra = {"status": str(run.status), "fence": run.fence}
    finally:
        try:
            await asyncio.wait_for(stores.aclose(), 10)
        except Exception as exc:  # closing is not part of what is checked
            sys.stderr.write(f"closing the stores failed: {_err(exc)}\n")
    rec.event("result", args.run, verdict=verdict, code=code, **extra)
    return code


def _resolve(args: argparse.Namespace, rec: Recorder) -> int:
    faults = Faults((), rec, args.run)
    stores = recording(open_stores(args.store), rec, faults)
    what = ["--outcome", args.outcome]
    if args.outcome is None:
        what = ["--never-ran", "--margin", str(args.margin)]
    argv = ["resolve", args.run, "--tenant", TENANT, "--call", args.resolve, *what]
    code = frontier_main([*argv, "--by", "oncall"], stores=stores)
    rec.event("resolve_result", args.run, key=args.resolve, code=code)
    return code


def _sqlite_wall() -> float:
    """SQLite's ``julianday('now')`` as epoch seconds."""
    with contextlib.closing(sqlite3.connect(":memory:")) as db:
        (value,) = db.execute("SELECT (julianday('now') - 2440587.5) * 86400.0").fetchone()
    return float(value)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="reliability-worker")
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--worker", default="w")
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--claim-ttl", type=float, default=1.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--release", metavar="FILE", help="ends a hold once it exists")
    parser.add_argument("--resolve", metavar="KEY")
    parser.add_argument("--outcome", metavar="JSON")
    parser.add_argument("--margin", type=float, default=1.0, help="of resolve --never-ran")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGUSR1, _dump_tasks)
    rec = Recorder(args.history, args.worker)
    rec.event(
        "start",
        args.run,
        mode="resolve" if args.resolve else "carry",
        faults=args.fault,
        # The wall clocks this process sees (Python's, and SQLite's, which decides SQLite's
        # leases), so a trial can check that a skew it asked for landed.
        wall=time.time(),
        db_wall=_sqlite_wall(),
        faketime=os.environ.get("FAKETIME"),
    )
    if args.resolve:
        return _resolve(args, rec)
    return asyncio.run(_carry(args, rec))


def child(argv: Sequence[str], out_path: str) -> None:
    """The fork server's entry point: stdout and stderr to ``out_path``, then ``main``."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a worker's verdict is already on the record.
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
