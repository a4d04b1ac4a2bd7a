"""A run's input as a submission keeps it, and whether a second request under the same run
id is the same one: a worker starts the run from the first submission, so another input,
state or agent under that id is refused, never dropped unsaid."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.checkpoint.payload.submission import decode_submission, encode_submission
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.checkpoint.state_json import state_from_json, state_to_json
from tesserix_adk.errors import RunStartedError
from tesserix_adk.messages import Message
from tesserix_adk.run.screening import without_secret_ids
from tesserix_adk.stores.protocols import WorkIndex

__all__ = ["refuse_another_start", "same_submission", "submission"]


def submission(agent: Agent, messages: Sequence[Message], state: Any, redactor: Redactor) -> bytes:
    """A run's input as a submission keeps it: redacted, its state as the frontier keeps
    it (``CheckpointError`` for one that cannot be)."""
    return encode_submission(messages, state_to_json(state, agent.state_schema), redactor)


async def same_submission(
    work: WorkIndex,
    redactor: Redactor,
    agent: Agent,
    tenant: str,
    run_id: str,
    data: bytes,
    verb: str,
) -> None:
    """``RunStartedError`` (not retryable) unless the run's submission, made before, is for
    ``agent`` with the input ``data`` holds: a worker starts it from that submission, so
    another one here would have the run carried on one input (or agent) or the other
    depending on whether this process dies, or be dropped unsaid."""
    entry = await work.entry(tenant, run_id)
    if entry is not None and entry.agent != agent.name:
        raise _another(
            f"run {run_id!r} was submitted for agent {entry.agent!r}, not {agent.name!r}: "
            f"not {verb}; a worker starts it with that agent (use a new run id for this one)"
        )
    stored = await work.input(tenant, run_id)
    if stored is None or stored == data:
        return
    # Not the same bytes: the messages compared as given (a retried request), or as a run
    # started from the submission holds them (they came through ``without_secret_ids`` once
    # more: a replaced call id is replaced again); the state as the schema reads it (a set
    # is dumped in its own iteration order, which another process may not share).
    kept, mine = decode_submission(stored), decode_submission(data)
    given = _encoded(mine.messages, redactor)
    same_messages = given in (
        _encoded(kept.messages, redactor),
        _encoded(without_secret_ids(kept.messages, redactor), redactor),
    )
    same_state = kept.state == mine.state or (
        agent.state_schema is not None
        and state_from_json(kept.state, agent.state_schema)
        == state_from_json(mine.state, agent.state_schema)
    )
    if not (same_messages and same_state):
        raise _another(
            f"run {run_id!r} was submitted with another input: not {verb}; a worker starts "
            "it from that submission (use a new run id for this input)"
        )


def _encoded(messages: Sequence[Message], redactor: Redactor) -> bytes:
    return encode_submission(messages, None, redactor)


def refuse_another_start(cp: Checkpoint, agent: Agent) -> None:
    """``RunStartedError`` (not retryable) for a submission of ``agent`` under the id of a
    run whose frontier ``cp`` another agent wrote, or a replay wrote: the submission would
    be told it was taken, and the run it names is not its own."""
    if cp.replay_of is not None:
        raise _another(
            f"run {cp.run_id!r} is a replay of {cp.replay_of}: not submitted (use a new run id)"
        )
    if cp.agent_name != agent.name:
        raise _another(
            f"run {cp.run_id!r} is carried by agent {cp.agent_name!r}, not {agent.name!r}: "
            "not submitted (use a new run id for this one)"
        )


def _another(message: str) -> RunStartedError:
    """``RunStartedError`` for another request under an id submitted before: not retryable,
    since asking again changes nothing (the CLI says so with exit 4, not 3)."""
    refused = RunStartedError(message)
    refused.retryable = False
    return refused
