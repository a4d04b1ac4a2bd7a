"""A stateful attack on workers and operators together, against an oracle, in process, on a
SQLite file: runs are submitted (a side-effecting booking keyed by a business key several
runs share, a payment that needs a person), workers carry them for a bounded step, an
attempt dies at a chosen point (a ``BaseException`` raised before or after the tool's side
effect, a lost reply after it, a tool that hangs until its worker is drained or cancelled),
operators approve, deny, cancel and resolve through the real ``tesserix`` CLI (in process),
carry runs on from parked through the Python API, and the clock runs past the lease ttl.

After every step: each business key's side effect happened at most once; every run that is
unfinished and not waiting on a person is due for a worker (the work index) or listed by
``tesserix runs --stuck``; every refusal is an exit code with one sentence (CLI) or an
``AdkError`` (Python API); a decision repeated is refused or names the first decider. At
the end the runs are drained (workers, in-doubt calls resolved as completed or never ran,
as the oracle knows they were): every run ends finished, cancelled, failed or waiting on a
person.

Defect found and fixed (its repro's marker removed, and the drain no longer carries such a
run on by hand): a run parked in doubt on a call another run claimed under the same
business key was not woken when an operator resolved that call on the other run, as its
refusal tells them to (``cli.waking.wake_waiting_on`` now wakes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolContext,
    ToolOutcomeUnknownError,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import AdkError
from tesserix_adk.messages import Message, Role
from tesserix_adk.stores.protocols import WorkState

T = "acme"
TTL = 0.3
FAST = Backoff(base=0.01, cap=0.05)
BOOK_KEYS = ("k1", "k1", "k2")  # k1 shared often: a business key two runs book
FAULTS = (
    "none",
    "died_before",
    "died_after",
    "unknown_after",
    "error_after",
    "hang_after",
    "model_died",
)
HANG_ENDS = ("drain", "cancel")
EXIT_CODES = {0, 1, 3, 4}


class Died(BaseException):
    """The process carrying the attempt died here: nothing after it runs."""


def _say(text: str) -> ModelResponse:
    return ModelResponse(message=Message(role=Role.assistant, content=text))


class PlanModel:
    """Asks for the calls the user's message lists (``book:k1 pay:p-r0``), one per turn, in
    order, then answers ``done``; the turn is chosen by counting assistant messages, so a
    fresh attempt carries on where the dead one stopped. Dies once when the world says
    ``model_died`` and a tool result is in the conversation (a frontier written after it,
    or not)."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if self.world.fault == "model_died" and any(m.role is Role.tool for m in request.messages):
            self.world.fault = "none"
            raise Died("died asking the model")
        user = next(m for m in request.messages if m.role is Role.user)
        plan = str(user.content).split()
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked >= len(plan):
            return _say("done")
        name, key = plan[asked].split(":")
        call = ToolCall(id=f"c{asked}", name=name, arguments={"key": key})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


def _business_key(*, tool: str, arguments: dict[str, Any], **_: Any) -> str:
    """The same business key for every run that books it: one booking, whichever run."""
    return f"{tool}-{arguments['key']}"


class World:
    """The outside systems the tools touch: effects per business key, and the next fault."""

    def __init__(self) -> None:
        self.effects: Counter[str] = Counter()
        self.fault = "none"
        self.hung = asyncio.Event()
        self.held = asyncio.Event()  # "hold": the tool waits for it after its effect
        self.hung_run: str | None = None

    async def effect(self, name: str, key: str, ctx: ToolContext) -> dict[str, str]:
        if self.fault == "model_died":
            return {name: key}  # a fault for the model; the tool runs as usual
        fault, self.fault = self.fault, "none"
        self.hung_run = ctx.run_id
        if fault == "died_before":
            raise Died(f"died before {name} {key}")
        self.effects[f"{name}-{key}"] += 1
        if fault == "died_after":
            raise Died(f"died after {name} {key}")
        if fault == "unknown_after":
            raise ToolOutcomeUnknownError(f"{name} {key}: the reply was lost")
        if fault == "error_after":
            raise RuntimeError(f"{name} {key}: the system said no (after doing it)")
        if fault == "hang_after":
            self.hung.set()
            await asyncio.Event().wait()
        if fault == "hold":
            self.hung.set()
            await self.held.wait()
        return {name: key}


def _agent(world: World) -> Agent:
    @tool(key=_business_key)
    async def book(key: str, ctx: ToolContext) -> dict[str, str]:
        """Book under a business key (side-effecting)."""
        return await world.effect("book", key, ctx)

    @tool(key=_business_key, requires_approval=True)
    async def pay(key: str, ctx: ToolContext) -> dict[str, str]:
        """Pay under a business key (side-effecting, needs a person)."""
        return await world.effect("pay", key, ctx)

    return Agent("booker", "Book and pay.", [book, pay])


def cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix ARGV --store URL`` in this process (its own event loop, in a thread)."""
    out, err = io.StringIO(), io.StringIO()
    got: list[int] = []

    def go() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            got.append(tesserix([*argv, "--store", url]))

    thread = threading.Thread(target=go)
    thread.start()
    thread.join(60)
    assert got, f"tesserix {argv} did not return"
    return got[0], out.getvalue(), err.getvalue()


def _typed_refusal(code: int, err: str, what: Any) -> None:
    """A refusal is a known exit code and one sentence, never a traceback."""
    assert code in EXIT_CODES, (what, code, err)
    if code:
        assert "Traceback" not in err, (what, err)
        assert err.endswith("\n") and err.count("\n") == 1, (what, err)


class Site:
    """A SQLite file, its stores open on one event loop, the world and the agent."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="stateful-ops-"))
        self.url = f"sqlite:///{self.dir / 'adk.sqlite3'}"
        self.loop = asyncio.new_event_loop()
        self.world = World()
        self.agent = _agent(self.world)
        self.stores: Any = self.wait(self._open())

    async def _open(self) -> Any:
        stores = open_stores(self.url)
        await stores.__aenter__()
        await stores.create_schema()
        return stores

    def wait(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def runner(self) -> AgentRunner:
        return AgentRunner.from_stores(
            PlanModel(self.world),
            self.stores,
            lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
            resume_claim_ttl=TTL,
            never_ran_margin=0.05,
        )

    def worker(self, **kwargs: Any) -> Worker:
        return Worker(
            self.runner(),
            [self.agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=FAST,
            drain_timeout=0.05,
            **kwargs,
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait(self.stores.__aexit__(None, None, None))
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- one bounded step of work --------------------------------------------------------

    async def work(self, fault: str, hang_end: str = "drain", meanwhile: Any = None) -> list[Any]:
        """A worker until idle, the next tool call meeting ``fault``; a hung tool ends its
        worker by a drain (cancelled past the drain timeout) or by cancelling the worker.
        A held tool (``hold``) waits, after its effect, until ``meanwhile(run_id)`` (an
        operator's action, in a thread) has returned."""
        self.world.fault = fault
        self.world.hung = asyncio.Event()
        self.world.held = asyncio.Event()
        worker = self.worker()
        task = asyncio.ensure_future(worker.run())
        hung = asyncio.ensure_future(self.world.hung.wait())
        await asyncio.wait({task, hung}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        if hung.done() and not task.done():
            if fault == "hold":
                assert self.world.hung_run is not None
                try:
                    await asyncio.to_thread(meanwhile, self.world.hung_run)
                finally:
                    self.world.held.set()
            elif hang_end == "drain":
                worker.drain()
            else:
                task.cancel()
        hung.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)
        self.world.fault = "none"
        return [how for _, how in worker.carried]

    async def carry_by_hand(self, run_id: str, fault: str) -> str:
        """An operator carries the run on through the Python API (``run --resume``: it
        also starts a run parked before its first frontier). Refusals must be typed."""
        self.world.fault = fault
        try:
            run = await self.runner().resume(self.agent, run_id, tenant=T)
            return str(run.status)
        except AdkError as exc:
            return type(exc).__name__
        except Died:
            return "died"
        finally:
            self.world.fault = "none"

    # --- what the stores and the CLI say -------------------------------------------------

    def runs(self, *extra: str) -> dict[str, dict[str, Any]]:
        code, out, err = cli(self.url, "runs", "--tenant", T, "--json", *extra)
        assert code == 0, err
        return {r["run_id"]: r for r in json.loads(out)["runs"]}

    def inspect(self, run_id: str) -> dict[str, Any] | None:
        code, out, err = cli(self.url, "inspect", run_id, "--tenant", T, "--json")
        _typed_refusal(code, err, ("inspect", run_id))
        return json.loads(out) if code == 0 else None

    async def index(self) -> dict[str, Any]:
        return {i.run_id: i for i in await self.stores.work.items(T)}


class OperatorsAndWorkers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.site = Site()
        self.run_ids: list[str] = []
        self.plans: dict[str, list[str]] = {}
        self.decided: dict[str, tuple[bool, str]] = {}  # request -> (approved, by)
        self.request_of: dict[str, str] = {}  # run -> its approval request
        self.resolved: dict[tuple[str, str], str] = {}  # (run, call) -> how
        self.cancelled_by: dict[str, str] = {}
        self.ended_cancelled: set[str] = set()
        self.denied_keys: set[str] = set()
        self.approved_keys: set[str] = set()

    def teardown(self) -> None:
        try:
            if self.run_ids:
                self.drain()
        finally:
            self.site.close()

    def _run(self, i: int) -> str:
        return self.run_ids[i % len(self.run_ids)]

    # --- rules ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.run_ids) < 4)
    @rule(
        book=st.sampled_from((None, *BOOK_KEYS)),
        pay=st.booleans(),
        pay_first=st.booleans(),
    )
    def submit(self, book: str | None, pay: bool, pay_first: bool) -> None:
        run_id = f"r{len(self.run_ids)}"
        steps = [f"book:{book}"] if book else []
        if pay or not steps:
            steps.insert(0 if pay_first else len(steps), f"pay:p-{run_id}")
        self.site.wait(
            self.site.runner().submit(self.site.agent, " ".join(steps), tenant=T, run_id=run_id)
        )
        self.run_ids.append(run_id)
        self.plans[run_id] = steps

    @precondition(lambda self: self.run_ids)
    @rule(fault=st.sampled_from(FAULTS), hang_end=st.sampled_from(HANG_ENDS))
    def work(self, fault: str, hang_end: str) -> None:
        carried = self.site.wait(self.site.work(fault, hang_end), timeout=60)
        event(f"work {fault}: {sorted(str(c) for c in carried)}")

    @precondition(lambda self: self.run_ids)
    @rule(action=st.sampled_from(("cancel", "resolve", "approve", "deny")))
    def operator_acts_while_a_worker_carries_the_run(self, action: str) -> None:
        """A worker is inside a tool (its effect made, its outcome not yet recorded) while an
        operator acts on that run: the cancel is a request, the call is not decided under
        its live holder, an approval for the run (if it has one) is decided or refused."""
        said: list[tuple[str, int, str, str]] = []

        def act(run_id: str) -> None:
            if action == "cancel":
                said.append((run_id, *self._cancel(run_id, "carol")))
            elif action == "resolve":
                shown = self.site.inspect(run_id)
                calls = [] if shown is None else shown["calls"]
                for call in calls:
                    code, out, err = self._resolve(run_id, call["call_id"], never_ran=False)
                    _typed_refusal(code, err, ("resolve under a live holder", run_id, call))
                    assert code != 0, ("decided under its live holder", run_id, call, out)
                    said.append((run_id, code, out, err))
            else:
                said.append((run_id, *self._decide(run_id, action == "deny", "carol")))

        carried = self.site.wait(self.site.work("hold", meanwhile=act), timeout=60)
        event(f"while carried {action}: {[c for _, c, _, _ in said]} then {carried}")

    @precondition(lambda self: self.run_ids)
    @rule(i=st.integers(0, 3), fault=st.sampled_from(FAULTS[:3]))
    def carry_by_hand(self, i: int, fault: str) -> None:
        event(f"by hand: {self.site.wait(self.site.carry_by_hand(self._run(i), fault))}")

    @rule()
    def clock_past_the_lease(self) -> None:
        self.site.wait(asyncio.sleep(TTL + 0.1))

    @precondition(lambda self: self.run_ids)
    @rule(i=st.integers(0, 3), deny=st.booleans(), by=st.sampled_from(("alice", "bob")))
    def decide(self, i: int, deny: bool, by: str) -> None:
        code, _out, _err = self._decide(self._run(i), deny, by)
        event(f"approve deny={deny}: exit {code}")

    def _decide(self, run_id: str, deny: bool, by: str) -> tuple[int, str, str]:
        shown = self.site.inspect(run_id)
        if shown is not None and shown.get("approval"):
            self.request_of[run_id] = shown["approval"]["id"]
        request = self.request_of.get(run_id)
        if request is None:
            return (-1, "", "no request")
        argv = ["approve", request, "--tenant", T, "--by", by, "--json"]
        code, out, err = cli(self.site.url, *([*argv, "--deny"] if deny else argv))
        _typed_refusal(code, err, ("approve", run_id, deny))
        first = self.decided.get(request)
        if first is None:
            if code == 0:
                self.decided[request] = (not deny, json.loads(out)["by"])
                key = f"pay-p-{run_id}"
                (self.denied_keys if deny else self.approved_keys).add(key)
                assert run_id not in self.ended_cancelled, ("decided after a cancel", out)
            else:
                assert run_id in self.cancelled_by, ("undecided request refused", code, err)
            return code, out, err
        if first[0] == (not deny):
            assert code == 0, ("the same decision again refused", code, err)
            assert json.loads(out)["by"] == first[1], ("two deciders named", out, first)
        else:
            assert code == 4, ("a decision overturned", first, deny, code, out, err)
        return code, out, err

    @precondition(lambda self: self.run_ids)
    @rule(i=st.integers(0, 3), by=st.sampled_from(("alice", "bob")))
    def cancel(self, i: int, by: str) -> None:
        code, out, _err = self._cancel(self._run(i), by)
        event(f"cancel: exit {code} {json.loads(out).get('state') if code == 0 else ''}")

    def _cancel(self, run_id: str, by: str) -> tuple[int, str, str]:
        code, out, err = cli(self.site.url, "cancel", run_id, "--tenant", T, "--by", by, "--json")
        _typed_refusal(code, err, ("cancel", run_id))
        if code != 0:
            return code, out, err
        said = json.loads(out)
        if run_id in self.cancelled_by:
            assert said["by"] == self.cancelled_by[run_id], ("two cancellers", said)
        elif said["state"] in ("cancelled", "cancelled_before_start", "requested"):
            self.cancelled_by[run_id] = said["by"]
        if said["state"] in ("cancelled", "cancelled_before_start"):
            self.ended_cancelled.add(run_id)
        return code, out, err

    @precondition(lambda self: self.run_ids)
    @rule(i=st.integers(0, 3), again=st.booleans())
    def resolve(self, i: int, again: bool) -> None:
        run_id = self._run(i)
        done = [c for (r, c) in self.resolved if r == run_id]
        if again and done:
            call = done[0]
            code, _out, err = self._resolve(run_id, call, never_ran=False)
            _typed_refusal(code, err, ("resolve again", run_id, call))
            assert code == 4, ("a call resolved twice", run_id, call, code, err)
            return
        shown = self.site.inspect(run_id)
        if shown is None:
            return
        doubt = [c for c in shown["calls"] if c["disposition"] == "indeterminate"]
        if not doubt:
            return
        call = doubt[0]
        never_ran = self.site.world.effects[_effect_of(self.plans[run_id], call)] == 0
        code, _out, err = self._resolve(run_id, call["call_id"], never_ran=never_ran)
        _typed_refusal(code, err, ("resolve", run_id, call))
        event(f"resolve never_ran={never_ran}: exit {code}")
        if code == 0:
            self.resolved[(run_id, call["call_id"])] = "never_ran" if never_ran else "completed"

    def _resolve(self, run_id: str, call: str, *, never_ran: bool) -> tuple[int, str, str]:
        how = ["--never-ran", "--margin", "0"] if never_ran else ["--outcome", '{"by": "hand"}']
        return cli(
            self.site.url, "resolve", run_id, "--tenant", T, "--call", call, *how, "--by", "ops"
        )

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def at_most_one_effect_per_business_key(self) -> None:
        twice = {k: n for k, n in self.site.world.effects.items() if n > 1}
        assert not twice, f"sent twice: {twice}"

    @invariant()
    def a_denied_payment_is_never_made(self) -> None:
        made = {k for k in self.denied_keys if self.site.world.effects[k]}
        assert not made, f"denied, then paid: {made}"

    @invariant()
    def no_run_is_lost(self) -> None:
        if not self.run_ids:
            return
        lost = self.site.wait(_lost(self.site, self.run_ids))
        assert not lost, lost

    def drain(self) -> None:
        """Workers, and in-doubt calls resolved as the world knows they went, until nothing
        moves; every run must then be finished, cancelled, failed or waiting on a person.
        A run parked on a call another run claimed under the same business key is woken by
        the resolve on that run (nothing carries it on by hand)."""
        site = self.site
        for _ in range(8):
            site.wait(asyncio.sleep(TTL + 0.1))
            site.wait(site.work("none"), timeout=60)
            moved = False
            for run_id in self.run_ids:
                shown = site.inspect(run_id)
                if shown is None:
                    continue
                for call in shown["calls"]:
                    if call["disposition"] != "indeterminate":
                        continue
                    never_ran = site.world.effects[_effect_of(self.plans[run_id], call)] == 0
                    code, _o, err = self._resolve(run_id, call["call_id"], never_ran=never_ran)
                    _typed_refusal(code, err, ("drain resolve", run_id, call))
                    moved = moved or code == 0
            if not moved and not site.wait(site.stores.work.due(limit=10)):
                break
        self.at_most_one_effect_per_business_key()
        ends = {run_id: _end(site, run_id) for run_id in self.run_ids}
        unended = {r: e for r, e in ends.items() if e is not None}
        assert not unended, f"runs not ended after the drain: {unended}"


def _effect_of(plan: list[str], call: dict[str, Any]) -> str:
    """The business key of a call the model asked for (``c<turn>``: the plan's turn)."""
    name, key = plan[int(call["call_id"][1:])].split(":")
    assert name == call["tool"], (plan, call)
    return _business_key(tool=name, arguments={"key": key})


def _end(site: Site, run_id: str) -> Any:
    """``None`` for a run that ended or waits on a person; else what it is."""
    listed = site.runs().get(run_id)
    if listed is None:
        return "not listed"
    if listed["status"] in ("completed", "cancelled", "failed"):
        return None
    if listed["status"] == "waiting_approval":
        shown = site.inspect(run_id)
        if shown is not None and (shown.get("approval") or {}).get("status") == "pending":
            return None
    return listed


async def _lost(site: Site, run_ids: list[str]) -> dict[str, Any]:
    """Runs unfinished, not waiting on a person, not due for a worker and not listed
    stuck."""
    runs = await asyncio.to_thread(site.runs)
    stuck = await asyncio.to_thread(site.runs, "--stuck")
    index = await site.index()
    lost: dict[str, Any] = {}
    for run_id in run_ids:
        listed = runs.get(run_id)
        item = index.get(run_id)
        if listed is None:
            lost[run_id] = ("not listed by runs", item)
            continue
        status = listed["status"]
        if status in ("completed", "cancelled"):
            continue
        if status == "failed":
            if run_id not in stuck:
                lost[run_id] = ("failed and not listed stuck", listed)
            continue
        if run_id in stuck:
            continue
        if item is not None and item.state in (
            WorkState.decided,
            WorkState.wanted,
            WorkState.submitted,
        ):
            continue
        if status == "waiting_approval":
            shown = await asyncio.to_thread(site.inspect, run_id)
            approval = (shown or {}).get("approval") or {}
            if approval.get("status") == "pending":
                continue
            lost[run_id] = ("waiting on a decision made, nobody wakes it", approval, item)
            continue
        lost[run_id] = (status, listed, item)
    return lost


OperatorsAndWorkers.TestCase.settings = settings(
    # A short profile in CI; ADK_SLOW=1 (or STATEFUL_OPS_EXAMPLES=N) looks further.
    max_examples=int(
        os.environ.get("STATEFUL_OPS_EXAMPLES", "15" if os.environ.get("ADK_SLOW") == "1" else "8")
    ),
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([] if os.environ.get("STATEFUL_OPS_NO_SHRINK") else [Phase.shrink]),
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
TestOperatorsAndWorkers = OperatorsAndWorkers.TestCase


# --- defects the machine found, each as its shrunk sequence -------------------------------


def test_resolving_the_first_run_wakes_the_run_parked_on_its_claim() -> None:
    site = Site()
    try:
        runner = site.runner()
        site.wait(runner.submit(site.agent, "book:k1", tenant=T, run_id="a"))
        site.wait(site.work("died_after"))  # a's booking made, its outcome never recorded
        site.wait(runner.submit(site.agent, "book:k1", tenant=T, run_id="b"))
        site.wait(asyncio.sleep(TTL + 0.2))
        site.wait(site.work("none"))  # a parked in doubt; b parked on a's claim
        code, _out, err = cli(
            site.url, "resolve", "b", "--tenant", T, "--call", "c0", "--outcome", "{}", "--by", "o"
        )
        assert code == 4 and "resolve it on run 'a'" in err, (code, err)
        code, _out, err = cli(
            site.url, "resolve", "a", "--tenant", T, "--call", "c0", "--outcome", "{}", "--by", "o"
        )
        assert code == 0, err
        site.wait(asyncio.sleep(TTL + 0.2))
        site.wait(site.work("none"))
        assert site.world.effects == Counter({"book-k1": 1})
        shown = site.inspect("b")
        assert shown is not None
        # Woken by the resolve on a, taken by a worker, and finished with a's outcome.
        assert shown["status"] == "completed", (shown["status"], shown["parked"])
        assert site.world.effects == Counter({"book-k1": 1})
    finally:
        site.close()
