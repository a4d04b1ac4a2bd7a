"""An attack on operator decisions and replay: approve, deny, resolve, cancel and replay,
with a counting tool as the oracle (every real dispatch of ``book`` counts one booking per
flight; a flight booked twice, or booked by a debugging replay, is the defect).

Each test names what the kit must do; those marked ``xfail(strict=True)`` are defects found
on the code they were written against (the reason says which promise breaks), the others
are attacks it withstood.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Recording, answers, at
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    LeasePolicy,
    ReplayNotResumableError,
    RevisionMismatchError,
    RunStatus,
    ScriptedProvider,
    StaleFenceError,
    ToolContext,
    Worker,
    WorkState,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.cli.failures import exit_code_for
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import step_history
from tesserix_adk.stores.protocols import ApprovalStatus, RecordStatus
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "acme"
# A resume that "dies" leaves its resume claim to lapse, as a killed process would.
CLAIM_TTL = 0.2


async def _dead_resumer_lapses() -> None:
    await asyncio.sleep(CLAIM_TTL * 2)


TURNS: list[Any] = [
    [("search", {"origin": "FRA"})],
    [("book", {"flight": "LH1"})],
    "Booked LH1.",
]


class Airline:
    """The outside world: how often each flight was really booked."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.searches = 0
        # Called inside ``book`` with "before" and "after" the booking.
        self.hook: Callable[[str], None] | None = None

    def die_inside_book(self, stage: str) -> None:
        def hook(at: str) -> None:
            if at == stage:
                self.hook = None
                raise SimulatedCrash(f"died {stage} booking")

        self.hook = hook

    def agent(
        self,
        *,
        approval: bool = True,
        key: Any = "default",
        instructions: str = "Book the flight asked for.",
    ) -> Agent:
        airline = self

        @tool(side_effects=False)
        def search(origin: str) -> list[str]:
            """Find flights."""
            airline.searches += 1
            return ["LH1"]

        options: dict[str, Any] = {"requires_approval": approval}
        if key != "default":
            options["key"] = key

        @tool(**options)
        def book(flight: str, ctx: ToolContext) -> dict[str, str]:
            """Book one seat (the real thing)."""
            if airline.hook is not None:
                airline.hook("before")
            airline.sent[flight] += 1
            if airline.hook is not None:
                airline.hook("after")
            return {"booking": f"BK-{flight}-{airline.sent[flight]}"}

        return Agent("booking", instructions, [search, book])


def _runner(stores: Stores, turns: list[Any] | None = None, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(TURNS if turns is None else turns)),
        stores,
        lease_policy=LeasePolicy(ttl=5.0, renew_within=2.0),
        never_ran_margin=0.0,
        resume_claim_ttl=CLAIM_TTL,
        **kwargs,
    )


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Stores]:
    stores = open_stores(url)
    await stores.create_schema()
    async with stores:
        yield stores


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/adk.sqlite3"


async def _cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix <argv>`` in-process against ``url`` (its own stores, its own loop)."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


def _rows(url: str, run_id: str | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table (of ``run_id`` only, where the table names runs)."""
    path = url.removeprefix("sqlite:///")
    found: dict[str, list[tuple[Any, ...]]] = {}
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in sorted(tables):
            columns = [r[1] for r in db.execute(f'PRAGMA table_info("{table}")')]
            if run_id is not None and "run_id" in columns:
                rows = db.execute(f'SELECT * FROM "{table}" WHERE run_id = ?', (run_id,))
            elif run_id is not None:
                continue
            else:
                rows = db.execute(f'SELECT * FROM "{table}"')
            found[table] = sorted(rows.fetchall(), key=repr)
    return found


async def _waiting(stores: Stores, airline: Airline, run_id: str = "r") -> str:
    """A run waiting on the approval of its booking; the request's id."""
    run = await _runner(stores).run(airline.agent(), "book LH1", tenant=T, run_id=run_id)
    assert run.status is RunStatus.waiting_approval
    assert run.pending_approval is not None
    assert airline.sent == Counter()
    return run.pending_approval.id


# --- approvals ---------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["before", "after"])
async def test_an_approved_call_killed_inside_the_tool_is_refused_then_settled_once(
    tmp_path: Path, stage: str
) -> None:
    """Approve, resume, die inside the approved booking (before or after it took effect):
    the next resume refuses to guess (the frontier is still ``before_approval``), the
    operator records what the airline says, and the run ends with exactly one booking."""
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    code, _, err = await _cli(url, "approve", request, "--tenant", T, "--by", "alice")
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        airline.die_inside_book(stage)
        with pytest.raises(SimulatedCrash):
            await _runner(stores).resume(airline.agent(), "r", tenant=T)
        await _dead_resumer_lapses()
        with pytest.raises(IndeterminateToolCallError) as refused:
            await _runner(stores).resume(airline.agent(), "r", tenant=T)
        [doubt] = refused.value.calls
        assert doubt.tool == "book"
    assert airline.sent["LH1"] == (1 if stage == "after" else 0)
    what = (
        ["--outcome", json.dumps({"booking": "BK-LH1-1"})]
        if airline.sent["LH1"]
        else ["--never-ran", "--margin", "0"]
    )
    code, _out, err = await _cli(
        url, "resolve", "r", "--tenant", T, "--call", str(doubt.call_id), *what, "--by", "ops"
    )
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 1})


async def test_approving_twice_is_one_decision_and_one_booking(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    first = await _cli(url, "approve", request, "--tenant", T, "--by", "alice", "--note", "ok")
    assert first[0] == ExitCode.CARRIED_ON, first
    second = await _cli(url, "approve", request, "--tenant", T, "--by", "bob", "--note", "again")
    assert second[0] == ExitCode.CARRIED_ON, second
    async with _opened(url) as stores:
        decided = await stores.approvals.get(T, request)
        assert decided is not None
        assert (decided.status, decided.by, decided.note) == (
            ApprovalStatus.approved,
            "alice",
            "ok",
        )
        for _ in range(2):
            run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
            assert run.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 1})


@pytest.mark.parametrize("first,then", [("approve", "deny"), ("deny", "approve")])
async def test_a_decision_the_other_way_is_refused_exit_4_and_changes_nothing(
    tmp_path: Path, first: str, then: str
) -> None:
    """The first decision stands: the other way is one sentence, exit 4, no row changed;
    a denied call is never sent, also across resumes."""
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)

    def decide(how: str) -> list[str]:
        return ["approve", request, "--tenant", T, "--by", "alice"] + (
            ["--deny", "--note", "over budget"] if how == "deny" else []
        )

    code, _, err = await _cli(url, *decide(first))
    assert code == ExitCode.CARRIED_ON, err
    before = _rows(url)
    code, _out, err = await _cli(url, *decide(then))
    assert code == ExitCode.MUST_NOT_CARRY_ON
    assert err.count("\n") == 1 and "Traceback" not in err and "already decided" in err
    assert _rows(url) == before
    async with _opened(url) as stores:
        for _ in range(2):
            provider = Recording(ScriptedProvider(list(TURNS)))
            run = await AgentRunner.from_stores(provider, stores).resume(
                airline.agent(), "r", tenant=T
            )
            assert run.status is RunStatus.completed
    assert airline.sent == (Counter({"LH1": 1}) if first == "approve" else Counter())


async def test_a_denied_call_killed_after_the_denial_is_never_sent_on_resume(
    tmp_path: Path,
) -> None:
    """Deny, then the resume dies right after the denial reached the model (before its
    ``after_tool_result`` frontier is durable, with a policy that skips it): the next
    resume takes the denial again and never sends the call."""
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    code, _, err = await _cli(url, "approve", request, "--tenant", T, "--by", "bob", "--deny")
    assert code == ExitCode.CARRIED_ON, err

    class Dies:
        def __init__(self) -> None:
            self.inner = ScriptedProvider(list(TURNS))

        async def complete(self, request: Any) -> Any:
            raise SimulatedCrash("died asking the model after the denial")

    async with _opened(url) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(Dies(), stores, resume_claim_ttl=CLAIM_TTL).resume(
                airline.agent(), "r", tenant=T
            )
        await _dead_resumer_lapses()
        provider = Recording(ScriptedProvider(list(TURNS)))
        run = await AgentRunner.from_stores(provider, stores).resume(airline.agent(), "r", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.sent == Counter()
    [denial] = answers(provider.requests[-1], "book")
    assert denial.text == "denied by bob"


async def test_approve_from_another_tenant_or_an_unknown_id_is_exit_1_and_changes_nothing(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    before = _rows(url)
    for argv in (
        ["approve", request, "--tenant", "other", "--by", "mallory"],
        ["approve", "req-000000000000000000000000", "--tenant", T, "--by", "alice"],
    ):
        code, out, err = await _cli(url, *argv)
        assert code == ExitCode.NOTHING_CHECKPOINTED, (code, out, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    assert _rows(url) == before
    async with _opened(url) as stores:
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
    assert run.status is RunStatus.waiting_approval
    assert airline.sent == Counter()


async def test_approving_one_runs_request_never_approves_another_run(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        first = await _waiting(stores, airline, "r1")
        second = await _waiting(stores, airline, "r2")
    assert first != second
    code, _, err = await _cli(url, "approve", first, "--tenant", T, "--by", "alice")
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        other = await _runner(stores).resume(airline.agent(), "r2", tenant=T)
        assert other.status is RunStatus.waiting_approval
        assert airline.sent == Counter()
        done = await _runner(stores).resume(airline.agent(), "r1", tenant=T)
        assert done.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 1})


async def test_approve_after_the_agent_changed_is_refused_on_resume_with_nothing_sent(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    code, _, err = await _cli(url, "approve", request, "--tenant", T, "--by", "alice")
    assert code == ExitCode.CARRIED_ON, err
    changed = airline.agent(instructions="Book whatever is cheapest.")
    async with _opened(url) as stores:
        with pytest.raises(RevisionMismatchError):
            await _runner(stores).resume(changed, "r", tenant=T)
        assert airline.sent == Counter()
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 1})


async def test_an_approval_note_with_a_secret_reaches_no_store_and_not_the_model(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    secret = "sk-proj-" + "A1b2C3d4" * 6
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    code, _, err = await _cli(
        url, "approve", request, "--tenant", T, "--by", "bob", "--deny", "--note", f"key {secret}"
    )
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        provider = Recording(ScriptedProvider(list(TURNS)))
        run = await AgentRunner.from_stores(provider, stores).resume(airline.agent(), "r", tenant=T)
    assert run.status is RunStatus.completed
    [denial] = answers(provider.requests[-1], "book")
    assert secret not in str(denial.text) and str(denial.text).startswith("denied by bob: key ")
    assert secret not in repr(_rows(url))
    assert airline.sent == Counter()


async def test_a_long_denial_note_never_turns_the_runs_frontiers_into_tombstones(
    tmp_path: Path,
) -> None:
    """An operator denies one turn of nine bookings with a 120 KB note (under the 128 KiB
    a single command-line argument may carry on Linux, so ``tesserix approve --note`` takes
    it). The run must end with a readable final frontier, or the note be refused."""
    url = _url(tmp_path)
    airline = Airline()
    turns: list[Any] = [[("book", {"flight": f"F{i}"}) for i in range(9)], "Nothing booked."]
    async with _opened(url) as stores:
        run = await _runner(stores, turns).run(airline.agent(), "book", tenant=T, run_id="r")
        assert run.pending_approval is not None
        request = run.pending_approval.id
    note = "x" * 120_000
    before = _rows(url)
    code, _, err = await _cli(
        url, "approve", request, "--tenant", T, "--by", "bob", "--deny", "--note", note
    )
    if code != ExitCode.CARRIED_ON:  # refused: one sentence, nothing written
        assert err.count("\n") == 1 and "Traceback" not in err
        assert _rows(url) == before
        return
    async with _opened(url) as stores:
        runner = _runner(stores, turns)
        run = await runner.resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.completed
        assert airline.sent == Counter()
        latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
        assert latest is not None
        assert not latest.is_tombstone, latest.reason


async def test_a_note_longer_than_the_cli_takes_is_refused_in_one_sentence(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        run = await _runner(stores).run(airline.agent(), "book", tenant=T, run_id="r")
        assert run.pending_approval is not None
        request = run.pending_approval.id
    before = _rows(url)
    code, _, err = await _cli(
        url, "approve", request, "--tenant", T, "--by", "bob", "--deny", "--note", "x" * 4001
    )
    assert code == ExitCode.USAGE
    assert err.count("\n") == 1 and "at most 4000" in err and "Traceback" not in err
    assert _rows(url) == before


async def test_a_long_note_decided_through_the_api_reaches_the_run_abridged_not_as_tombstones(
    tmp_path: Path,
) -> None:
    """The store takes any note; the run's grants carry at most 4,000 characters of it
    (and say where the rest is), so nine denied calls still fit in a frontier."""
    url = _url(tmp_path)
    airline = Airline()
    turns: list[Any] = [[("book", {"flight": f"F{i}"}) for i in range(9)], "Nothing booked."]
    async with _opened(url) as stores:
        runner = _runner(stores, turns)
        run = await runner.run(airline.agent(), "book", tenant=T, run_id="r")
        assert run.pending_approval is not None
        request = run.pending_approval.id
        await stores.approvals.decide(T, request, approved=False, by="bob", note="y" * 120_000)
        run = await runner.resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.completed
        assert airline.sent == Counter()
        latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
        assert latest is not None and not latest.is_tombstone
        answers_told = [
            m.text for m in await runner.checkpoints.messages(latest) if m.role == "tool"
        ]  # type: ignore[union-attr]
        assert len(answers_told) == 9
        for told in answers_told:
            assert "y" * 4000 in told and "y" * 4001 not in told
            assert f"116000 characters more in approval {request}" in told
        decided = await stores.approvals.get(T, request)
        assert decided is not None and decided.note == "y" * 120_000


# --- resolve -----------------------------------------------------------------------------


async def _in_doubt(stores: Stores, airline: Airline, *, stage: str = "after") -> Any:
    """A run (no approvals) that died inside ``book``; the call the resume refuses."""
    airline.die_inside_book(stage)
    agent = airline.agent(approval=False)
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book LH1", tenant=T, run_id="r")
    with pytest.raises(IndeterminateToolCallError) as refused:
        await _runner(stores).resume(agent, "r", tenant=T)
    [doubt] = refused.value.calls
    return doubt


async def test_resolve_never_ran_on_a_completed_call_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    agent = airline.agent(approval=False)
    async with _opened(url) as stores:
        run = await _runner(stores).run(agent, "book LH1", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        [rec] = [r for r in await stores.idempotency.records(T, "r") if r.tool == "book"]
    before = _rows(url)
    for what in (["--never-ran", "--margin", "0"], ["--outcome", '{"booking": "forged"}']):
        code, out, err = await _cli(
            url, "resolve", "r", "--tenant", T, "--call", str(rec.call_id), *what, "--by", "ops"
        )
        assert code == ExitCode.MUST_NOT_CARRY_ON, (code, out, err)
        assert err.count("\n") == 1 and "not in flight" in err and "Traceback" not in err
    assert _rows(url) == before
    assert airline.sent == Counter({"LH1": 1})


async def test_resolving_twice_keeps_the_first_outcome_and_sends_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        doubt = await _in_doubt(stores, airline)
    base = ["resolve", "r", "--tenant", T, "--call", str(doubt.call_id), "--by"]
    code, _, err = await _cli(url, *base, "alice", "--outcome", '{"booking": "BK-LH1-1"}')
    assert code == ExitCode.CARRIED_ON, err
    before = _rows(url)
    for what in (["--outcome", '{"booking": "BK-OTHER"}'], ["--never-ran", "--margin", "0"]):
        code, out, err = await _cli(url, *base, "bob", *what)
        assert code == ExitCode.MUST_NOT_CARRY_ON, (code, out, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    assert _rows(url) == before
    async with _opened(url) as stores:
        provider = Recording(ScriptedProvider(list(TURNS)))
        run = await AgentRunner.from_stores(provider, stores).resume(
            airline.agent(approval=False), "r", tenant=T
        )
    assert run.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "book")
    assert json.loads(str(told.text)) == {"booking": "BK-LH1-1"}
    assert airline.sent == Counter({"LH1": 1})


@pytest.mark.parametrize(
    "argv,code",
    [
        (["resolve", "nope", "--tenant", T, "--call", "call_1_0", "--never-ran"], 1),
        (["resolve", "r", "--tenant", T, "--call", "call_9_9", "--never-ran"], 1),
        (["resolve", "r", "--tenant", "other", "--call", "call_1_0", "--never-ran"], 1),
        (["resolve", "r", "--tenant", T, "--call", "call_1_0", "--outcome", "{not json"], 2),
        (["resolve", "r", "--tenant", T, "--call", "call_1_0", "--outcome", ""], 2),
        (["resolve", "r", "--tenant", T, "--call", "call_1_0"], 2),
        (
            ["resolve", "r", "--tenant", T, "--call", "call_1_0", "--never-ran", "--outcome", "1"],
            2,
        ),
        (["resolve", "r", "--tenant", T, "--call", "call_1_0", "--never-ran", "--margin", "-1"], 2),
    ],
)
async def test_a_bad_resolution_is_one_sentence_and_its_exit_code_with_nothing_written(
    tmp_path: Path, argv: list[str], code: int
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        doubt = await _in_doubt(stores, airline)
    assert doubt.call_id == "call_1_0"
    before = _rows(url)
    got, out, err = await _cli(url, *argv, "--by", "ops")
    assert got == code, (got, out, err)
    assert err.count("\n") == 1 and err.startswith("tesserix: ") and "Traceback" not in err
    assert _rows(url) == before


async def test_a_late_completion_by_the_old_holder_loses_to_the_operators_outcome(
    tmp_path: Path,
) -> None:
    """The holder that was inside the tool wakes after an operator recorded the outcome and
    records its own: refused (stale), the operator's stands, and nothing is sent again."""
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        doubt = await _in_doubt(stores, airline)
        old = doubt.record.holder
    code, _, err = await _cli(
        url, "resolve", "r", "--tenant", T, "--call", doubt.call_id, "--by", "ops",
        "--outcome", '{"booking": "BK-LH1-1"}',
    )  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        late = encode_outcome(ToolOutcome(call_id="call_1_0", content={"late": 1}), Redactor())
        with pytest.raises(StaleFenceError):
            await stores.idempotency.complete(doubt.key, late, tenant=T, holder=old)
        [rec] = (await stores.idempotency.lookup([doubt.key], tenant=T)).values()
        assert rec.status is RecordStatus.completed and rec.by == "ops"
        run = await _runner(stores).resume(airline.agent(approval=False), "r", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 1})


async def test_a_late_completion_after_never_ran_is_refused_and_does_not_undo_it(
    tmp_path: Path,
) -> None:
    """The operator's ``--never-ran`` stands against a late completion of the old holder
    (refused, not merged), and the resume sends the call once. Had the old holder's call
    landed, that would be the second booking README step 3 of "Deciding" warns of: the
    margin cannot cover a tool stalled inside itself; a fence downstream does."""
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        doubt = await _in_doubt(stores, airline, stage="before")
        old = doubt.record.holder
    code, _, err = await _cli(
        url, "resolve", "r", "--tenant", T, "--call", doubt.call_id, "--by", "ops",
        "--never-ran", "--margin", "0",
    )  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        late = encode_outcome(ToolOutcome(call_id="call_1_0", content={"late": 1}), Redactor())
        with pytest.raises(StaleFenceError):
            await stores.idempotency.complete(doubt.key, late, tenant=T, holder=old)
        run = await _runner(stores).resume(airline.agent(approval=False), "r", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 1})


# --- cancel ------------------------------------------------------------------------------


async def test_cancel_then_approve_then_a_worker_sends_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
        ended = await _runner(stores).cancel("r", tenant=T, by="ops", reason="customer left")
        assert ended is not None and ended.status is RunStatus.cancelled
    code, _out, err = await _cli(url, "approve", request, "--tenant", T, "--by", "alice")
    # Refused: the run waits on nothing now (the console's stale page hits the same).
    assert code == ExitCode.MUST_NOT_CARRY_ON and "was cancelled" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    async with _opened(url) as stores:
        worker = Worker(_runner(stores), [airline.agent()], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.cancelled
    assert airline.sent == Counter()


async def test_approve_then_cancel_then_resume_sends_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    code, _, err = await _cli(url, "approve", request, "--tenant", T, "--by", "alice")
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        await _runner(stores).cancel("r", tenant=T, by="ops")
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.cancelled
    assert airline.sent == Counter()


async def test_a_cancel_while_the_approved_call_is_in_flight_lets_it_finish_once(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
        await stores.approvals.decide(T, request, approved=True, by="alice")
        inside, go = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def hook(stage: str) -> None:
            if stage == "before":
                loop.call_soon_threadsafe(inside.set)
                asyncio.run_coroutine_threadsafe(go.wait(), loop).result(10)

        airline.hook = hook
        resuming = asyncio.create_task(_runner(stores).resume(airline.agent(), "r", tenant=T))
        await asyncio.wait_for(inside.wait(), 10)
        assert await _runner(stores).cancel("r", tenant=T, by="ops") is None
        go.set()
        run = await asyncio.wait_for(resuming, 10)
        assert run.status is RunStatus.cancelled
        again = await _runner(stores).resume(airline.agent(), "r", tenant=T)
        assert again.status is RunStatus.cancelled
    assert airline.sent == Counter({"LH1": 1})


async def test_a_run_cancelled_with_a_call_in_doubt_never_sends_it(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        doubt = await _in_doubt(stores, airline, stage="before")
        ended = await _runner(stores).cancel("r", tenant=T, by="ops")
        assert ended is not None and ended.status is RunStatus.cancelled
    code, _, err = await _cli(
        url, "resolve", "r", "--tenant", T, "--call", doubt.call_id, "--by", "ops",
        "--never-ran", "--margin", "0",
    )  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err  # accepted; nothing is sent (below)
    async with _opened(url) as stores:
        worker = Worker(
            _runner(stores), [airline.agent(approval=False)], exit_when_idle=True,
            poll_interval=0.01,
        )  # fmt: skip
        await asyncio.wait_for(worker.run(), 30)
        run = await _runner(stores).resume(airline.agent(approval=False), "r", tenant=T)
        assert run.status is RunStatus.cancelled
    assert airline.sent == Counter()


# --- replay ------------------------------------------------------------------------------


def _stub(flight: str) -> dict[str, str]:
    return {"booking": "BK-STUB"}


async def _finished_run_with_approval(url: str, airline: Airline) -> list[int]:
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
        await stores.approvals.decide(T, request, approved=True, by="alice")
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.completed
        return list(await step_history(stores.checkpoints).steps(T, "r"))


async def test_replay_from_every_step_never_books_and_never_touches_the_original(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    steps = await _finished_run_with_approval(url, airline)
    assert airline.sent == Counter({"LH1": 1})
    original = _rows(url, "r")
    async with _opened(url) as stores:
        for step in steps:
            run = await _runner(stores).replay(
                airline.agent(), "r", tenant=T, from_step=step, stubs={"book": _stub}
            )
            assert run.run_id != "r"
            assert run.status is RunStatus.completed or run.pending_approval is not None
    assert airline.sent == Counter({"LH1": 1})
    assert _rows(url, "r") == original


async def test_a_replay_that_waits_on_approval_never_books_for_real(tmp_path: Path) -> None:
    """A replay with ``book`` stubbed reaches the approval again and waits; approving its
    request (which wakes it for a worker, as ``approve`` does) must not lead to a real
    booking: the replay's stubs are gone once another attempt carries it on."""
    url = _url(tmp_path)
    airline = Airline()
    steps = await _finished_run_with_approval(url, airline)
    async with _opened(url) as stores:
        replayed = await _runner(stores).replay(
            airline.agent(), "r", tenant=T, from_step=steps[0], stubs={"book": _stub}
        )
    assert replayed.status is RunStatus.waiting_approval
    assert replayed.pending_approval is not None
    code, _out, err = await _cli(
        url, "approve", replayed.pending_approval.id, "--tenant", T, "--by", "alice"
    )
    # Refused: nothing would carry the replay on (a page or a script shows the request).
    assert code == ExitCode.MUST_NOT_CARRY_ON and "replay again" in err
    async with _opened(url) as stores:
        # Approved through the store all the same, and woken for a worker.
        request = replayed.pending_approval.id
        await stores.approvals.decide(T, request, approved=True, by="alice")
        await stores.work.want(T, replayed.run_id, agent="booking", state=WorkState.decided)  # type: ignore[union-attr]
        worker = Worker(_runner(stores), [airline.agent()], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        # The worker parks it, saying why, rather than carrying it on.
        [parked] = [i for i in await stores.work.items(T) if i.run_id == replayed.run_id]  # type: ignore[union-attr]
        assert parked.state is WorkState.parked
        assert "ReplayNotResumableError" in (parked.reason or "")
    assert airline.sent == Counter({"LH1": 1})


async def test_a_replay_resumed_after_it_stopped_never_books_for_real(tmp_path: Path) -> None:
    """The same through ``run --resume`` of the replay's id (the command ``approve``
    prints for it): a debugging replay is never carried on with the real tool."""
    url = _url(tmp_path)
    airline = Airline()
    steps = await _finished_run_with_approval(url, airline)
    async with _opened(url) as stores:
        replayed = await _runner(stores).replay(
            airline.agent(), "r", tenant=T, from_step=steps[0], stubs={"book": _stub}
        )
        assert replayed.pending_approval is not None
        await stores.approvals.decide(T, replayed.pending_approval.id, approved=True, by="a")
        with pytest.raises(ReplayNotResumableError, match="replay again"):
            await _runner(stores).resume(airline.agent(), replayed.run_id, tenant=T)
    assert airline.sent == Counter({"LH1": 1})
    # `tesserix run --resume` of it exits 4: it must not be carried on.
    assert exit_code_for(ReplayNotResumableError("x")) == ExitCode.MUST_NOT_CARRY_ON


async def test_a_stubbed_replay_never_hands_its_stub_outcome_to_the_original_run(
    tmp_path: Path,
) -> None:
    """A tool keyed by a business key (the order, not the run): the original run died
    before it booked; a replay from its last step stubs the booking. Resuming the
    original must book for real, not be told the stub's fake booking."""
    url = _url(tmp_path)
    airline = Airline()

    def by_flight(**kw: Any) -> str:
        return f"booking-{kw['arguments']['flight']}"

    agent = airline.agent(approval=False, key=by_flight)

    async with _opened(url) as stores:
        airline.die_inside_book("before")
        # Dies at the booking's start, before the airline saw it: resolved as never ran.
        with pytest.raises(SimulatedCrash):
            await _runner(stores).run(agent, "book LH1", tenant=T, run_id="r")
        with pytest.raises(IndeterminateToolCallError) as refused:
            await _runner(stores).resume(agent, "r", tenant=T)
        [doubt] = refused.value.calls
    code, _, err = await _cli(
        url, "resolve", "r", "--tenant", T, "--call", doubt.call_id, "--by", "ops",
        "--never-ran", "--margin", "0",
    )  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        last = max(await step_history(stores.checkpoints).steps(T, "r"))
        replayed = await _runner(stores).replay(
            agent, "r", tenant=T, from_step=last, stubs={"book": _stub}
        )
        assert replayed.status is RunStatus.completed
        assert airline.sent == Counter()
        provider = Recording(ScriptedProvider(list(TURNS)))
        run = await AgentRunner.from_stores(provider, stores).resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "book")
    assert "STUB" not in str(told.text)
    assert airline.sent == Counter({"LH1": 1})


async def test_a_replay_of_a_run_waiting_on_approval_leaves_its_request_alone(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
    original = _rows(url, "r")
    async with _opened(url) as stores:
        last = max(await step_history(stores.checkpoints).steps(T, "r"))
        replayed = await _runner(stores).replay(
            airline.agent(), "r", tenant=T, from_step=last, stubs={"book": _stub}
        )
        assert replayed.status is RunStatus.waiting_approval
        assert replayed.pending_approval is not None
        assert replayed.pending_approval.id != request
        await stores.approvals.decide(T, replayed.pending_approval.id, approved=True, by="a")
        mine = await stores.approvals.get(T, request)
        assert mine is not None and mine.status is ApprovalStatus.pending
    assert _rows(url, "r") == original
    async with _opened(url) as stores:
        run = await _runner(stores).resume(airline.agent(), "r", tenant=T)
        assert run.status is RunStatus.waiting_approval
    assert airline.sent == Counter()


async def test_a_replay_from_the_final_step_is_labelled_as_a_replay(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    steps = await _finished_run_with_approval(url, airline)
    async with _opened(url) as stores:
        run = await _runner(stores).replay(
            airline.agent(), "r", tenant=T, from_step=steps[-1], stubs={"book": _stub}
        )
        assert run.run_id != "r"
        assert run.replay_of == f"r@{steps[-1]}"


async def test_a_replay_never_takes_the_id_of_a_submitted_run(tmp_path: Path) -> None:
    """``new_run_id`` naming a run that was submitted but not started yet (it has no
    frontier): the replay must be refused, and the worker start the submitted run."""
    url = _url(tmp_path)
    airline = Airline()
    steps = await _finished_run_with_approval(url, airline)
    agent = airline.agent()
    async with _opened(url) as stores:
        await _runner(stores).submit(agent, "book LH1", tenant=T, run_id="order-7")
        with contextlib.suppress(Exception):
            await _runner(stores).replay(
                agent, "r", tenant=T, from_step=steps[0], stubs={"book": _stub},
                new_run_id="order-7",
            )  # fmt: skip
        worker = Worker(_runner(stores), [agent], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        latest = await _runner(stores).checkpoints.latest(T, "order-7")  # type: ignore[union-attr]
        assert latest is not None
        assert latest.replay_of is None  # the submitted run itself, not a replay


@pytest.mark.parametrize(
    "where",
    [
        "before the after_tool_result frontier",
        "right after the after_tool_result frontier",
        "asking the model after the booking",
    ],
)
async def test_an_approved_call_that_completed_before_a_death_is_replayed_not_resent(
    tmp_path: Path, where: str
) -> None:
    url = _url(tmp_path)
    airline = Airline()
    async with _opened(url) as stores:
        request = await _waiting(stores, airline)
        await stores.approvals.decide(T, request, approved=True, by="alice")
        inner = stores.checkpoints
        if where.startswith("before"):
            stores.checkpoints = FaultyCheckpointStore(
                inner, crash_before=at("after_tool_result", 1)
            )
        elif where.startswith("right after"):
            stores.checkpoints = FaultyCheckpointStore(
                inner, crash_after=at("after_tool_result", 1)
            )

        class DiesOnLastTurn:
            def __init__(self) -> None:
                self.inner = ScriptedProvider(list(TURNS))

            async def complete(self, request: Any) -> Any:
                if where.startswith("asking") and request.iteration == 2:
                    raise SimulatedCrash("died asking the model")
                return await self.inner.complete(request)

        dying = AgentRunner.from_stores(
            DiesOnLastTurn(), stores, never_ran_margin=0.0, resume_claim_ttl=CLAIM_TTL
        )
        with pytest.raises(SimulatedCrash):
            await dying.resume(airline.agent(), "r", tenant=T)
        stores.checkpoints = inner
        await _dead_resumer_lapses()
        assert airline.sent == Counter({"LH1": 1})
        provider = Recording(ScriptedProvider(list(TURNS)))
        run = await AgentRunner.from_stores(provider, stores).resume(airline.agent(), "r", tenant=T)
    assert run.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "book")
    assert json.loads(str(told.text)) == {"booking": "BK-LH1-1"}
    assert airline.sent == Counter({"LH1": 1})
