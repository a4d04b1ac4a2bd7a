"""The runner against an oracle, as a hypothesis state machine.

Random agents (read-only, side-effecting, idempotent, unkeyed, secret-taking and approval
tools), random scripted turns (twin calls included), random faults at any store call or
inside any tool (a process death, an outage before the store, a reply lost after it),
random retries on the same runner or a fresh one, random approvals and truthful operator
resolutions. After every step the oracle checks:

- no call identity has two effects (keyed: its key; unkeyed: iteration and call id);
- no masked argument was ever sent;
- every refusal names exactly the calls in doubt (claimed in flight and unsafe to re-send,
  or unkeyed and side-effecting);
- and at the end, with faults off and an operator settling what is in doubt, the run
  finishes, every completed side-effecting record stands for exactly one effect.

Short profile here; ``ADK_LONG=1`` runs the long one. A failure shrinks to a step list.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tesserix_adk import (
    Agent,
    AgentRunner,
    ApprovalStatus,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    IndeterminateToolCallError,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    Redactor,
    ResumeConflictError,
    RunStatus,
    ScriptedProvider,
    StoreReplyLostError,
    StoreUnavailableError,
    ToolContext,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing import FakeClock
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)

LONG = os.environ.get("ADK_LONG") == "1"
SECRET = "sk-proj-" + "Q7w8E9r0T1y2U3i4O5p6" * 2
TENANT = "acme"
RUN = "r"

# name -> (side_effects, idempotent, keyed, approval)
TOOLS: dict[str, tuple[bool, bool, bool, bool]] = {
    "lookup": (False, False, True, False),
    "book": (True, False, True, False),
    "pay": (True, True, True, False),
    "mail": (True, False, False, False),
    "vault": (True, False, True, False),
    "transfer": (True, False, True, True),
}


class Fault(Exception):
    """Raised by an armed fault point that stands for a tool's own failure."""


@dataclass
class Armed:
    """After skipping ``countdown`` fitting points, raise ``kind`` at the next ``times``."""

    kind: str  # crash | outage | lost | tool_error
    target: str  # a prefix of the point's name: "" (any), "checkpoint", "idempotency complete"...
    countdown: int = 0
    times: int = 1

    def fits(self, phase: str, where: str) -> bool:
        if not where.startswith(self.target):
            return False
        if self.kind == "tool_error":
            return where.startswith("tool")
        if self.kind == "outage":
            return phase == "before" and not where.startswith("tool")
        if self.kind == "lost":
            return phase == "after" and where.startswith("idempotency")
        return True  # a crash fits anywhere

    def error(self, phase: str, where: str) -> BaseException:
        if self.kind == "crash":
            return SimulatedCrash(f"died {phase} {where}")
        if self.kind == "tool_error":
            return Fault(f"{where} failed {phase} its effect")
        if self.kind == "outage":
            return StoreUnavailableError(f"{where}: never reached the store")
        return StoreReplyLostError(f"{where}: applied, reply lost")


class World:
    """The outside world and the fault points; the oracle reads it."""

    def __init__(self) -> None:
        self.effects: Counter[str] = Counter()
        self.masked_sent: list[str] = []
        self.armed: list[Armed] = []

    def point(self, phase: str, where: str) -> None:
        """A fault point: ``phase`` before/after, ``where`` names the call."""
        for armed in list(self.armed):
            if not armed.fits(phase, where):
                continue
            if armed.countdown > 0:
                armed.countdown -= 1
                continue
            armed.times -= 1
            if armed.times <= 0:
                self.armed.remove(armed)
            raise armed.error(phase, where)


def build_agent(world: World) -> Agent:
    def effect(identity: str, name: str) -> None:
        world.point("before", f"tool {name}")
        world.effects[identity] += 1
        world.point("after", f"tool {name}")

    @tool(side_effects=False)
    def lookup(q: str) -> str:
        """Look something up."""
        world.point("before", "tool lookup")
        return f"found {q}"

    @tool
    def book(seat: str, ctx: ToolContext) -> str:
        """Book a seat."""
        effect(f"book:{ctx.idempotency_key}", "book")
        return f"booked {seat}"

    @tool(idempotent=True)
    async def pay(amount: int, ctx: ToolContext) -> str:
        """Pay; the processor deduplicates by our key."""
        world.point("before", "tool pay")
        if world.effects[f"pay:{ctx.idempotency_key}"] == 0:
            world.effects[f"pay:{ctx.idempotency_key}"] += 1
        world.point("after", "tool pay")
        return f"paid {amount}"

    @tool(key=None)
    def mail(to: str, ctx: ToolContext) -> str:
        """Send mail (no key: the mail server cannot deduplicate)."""
        effect(f"mail:{ctx.iteration}:{ctx.call.id}", "mail")
        return "sent"

    @tool
    def vault(api_key: str, ctx: ToolContext) -> str:
        """Keep an API key."""
        if api_key != SECRET:
            world.masked_sent.append(api_key)
        effect(f"vault:{ctx.idempotency_key}", "vault")
        return "kept"

    @tool(requires_approval=True)
    def transfer(to: str, ctx: ToolContext) -> str:
        """Move money (needs a person's approval)."""
        effect(f"transfer:{ctx.idempotency_key}", "transfer")
        return f"moved to {to}"

    return Agent(
        "prop", "Do as scripted.", [lookup, book, pay, mail, vault, transfer], max_iterations=8
    )


def _call(name: str, n: int) -> tuple[str, dict[str, Any]]:
    args = {
        "lookup": {"q": f"q{n}"},
        "book": {"seat": f"{n}A"},
        "pay": {"amount": n},
        "mail": {"to": f"u{n}@example.com"},
        "vault": {"api_key": SECRET},
        "transfer": {"to": f"acct{n}"},
    }[name]
    return (name, args)


calls = st.tuples(st.sampled_from(sorted(TOOLS)), st.integers(0, 1)).map(lambda t: _call(*t))
turns = st.lists(st.lists(calls, min_size=1, max_size=3), min_size=1, max_size=3)


class RunnerMachine(RuleBasedStateMachine):
    """One run, carried through faults by a sequence of attempts."""

    # How long a dead attempt's resume claim keeps others out (store's clock).
    claim_ttl = 60.0

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.world = World()
        self.clock = FakeClock()
        self.bundle: Any = None
        self.open_stores()
        self.idem = FaultyIdempotencyStore(
            self.idem_inner,
            hook=lambda phase, op, key: self.world.point(phase, f"idempotency {op}"),
        )
        self.store = FaultyCheckpointStore(
            self.store_inner,
            crash_before=lambda body: self.world.point("before", "checkpoint") or False,
            crash_after=lambda body: self.world.point("after", "checkpoint") or False,
        )
        self.script: list[Any] = []
        self.policy = CheckpointPolicy()
        self.runner: AgentRunner | None = None
        self.status: RunStatus | None = None
        self.pending: str | None = None
        self.refused: IndeterminateToolCallError | None = None
        self.stuck = False

    def open_stores(self) -> None:
        """The backend under test (memory here, on the machine's fake clock)."""
        self.idem_inner: Any = MemoryIdempotencyStore(clock=self.clock)
        self.store_inner: Any = MemoryCheckpointStore()
        self.history: Any = MemoryHistoryStore()
        self.leases: Any = MemoryLeaseStore(clock=self.clock)
        self.approvals: Any = MemoryApprovalStore(clock=self.clock)
        self.ledger: Any = MemoryLedger()

    def let_time_pass(self) -> None:
        """A new process: a dead attempt's claim and lease have lapsed by then."""
        self.clock.advance(120.0)

    def teardown(self) -> None:
        try:
            if not self.stuck:
                self.loop.run_until_complete(self._drive_to_the_end())
        finally:
            if self.bundle is not None:
                self.loop.run_until_complete(self.bundle.aclose())
            self.loop.close()

    # --- set-up --------------------------------------------------------------------------

    @initialize(
        script=turns,
        boundaries=st.sets(st.sampled_from(list(Boundary)), min_size=0),
    )
    def write_script(
        self, script: list[list[tuple[str, dict[str, Any]]]], boundaries: set[Boundary]
    ) -> None:
        self.script = [*script, "done"]
        # Fewer boundaries leave records ahead of the frontier, or no frontier at all.
        self.policy = CheckpointPolicy(boundaries=frozenset(boundaries))

    def _new_runner(self) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(self.script),
            idempotency=self.idem,
            checkpoints=Checkpointer(self.store, history=self.history, policy=self.policy),
            leases=self.leases,
            ledger=self.ledger,
            approvals=self.approvals,
            resume_claim_ttl=self.claim_ttl,
        )

    # --- rules ---------------------------------------------------------------------------

    @rule(
        kind=st.sampled_from(["crash", "outage", "lost", "tool_error"]),
        point=st.sampled_from(
            [
                "",
                "checkpoint",
                "idempotency claim",
                "idempotency complete",
                "idempotency lookup",
                "tool",
            ]
        ),
        countdown=st.integers(0, 8),
        times=st.integers(1, 4),
    )
    def arm_a_fault(self, kind: str, point: str, countdown: int, times: int) -> None:
        self.world.armed.append(Armed(kind=kind, target=point, countdown=countdown, times=times))

    @precondition(lambda self: not self.stuck and not self._finished)
    @rule(same_runner=st.booleans())
    def carry_on(self, same_runner: bool) -> None:
        if self.runner is None or not same_runner:
            self.let_time_pass()
            self.runner = self._new_runner()
        self.loop.run_until_complete(self._attempt(self.runner))

    @precondition(lambda self: self.pending is not None)
    @rule(approved=st.booleans())
    def decide(self, approved: bool) -> None:
        assert self.pending is not None
        self.loop.run_until_complete(
            self.approvals.decide(TENANT, self.pending, approved=approved, by="ops")
        )
        self.pending = None

    @precondition(lambda self: self.refused is not None)
    @rule()
    def operator_resolves(self) -> None:
        self.loop.run_until_complete(self._resolve_truthfully())

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def no_call_has_two_effects(self) -> None:
        twice = {k: n for k, n in self.world.effects.items() if n > 1}
        assert not twice, f"effects made twice: {twice}"

    @invariant()
    def no_masked_argument_was_sent(self) -> None:
        assert not self.world.masked_sent, f"masked arguments sent: {self.world.masked_sent}"

    @invariant()
    def a_refusal_names_exactly_the_calls_in_doubt(self) -> None:
        if self.refused is None:
            return
        in_doubt = self.loop.run_until_complete(self._in_doubt_keys())
        named = {c.key for c in self.refused.calls if c.key is not None}
        assert named == in_doubt, f"refusal named {named}, in doubt {in_doubt}"
        for c in self.refused.calls:
            if c.key is None:
                assert c.tool == "mail", f"an unkeyed call in doubt must be side-effecting: {c}"

    # --- helpers -------------------------------------------------------------------------

    @property
    def _finished(self) -> bool:
        return self.status is not None and self.status is not RunStatus.waiting_approval

    async def _attempt(self, runner: AgentRunner) -> None:
        agent = build_agent(self.world)
        self.refused = None
        try:
            if await self.store.inner.latest(TENANT, RUN) is None:
                # Nothing checkpointed yet: the natural retry is to start the run again.
                run = await runner.run(agent, "go", tenant=TENANT, run_id=RUN)
            else:
                run = await runner.resume(agent, RUN, tenant=TENANT)
        except IndeterminateToolCallError as exc:
            self.refused = exc
            if any(c.key is None for c in exc.calls):
                self.stuck = True  # an unkeyed call in doubt: nobody can ever settle it
            return
        except (SimulatedCrash, StoreUnavailableError, ResumeConflictError):
            return
        except Exception as exc:
            if getattr(exc, "retryable", False):
                return
            raise
        self.status = run.status
        self.pending = None if run.pending_approval is None else run.pending_approval.id

    async def _in_doubt_keys(self) -> set[str]:
        records = await self.idem.inner.records(TENANT, RUN)
        return {
            r.key
            for r in records
            if r.tool is not None
            and r.status is RecordStatus.in_flight
            and (r.flags is None or not r.flags.safe_to_resend)
        }

    async def _resolve_truthfully(self) -> None:
        assert self.refused is not None
        for call in self.refused.calls:
            if call.key is None:
                continue
            ran = self.world.effects[f"{call.tool}:{call.key}"] > 0
            if ran:
                outcome = encode_outcome(
                    ToolOutcome(call_id=call.call_id or "", content="done (ops)"), Redactor()
                )
                await self.idem.inner.resolve(call.key, outcome, tenant=TENANT, by="ops")
            else:
                await self.idem.inner.resolve(call.key, tenant=TENANT, never_ran=True, by="ops")
        self.refused = None

    async def _drive_to_the_end(self) -> None:
        """Faults off, an operator settling doubt and approving: the run must finish."""
        self.world.armed.clear()
        for _ in range(20):
            if self._finished:
                break
            if self.stuck:
                return
            if self.refused is not None:
                await self._resolve_truthfully()
            if self.pending is not None:
                await self.approvals.decide(TENANT, self.pending, approved=True, by="ops")
                self.pending = None
            request = await self._pending_request()
            if request is not None:
                await self.approvals.decide(TENANT, request, approved=True, by="ops")
            self.let_time_pass()
            await self._attempt(self._new_runner())
        assert self._finished, f"the run did not finish: {self.status}, refused {self.refused}"
        assert self.status is RunStatus.completed, self.status
        self.no_call_has_two_effects()
        self.no_masked_argument_was_sent()
        for rec in await self.idem.inner.records(TENANT, RUN):
            stood_for_an_effect = (
                rec.tool in ("book", "transfer")
                and rec.status is RecordStatus.completed
                and rec.by is None
                and rec.outcome is not None
                and b'"is_error":false' in rec.outcome
            )
            if stood_for_an_effect:
                identity = f"{rec.tool}:{rec.key}"
                assert self.world.effects[identity] == 1, f"{identity} has no effect"

    async def _pending_request(self) -> str | None:
        cp = await Checkpointer(self.store, history=self.history).latest(TENANT, RUN)
        if cp is None or cp.pending_approval is None:
            return None
        request = await self.approvals.get(TENANT, cp.pending_approval.id)
        if request is None or request.status is not ApprovalStatus.pending:
            return None
        return request.id


class SqliteRunnerMachine(RunnerMachine):
    """The same machine on one SQLite file: real transactions, the database's own clock."""

    claim_ttl = 0.05

    def open_stores(self) -> None:
        self.folder = tempfile.TemporaryDirectory()
        self.bundle = open_stores(f"sqlite:///{self.folder.name}/adk.sqlite3")
        self.loop.run_until_complete(self.bundle.create_schema())
        self.idem_inner = self.bundle.idempotency
        self.store_inner = self.bundle.checkpoints
        self.history = self.bundle.history
        self.leases = self.bundle.leases
        self.approvals = self.bundle.approvals
        self.ledger = self.bundle.ledger

    def let_time_pass(self) -> None:
        time.sleep(self.claim_ttl * 1.5)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.folder.cleanup()


_SETTINGS = settings(
    max_examples=500 if LONG else 60,
    stateful_step_count=40 if LONG else 16,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
RunnerMachine.TestCase.settings = _SETTINGS
SqliteRunnerMachine.TestCase.settings = settings(
    _SETTINGS, max_examples=150 if LONG else 20, stateful_step_count=30 if LONG else 12
)
test_the_runner_keeps_its_promises_under_random_faults = RunnerMachine.TestCase
test_the_runner_keeps_its_promises_under_random_faults_on_sqlite = SqliteRunnerMachine.TestCase
