"""Replay (debugging, never production): a past step carried forward as a new run.

Side-effecting tools are stubbed or named ``live``; nothing is written under the original
run, and a call whose arguments were masked goes to a stub or not at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import state_from_json
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.errors import CheckpointTooLargeError, ConfigurationError, NoCheckpointError
from tesserix_adk.run.loop import outstanding_calls
from tesserix_adk.run.state import RunState

__all__ = ["check_stubs", "replayed_frontier", "replay_state", "usable_step"]


def check_stubs(agent: Agent, stubs: Mapping[str, Callable[..., Any]], live: Sequence[str]) -> None:
    """Refuse, before anything runs, a replay that could reach the world unstubbed."""
    unknown = set(stubs) - set(agent.tools)
    if unknown:
        raise ConfigurationError(f"stubs for unknown tool(s): {', '.join(sorted(unknown))}")
    unguarded = sorted(
        t.name
        for t in agent.tools.values()
        if t.side_effects and t.name not in stubs and t.name not in live
    )
    if unguarded:
        raise ConfigurationError(
            "replay refused: side-effecting tool(s) "
            f"{', '.join(unguarded)} are neither stubbed nor named in live"
        )


def usable_step(
    cp: Checkpoint | None,
    *,
    run_id: str,
    tenant: str,
    from_step: int,
    stubs: Mapping[str, Callable[..., Any]],
) -> Checkpoint:
    """The step to replay from, or why it cannot be."""
    if cp is None:
        raise NoCheckpointError(f"run {run_id!r} has no step {from_step} for tenant {tenant!r}")
    if cp.is_tombstone:
        raise CheckpointTooLargeError(
            f"step {from_step} of run {run_id!r} is a tombstone: {cp.reason}", retryable=False
        )
    masked = sorted(
        {oc.call.name for oc in cp.outstanding if oc.redacted and oc.call.name not in stubs}
    )
    if masked:
        raise ConfigurationError(
            f"step {from_step} holds call(s) to {', '.join(masked)} whose arguments were "
            "redacted; stub them to replay (a live tool would get masked arguments)"
        )
    return cp


def replay_state(agent: Agent, cp: Checkpoint, messages: list[Any], new_id: str) -> RunState:
    """The new run's state: the step's conversation under a run id of its own."""
    return RunState(
        agent=agent,
        tenant=cp.tenant,
        run_id=new_id,
        messages=messages,
        iteration=cp.iteration,
        steps_used=cp.steps_used,
        usage=cp.usage,
        state=state_from_json(cp.state, agent.state_schema),
        grants=list(cp.grants),
        replay_of=f"{cp.run_id}@{cp.step}",
        observation=cp.observation,
    )


def replayed_frontier(cp: Checkpoint, run: RunState) -> Checkpoint:
    """The step as the new run's frontier. Keys name the run, so the replay's calls get
    keys of their own and never find (or complete) a record of the original run."""
    return dataclasses.replace(
        cp,
        run_id=run.run_id,
        pending_approval=None,
        outstanding=tuple(outstanding_calls(run, [oc.call for oc in cp.outstanding])),
    )
