"""Exit 4 for every kind of run that must not be carried on, through ``resume_main`` and
``frontier_main`` in-process (the subprocess tests cover the console script itself)."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, ProviderError, ScriptedProvider
from tesserix_adk.cli import ExitCode, frontier_main, resume_main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.corruption import resealed
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash


def _stores() -> Stores:
    return open_stores("memory://")


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
            ledger=stores.ledger,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")

    asyncio.run(go())


def _resume(
    stores: Stores, airline: Airline, provider: str = "booking:provider"
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        ["run", "--resume", "r", "--tenant", "acme", "--agent", "booking", "--provider", provider],
        stores=stores,
        agents={"booking": booking_agent(airline)},
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def _mutate(stores: Stores, change: Callable[[dict[str, Any]], None]) -> None:
    async def go() -> None:
        latest = await stores.checkpoints.latest("acme", "r")
        assert latest is not None
        # Resealed: a well-formed frontier saying something else, so each case tests the
        # refusal it names rather than the checksum.
        changed = resealed(latest.payload, change)
        await stores.checkpoints.put("acme", "r", changed, step=latest.step + 1, fence=latest.fence)

    asyncio.run(go())


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("tombstone", lambda b: b.update(status="tombstone", reason="over max_bytes")),
        ("newer-format", lambda b: b.update(format=99)),
        ("changed-revision", lambda b: b["agent"].update(revision="sha256:other")),
        ("failed", lambda b: b.update(status="failed")),
    ],
)
def test_exit_4_for_a_frontier_that_must_not_be_carried_on(
    airline: Airline, name: str, change: Callable[[dict[str, Any]], None]
) -> None:
    stores = _stores()
    _interrupted(stores, airline)
    _mutate(stores, change)
    code, _, err = _resume(stores, airline)
    assert code == ExitCode.MUST_NOT_CARRY_ON, err
    assert err.count("\n") == 1 and err.startswith("tesserix: ")
    assert airline.bookings == []


def test_exit_4_for_an_evicted_transcript(airline: Airline) -> None:
    stores = _stores()
    _interrupted(stores, airline)
    _run(stores.history.forget("acme", "r"))
    code, _, err = _resume(stores, airline)
    assert code == ExitCode.MUST_NOT_CARRY_ON and "transcript" in err


def test_exit_4_when_the_resumed_run_ends_failed(airline: Airline) -> None:
    stores = _stores()
    _interrupted(stores, airline)
    code, out, _ = _resume(stores, airline, provider="cli.test_exit_codes:rejecting")
    assert code == ExitCode.MUST_NOT_CARRY_ON
    assert "now failed" in out
    again = _resume(stores, airline)
    assert again[0] == ExitCode.MUST_NOT_CARRY_ON


def test_exit_2_for_a_provider_that_cannot_be_built(airline: Airline) -> None:
    stores = _stores()
    _interrupted(stores, airline)
    code, _, err = _resume(stores, airline, provider="booking:broken_provider")
    assert code == ExitCode.USAGE and "OPENAI_API_KEY" in err


def test_resolve_refuses_while_a_worker_holds_the_run(airline: Airline) -> None:
    stores = _stores()
    _interrupted(stores, airline)
    _run(
        stores.idempotency.claim(
            "k-live",
            holder="w-live",
            tenant="acme",
            run_id="r",
            iteration=1,
            tool="book_seat",
            call_id="call_1_0",
            flags=None,
        )
    )
    _run(stores.leases.acquire("acme", "r", "w-live", 60))
    err = io.StringIO()
    code = frontier_main(
        ["resolve", "r", "--tenant", "acme", "--call", "call_1_0", "--never-ran", "--by", "me"],
        stores=stores,
        out=io.StringIO(),
        err=err,
    )
    assert code == ExitCode.HELD and "w-live" in err.getvalue()


class _Rejects:
    async def complete(self, request: Any) -> Any:
        raise ProviderError("400 bad request: the model refused the input", retryable=False)


def rejecting() -> _Rejects:
    """A provider whose every call is rejected for good."""
    return _Rejects()


# --- tesserix replay ---------------------------------------------------------------------


def _finished(stores: Stores, airline: Airline) -> None:
    async def go() -> None:
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer.from_stores(stores),
            ledger=stores.ledger,
        )
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")

    asyncio.run(go())


def _replay(stores: Stores, airline: Airline, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        [
            "replay",
            "r",
            "--tenant",
            "acme",
            "--agent",
            "booking",
            "--provider",
            "booking:provider",
            *extra,
        ],
        stores=stores,
        agents={"booking": booking_agent(airline)},
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def test_replay_from_a_step_with_a_stub_runs_as_a_new_run(airline: Airline) -> None:
    import booking

    stores = _stores()
    _finished(stores, airline)
    assert _run(stores.checkpoints.steps("acme", "r")) == [1, 2, 3, 4, 5]
    booking.STUB_CALLS.clear()
    code, out, err = _replay(
        stores, airline, "--from-step", "3", "--stub", "book_seat=booking:fake_booking"
    )
    assert code == ExitCode.CARRIED_ON, err
    assert "(replay of r@3) now completed" in out
    assert booking.STUB_CALLS == [{"flight": "LH123"}]
    assert airline.bookings == ["LH123"]  # from the original run only

    stores = _stores()
    _finished(stores, airline)
    code, out, err = _replay(
        stores,
        airline,
        "--from-step",
        "3",
        "--stub",
        "book_seat=booking:fake_booking",
        "--new-run-id",
        "again",
        "--json",
    )
    assert code == ExitCode.CARRIED_ON, err
    replayed = json.loads(out)
    assert (replayed["run_id"], replayed["replay_of"], replayed["status"]) == (
        "again",
        "r@3",
        "completed",
    )


def test_replay_exit_codes(airline: Airline) -> None:
    stores = _stores()
    _finished(stores, airline)
    stub = ("--stub", "book_seat=booking:fake_booking")
    assert _replay(stores, airline, "--from-step", "9", *stub)[0] == ExitCode.NOTHING_CHECKPOINTED
    unstubbed = _replay(stores, airline, "--from-step", "3")
    assert unstubbed[0] == ExitCode.USAGE and "book_seat" in unstubbed[2]
    bad_stub = _replay(stores, airline, "--from-step", "3", "--stub", "book_seat")
    assert bad_stub[0] == ExitCode.USAGE
    _run(stores.checkpoints.put("acme", "r", b'{"format": 1, "ten', step=3))
    corrupt = _replay(stores, airline, "--from-step", "3", *stub)
    assert corrupt[0] == ExitCode.MUST_NOT_CARRY_ON, corrupt


_WITHOUT_EXTRAS = r"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    # As if the ``[ui]`` and ``[postgres]`` extras were never installed.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("starlette", "uvicorn", "psycopg", "psycopg_pool"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Absent())
from tesserix_adk.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["ui", "--port", "0"], 'pip install "tesserix-adk[ui]"'),
        (
            ["runs", "--tenant", "t", "--store", "postgresql://postgres@127.0.0.1:1/x"],
            "tesserix-adk[postgres]",
        ),
    ],
)
def test_a_missing_extra_is_one_sentence_and_exit_2(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    import subprocess
    import sys

    env = {**os.environ, "ADK_STORE": f"sqlite:///{tmp_path / 'ui.sqlite3'}"}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert said in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
