"""A run's state as the stores keep it (``checkpoint/state_json.py``): where its stored form
loses a value (``lost_values``, a hypothesis property against the planted secrets as
oracle), the ``state_redacted`` mark a frontier carries in format 5, and who refuses to
carry such a run on: the runner's resume, a worker (which parks it), ``tesserix run
--resume`` (exit 4) and a replay with live tools."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from run.helpers import at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    ScriptedProvider,
    StateRedactedError,
    ToolContext,
    Worker,
    tool,
)
from tesserix_adk.checkpoint.payload import (
    CARRIER_FORMAT,
    MASKED_STATE_FORMAT,
    Boundary,
    Carrier,
    Checkpoint,
    CheckpointStatus,
    decode_checkpoint,
    encode_checkpoint,
)
from tesserix_adk.checkpoint.payload.envelope import seal, unseal
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.checkpoint.state_json import lost_values, state_to_json
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.testing.secrets import planted_secrets

T = "acme"
SECRETS = planted_secrets()
# Keys no rule treats as a credential's name, values no pattern takes for a secret.
_PLAIN_KEY = st.sampled_from(["city", "seats", "note", "items", "when", "level"])
_PLAIN = st.text(alphabet="abcdefghij ", max_size=8) | st.integers(-5, 5) | st.booleans()


@st.composite
def _planted_state(draw: st.DrawFn) -> tuple[Any, set[str]]:
    """A JSON state, some of whose leaves are planted secrets: the state and their paths."""
    planted: set[str] = set()

    def leaf(path: str) -> Any:
        if draw(st.integers(0, 3)) == 0:
            planted.add(path)
            return SECRETS[draw(st.sampled_from(sorted(SECRETS)))]
        return draw(_PLAIN)

    def node(path: str, depth: int) -> Any:
        shape = draw(st.sampled_from(["leaf", "map", "list"] if depth < 3 else ["leaf"]))
        if shape == "map":
            keys = draw(st.lists(_PLAIN_KEY, unique=True, max_size=3))
            return {k: node(f"{path}.{k}" if path else k, depth + 1) for k in keys}
        if shape == "list":
            return [node(f"{path}[{i}]", depth + 1) for i in range(draw(st.integers(0, 3)))]
        return leaf(path)

    keys = draw(st.lists(_PLAIN_KEY, unique=True, min_size=1, max_size=4))
    return {k: node(k, 1) for k in keys}, planted


@settings(max_examples=60, deadline=None)
@given(_planted_state())
def test_lost_values_names_exactly_the_planted_secrets(drawn: tuple[Any, set[str]]) -> None:
    state, planted = drawn
    data = state_to_json(state, None)
    assert set(lost_values(state, data, None, Redactor())) == planted


def test_a_pydantic_secret_type_is_lost_and_a_string_that_reads_like_its_mask_is_not() -> None:
    class Vault(pydantic.BaseModel):
        pin: pydantic.SecretStr
        shown: str = "**********"
        token: int = 7  # a number under a credential's name stays

    vault = Vault(pin="1234")
    data = state_to_json(vault, Vault)
    assert lost_values(vault, data, Vault, Redactor()) == ["pin"]
    assert lost_values(vault, data, Vault, Redactor(enabled=False)) == ["pin"]


# --- the frontier's mark -------------------------------------------------------------------


def _frontier(state: Any, **changes: Any) -> Checkpoint:
    cp = Checkpoint(
        tenant=T,
        run_id="r",
        agent_name="a",
        agent_revision="rev",
        step=3,
        boundary=Boundary.after_model_call,
        status=CheckpointStatus.running,
        messages=(),
        state=state,
    )
    return replace(cp, **changes)


def test_a_masked_state_is_written_in_its_own_format_and_read_back_marked() -> None:
    plain = encode_checkpoint(_frontier({"city": "Oslo"}), Redactor())
    assert json.loads(plain)["format"] == 2 and b"state_redacted" not in plain
    assert decode_checkpoint(plain, tenant=T, run_id="r").state_redacted is False

    masked = encode_checkpoint(_frontier({"api_token": "tok-real-1"}), Redactor())
    body = json.loads(masked)
    assert body["format"] == MASKED_STATE_FORMAT and body["state_redacted"] is True
    assert b"tok-real-1" not in masked
    read = decode_checkpoint(masked, tenant=T, run_id="r")
    assert read.state_redacted and read.carried_by is None

    # Marked by the kit (a pydantic secret type), with a carrier: format 5 names both.
    both = encode_checkpoint(
        _frontier({"pin": "**********"}, state_redacted=True, carried_by=Carrier.temporal),
        Redactor(),
    )
    read = decode_checkpoint(both, tenant=T, run_id="r")
    assert read.state_redacted and read.carried_by is Carrier.temporal
    carried = encode_checkpoint(_frontier({}, carried_by=Carrier.temporal), Redactor())
    assert json.loads(carried)["format"] == CARRIER_FORMAT


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda b: b.pop("state_redacted"), id="mark-dropped"),
        pytest.param(lambda b: b.update(state_redacted=False), id="mark-false"),
        pytest.param(lambda b: b.update(state_redacted=1), id="mark-not-a-bool"),
        pytest.param(lambda b: b.update(format=CARRIER_FORMAT), id="format-4-with-mark"),
    ],
)
def test_a_frontier_whose_mark_does_not_hold_is_corrupt(change: Any) -> None:
    body, _ = unseal(encode_checkpoint(_frontier({"password": "hunter2"}), Redactor()), what="x")
    change(body)
    with pytest.raises(CheckpointCorruptError):
        decode_checkpoint(seal(body), tenant=T, run_id="r")


# --- who refuses to carry it on ------------------------------------------------------------


class Trip(pydantic.BaseModel):
    api_token: str = ""
    booked: list[str] = []


def _trip_agent(sent: list[str]) -> Agent:
    @tool
    def book(flight: str, ctx: ToolContext) -> str:
        """Book (fetches the run's token the first time)."""
        if not ctx.state.api_token:
            ctx.state.api_token = "tok-live-777-real"
        sent.append(f"{flight}:{ctx.state.api_token}")
        ctx.state.booked.append(flight)
        return f"booked {flight}"

    return Agent("trip", "Book.", [book], state_schema=Trip)


TURNS = [[("book", {"flight": "LH1"})], [("book", {"flight": "LH2"})], "done"]


async def _crashed_with_a_secret_in_its_state(stores: Any, sent: list[str]) -> Agent:
    agent = _trip_agent(sent)
    runner = faulty_runner(stores, ScriptedProvider(TURNS), crash_before=at("after_tool_result", 1))
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "go", tenant=T, run_id="trip", state=Trip())
    assert sent == ["LH1:tok-live-777-real", "LH2:tok-live-777-real"]
    return agent


async def test_a_worker_parks_a_run_whose_state_lost_a_secret(tmp_path: Path) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = await _crashed_with_a_secret_in_its_state(stores, sent)
        runner = AgentRunner.from_stores(ScriptedProvider(TURNS), stores)
        with pytest.raises(StateRedactedError) as refused:
            await runner.resume(agent, "trip", tenant=T)
        assert refused.value.retryable is False and "tok-live" not in str(refused.value)
        worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
        await worker.run()
        assert stores.work is not None
        item = await stores.work.entry(T, "trip")
        assert item is not None and str(item.state) == "parked"
        assert (item.reason or "").startswith("StateRedactedError:")
    assert len(sent) == 2  # nothing sent with the mask


async def test_a_replay_refuses_live_tools_on_a_masked_state_and_runs_stubbed(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = await _crashed_with_a_secret_in_its_state(stores, sent)
        runner = AgentRunner.from_stores(ScriptedProvider(TURNS), stores)
        with pytest.raises(ConfigurationError, match="stub book"):
            await runner.replay(agent, "trip", tenant=T, from_step=2, stubs={}, live=["book"])
        stubbed: list[Any] = []
        run = await runner.replay(
            agent,
            "trip",
            tenant=T,
            from_step=2,
            stubs={"book": lambda flight: stubbed.append(flight) or "stubbed"},
        )
        assert str(run.status) == "completed" and stubbed == ["LH2"]
    assert len(sent) == 2


def test_tesserix_run_resume_refuses_it_in_one_sentence_exit_4(tmp_path: Path) -> None:
    module = tmp_path / "trip_state_agent.py"
    module.write_text(
        "from tesserix_adk import ScriptedProvider\n"
        "from state_json_agents import build\n"
        "agent = build()\n"
        "PROVIDER = ScriptedProvider(['done'])\n",
        encoding="utf-8",
    )
    (tmp_path / "state_json_agents.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from checkpoint.test_state_json import _trip_agent\n"
        "def build():\n    return _trip_agent([])\n",
        encoding="utf-8",
    )
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def crash() -> None:
        from tesserix_adk.stores.urls import open_stores

        async with open_stores(url) as stores:
            await stores.create_schema()
            await _crashed_with_a_secret_in_its_state(stores, [])

    import asyncio

    asyncio.run(crash())
    done = subprocess.run(
        [
            *(sys.executable, "-m", "tesserix_adk", "run", "--resume", "trip", "--tenant", T),
            *("--agent", "trip_state_agent:agent", "--provider", "trip_state_agent:PROVIDER"),
            *("--store", url),
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "secret" in done.stderr and "tok-live" not in done.stderr + done.stdout
