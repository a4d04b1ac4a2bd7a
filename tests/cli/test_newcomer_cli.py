"""What a newcomer hit in the CLI (issue 21), in-process on memory stores: a finished run is
not carried on again, a decided approval is not "waiting", a damaged transcript is not a
quiet exit 0, an agent named by a file path loads, and an embedding product's provider is
used."""

from __future__ import annotations

import asyncio
import io
import textwrap
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, ScriptedProvider
from tesserix_adk.cli import ExitCode, frontier_main, resume_main
from tesserix_adk.cli.failures import UsageError
from tesserix_adk.cli.loading import load_agent
from tesserix_adk.cli.main import main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def _finished(stores: Stores, airline: Airline) -> None:
    async def go() -> None:
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
        assert str(run.status) == "completed"

    _run(go())


def _interrupted(stores: Stores, airline: Airline) -> None:
    """A run that died right after the model asked for book_seat."""

    async def go() -> None:
        faulty = FaultyCheckpointStore(
            stores.checkpoints,
            crash_after=lambda b: b["boundary"] == "after_model_call" and b["iteration"] == 1,
        )
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(faulty, history=stores.history),
            leases=stores.leases,
            ledger=stores.ledger,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")

    _run(go())


def _waiting(stores: Stores, airline: Airline) -> str:
    async def go() -> str:
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        agent = booking_agent(airline, approval=True)
        run = await runner.run(agent, "book", tenant="acme", run_id="r")
        assert run.pending_approval is not None
        return run.pending_approval.id

    return str(_run(go()))


def _frontier(stores: Stores, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(list(argv), stores=stores, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _resume(stores: Stores, airline: Airline, *extra: str, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        ["run", "--resume", "r", "--tenant", "acme", "--agent", "booking", *extra],
        stores=stores,
        agents={"booking": booking_agent(airline, **kwargs.pop("agent_kwargs", {}))},
        out=out,
        err=err,
        **kwargs,
    )
    return code, out.getvalue(), err.getvalue()


async def _next_fence(stores: Stores) -> int:
    lease = await stores.leases.acquire("acme", "r", "probe", 5.0)
    await stores.leases.release(lease)
    return lease.fence


# --- run --resume on a finished run -----------------------------------------------------


def test_resume_of_a_finished_run_takes_no_lease_and_says_nothing_was_done(
    airline: Airline,
) -> None:
    stores = open_stores("memory://")
    _finished(stores, airline)
    before = _run(_next_fence(stores))
    # No --provider and none in the product: a finished run needs no model at all.
    code, out, err = _resume(stores, airline)
    assert code == ExitCode.CARRIED_ON, err
    assert "completed at step" in out
    assert "nothing was done" in out
    assert "holding the run" not in out
    assert _run(_next_fence(stores)) == before + 1  # the resume took no lease in between
    assert airline.bookings == ["LH123"]


def test_resume_of_a_finished_run_as_json_says_it_did_not_carry_on(airline: Airline) -> None:
    import json

    stores = open_stores("memory://")
    _finished(stores, airline)
    code, out, _ = _resume(stores, airline, "--json")
    assert code == ExitCode.CARRIED_ON
    told = json.loads(out)
    assert told["status"] == "completed" and told["carried_on"] is False
    assert told["holder"] is None and told["fence"] is None


# --- an embedding product's provider ------------------------------------------------------


def test_resume_main_uses_the_provider_the_product_passes(airline: Airline) -> None:
    stores = open_stores("memory://")
    _interrupted(stores, airline)
    code, out, err = _resume(stores, airline, provider=lambda: ScriptedProvider(BOOK_TURNS))
    assert code == ExitCode.CARRIED_ON, err
    assert "now completed" in out
    assert airline.bookings == ["LH123"]


def test_resume_main_without_any_provider_says_how_to_give_one(airline: Airline) -> None:
    stores = open_stores("memory://")
    _interrupted(stores, airline)
    code, _, err = _resume(stores, airline)
    assert code == ExitCode.USAGE
    assert "provider=" in err and err.count("\n") == 1 and "Traceback" not in err


# --- inspect after an approval decision -------------------------------------------------


@pytest.mark.parametrize("deny", [False, True])
def test_inspect_after_a_decision_no_longer_says_waiting(airline: Airline, deny: bool) -> None:
    stores = open_stores("memory://")
    request = _waiting(stores, airline)
    code, out, _ = _frontier(stores, "inspect", "r", "--tenant", "acme")
    assert code == 0 and f"waiting on approval {request}" in out
    _run(stores.approvals.decide("acme", request, approved=not deny, by="alice", note=None))
    code, out, _ = _frontier(stores, "inspect", "r", "--tenant", "acme")
    assert code == 0
    assert "waiting on approval" not in out
    decided = "denied" if deny else "approved"
    assert f"approval {request} {decided} by alice" in out
    assert "a resume carries it on" in out
    code, out, _ = _frontier(stores, "inspect", "r", "--tenant", "acme", "--json")
    import json

    told = json.loads(out)["approval"]
    assert (told["id"], told["status"], told["by"]) == (request, decided, "alice")
    assert told["decided_at"].endswith("Z")


# --- inspect on a damaged transcript ------------------------------------------------------


def test_inspect_of_an_evicted_transcript_prints_the_frontier_and_exits_4(
    airline: Airline,
) -> None:
    stores = open_stores("memory://")
    _interrupted(stores, airline)
    _run(stores.history.forget("acme", "r"))
    code, out, err = _frontier(stores, "inspect", "r", "--tenant", "acme")
    assert code == ExitCode.MUST_NOT_CARRY_ON
    assert out.startswith("run r  tenant acme  agent booking\n")  # what could be read
    assert "transcript" in err and "cannot be carried on" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    code, out, err = _frontier(stores, "inspect", "r", "--tenant", "acme", "--json")
    assert code == ExitCode.MUST_NOT_CARRY_ON
    import json

    assert json.loads(out)["error"]["exit_code"] == 4


# --- approve's suggestion -----------------------------------------------------------------


def test_approve_suggests_a_resume_command_with_agent(airline: Airline) -> None:
    stores = open_stores("memory://")
    request = _waiting(stores, airline)
    code, out, _ = _frontier(
        stores, "approve", request, "--tenant", "acme", "--by", "alice", "--agent", "booking"
    )
    assert code == 0
    assert "`tesserix run --resume r --tenant acme --agent booking`" in out


def test_approve_without_agent_still_names_the_option(airline: Airline) -> None:
    stores = open_stores("memory://")
    request = _waiting(stores, airline)
    code, out, _ = _frontier(stores, "approve", request, "--tenant", "acme", "--by", "alice")
    assert code == 0
    assert "--agent" in out and "'booking'" in out


# --- --agent as a file path ---------------------------------------------------------------

AGENT_FILE = textwrap.dedent(
    """
    from tesserix_adk import Agent, ScriptedProvider, tool

    @tool(side_effects=False)
    def hello(name: str) -> str:
        '''Say hello.'''
        return f"hello {name}"

    agent = Agent("hello", "Greet.", [hello])
    PROVIDER = ScriptedProvider(["hi"])
    """
)


def test_agent_by_file_path_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "greeter_by_path.py").write_text(AGENT_FILE)
    monkeypatch.chdir(tmp_path)
    for ref in ("sub/greeter_by_path.py:agent", "./sub/greeter_by_path.py:agent"):
        assert load_agent(ref, {}).name == "hello"
    assert load_agent(f"{tmp_path}/sub/greeter_by_path.py:agent", {}).name == "hello"


@pytest.mark.parametrize(
    "ref", ["./absent.py:agent", "absent_dir/absent.py:agent", ".relative:agent", "..up:agent"]
)
def test_agent_that_is_no_module_is_one_sentence(
    ref: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as raised:
        load_agent(ref, {})
    assert "module:attr" in str(raised.value)


def test_console_with_a_missing_agent_file_exits_2_in_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    assert main(["--store", store, "schema", "apply"]) == 0
    capsys.readouterr()
    code = main(["--store", store, "run", "--resume", "r", "--tenant", "t", "--agent", "./x.py:a"])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE
    assert err.count("\n") == 1 and "TypeError" not in err and "package" not in err


# --- demo --keep without DIR --------------------------------------------------------------


@pytest.mark.parametrize("keep", [None, "", "DIR"])
def test_demo_keeps_its_files_exactly_when_asked(
    keep: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The acts themselves run real processes (tests/cli/test_cli.py); here they are
    stand-ins, so only what happens to the files is checked."""
    from tesserix_adk.cli import demo

    monkeypatch.setattr(demo, "_act_one", lambda d: 1)
    monkeypatch.setattr(demo, "_act_two", lambda d: 1)
    monkeypatch.setattr(demo._Demo, "tesserix", lambda self, *args: None)
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "temporary"))
    (tmp_path / "temporary").mkdir()
    wanted = str(tmp_path / "kept") if keep == "DIR" else keep
    assert demo.run_demo(keep=wanted) == 0
    out = capsys.readouterr().out
    where = tmp_path / ("kept" if keep == "DIR" else "temporary")
    if keep is None:
        assert not where.exists() and "Explore them" not in out
    else:
        assert (where / "airline.sqlite3").is_file()
        assert f"kept in {where}. Explore them:" in out
