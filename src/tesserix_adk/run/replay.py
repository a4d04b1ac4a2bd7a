"""Replay (debugging, never production): a past step carried forward as a new run.

Side-effecting tools are stubbed or named ``live``; nothing is written under the original
run, and a call whose arguments were masked goes to a stub or not at all.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer, state_from_json
from tesserix_adk.checkpoint.payload import Checkpoint, resolve_observation
from tesserix_adk.errors import (
    AdkError,
    CheckpointTooLargeError,
    ConfigurationError,
    NoCheckpointError,
)
from tesserix_adk.messages import Usage
from tesserix_adk.run.attempt import Attempt, new_holder
from tesserix_adk.run.ids import check_ids, id_problem
from tesserix_adk.run.loop import carry_on, end_as_ended, outstanding_calls
from tesserix_adk.run.result import Run
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.capabilities import ledger_totals
from tesserix_adk.stores.protocols import IdempotencyStore, Ledger, RecordsFrom

if TYPE_CHECKING:
    from tesserix_adk.run.runner import AgentRunner

__all__ = ["check_stubs", "replay_from", "replayed_frontier", "replay_state", "usable_step"]

# How many replays of replays a replay's spend is traced back through.
_REPLAY_DEPTH = 64


async def replay_from(
    runner: AgentRunner,
    agent: Agent,
    run_id: str,
    *,
    tenant: str,
    from_step: int,
    stubs: Mapping[str, Callable[..., Any]],
    live: Sequence[str],
    new_run_id: str | None,
) -> Run:
    """``AgentRunner.replay``: the step carried forward as a new run of ``runner``."""
    checkpoints = runner._require_checkpoints()
    named_live = check_stubs(agent, stubs, live)
    if isinstance(from_step, bool) or not isinstance(from_step, int):
        raise ConfigurationError(f"from_step must be a step number, got {from_step!r}")
    runner._check_agent(agent)
    cp = usable_step(
        await checkpoints.at(tenant, run_id, from_step),
        agent=agent,
        run_id=run_id,
        tenant=tenant,
        from_step=from_step,
        stubs=stubs,
        live=named_live,
    )
    # What the run recorded of its calls says what they do to the world, whatever the
    # agent replayed says now (a revision that calls a booking read-only still books, from
    # any step the model may ask for it again): the step's calls, and every call record.
    recorded = await _side_effecting(runner.idempotency, tenant, run_id)
    recorded |= {oc.call.name for oc in cp.outstanding if oc.side_effects}
    _refuse_recorded_effects(agent, recorded, stubs, named_live)
    messages = await checkpoints.messages(cp)
    spent_before = await _spent_before(checkpoints, cp)
    new_id = f"{run_id}-replay-{secrets.token_hex(4)}" if new_run_id is None else new_run_id
    problem = None if new_run_id is not None else id_problem(new_id)
    if problem is not None:
        # The id was made here, not given: say so, and how to give one.
        raise ConfigurationError(
            f"the replay's own id, made from the run id ({new_id[:40]!r}…), {problem}; give "
            "the replay an id of its own (new_run_id; --new-run-id on the command line)"
        )
    check_ids(tenant=tenant, run_id=new_id)
    if new_id == run_id:
        raise ConfigurationError("a replay never writes into the original run")
    await _refuse_taken(runner, tenant, new_id)
    run = replay_state(agent, cp, messages, new_id, spent_before=spent_before)
    attempt = Attempt(
        holder=new_holder(runner.worker),
        stubs=dict(stubs),
        masked_calls=frozenset(oc.call.id for oc in cp.outstanding if oc.redacted),
    )
    async with runner._holding(attempt, tenant, new_id):
        # Asked again under the lease: another start of the id (a replay, a run) may have
        # taken it since the first look, and finished, leaving the lease free.
        await _refuse_taken(runner, tenant, new_id)
        replayed = replayed_frontier(cp, run)
        if cp.status.finished:
            # Nothing runs from it; written all the same, so the id the replay hands back
            # is a run the stores hold (``tesserix show``), and is not taken again.
            return await end_as_ended(runner._parts, run, attempt, replayed)
        return await carry_on(runner._parts, run, attempt, replayed)


async def _refuse_taken(runner: AgentRunner, tenant: str, run_id: str) -> None:
    """Refuse ``run_id`` if any run holds it: a frontier, a submission waiting for a worker,
    or records or spend left by a start whose first frontier was never written."""
    checkpoints = runner._require_checkpoints()
    taken = (
        await checkpoints.store.latest(tenant, run_id) is not None
        or (runner.work is not None and await runner.work.input(tenant, run_id) is not None)
        or bool(await runner.idempotency.records(tenant, run_id))
        or (runner.ledger is not None and await _charged(runner.ledger, tenant, run_id))
    )
    if taken:
        raise ConfigurationError(f"run {run_id!r} already exists; a replay starts a run of its own")


async def _side_effecting(idempotency: IdempotencyStore, tenant: str, run_id: str) -> set[str]:
    """The tools whose calls the run recorded as side-effecting."""
    if isinstance(idempotency, RecordsFrom):
        records = await idempotency.records_from(tenant, run_id, 0)
    else:
        records = await idempotency.records(tenant, run_id)
    return {
        r.tool
        for r in records
        if r.tool is not None and r.flags is not None and r.flags.side_effects
    }


def _refuse_recorded_effects(
    agent: Agent, recorded: set[str], stubs: Mapping[str, Callable[..., Any]], live: set[str]
) -> None:
    """Refuse a replay that would let a tool the run recorded as side-effecting go out
    unstubbed (a call of a tool the agent no longer has is answered "unknown tool", never
    sent)."""
    unguarded = sorted(
        name for name in recorded if name in agent.tools and name not in stubs and name not in live
    )
    if unguarded:
        raise ConfigurationError(
            f"replay refused: {', '.join(unguarded)} recorded as side-effecting by the run "
            "(at the step, or in its call records); stub them or name them in live"
        )


async def _charged(ledger: Ledger, tenant: str, run_id: str) -> bool:
    """Whether a model call was charged to the run (micros or tokens)."""
    micros, usage = await ledger_totals(ledger, tenant, run_id)
    return micros > 0 or usage != Usage()


def check_stubs(
    agent: Agent, stubs: Mapping[str, Callable[..., Any]], live: Sequence[str]
) -> set[str]:
    """Refuse, before anything runs, a replay that could reach the world unstubbed: every
    stub callable, ``live`` a collection of the agent's tool names (one string would match
    the names it merely contains), and every side-effecting tool stubbed or named live.
    The names ``live`` holds (it is read once)."""
    if not isinstance(stubs, Mapping):
        raise ConfigurationError("stubs must map tool names to callables")
    unknown = set(stubs) - set(agent.tools)
    if unknown:
        raise ConfigurationError(f"stubs for unknown tool(s): {', '.join(sorted(unknown))}")
    uncallable = sorted(name for name, stub in stubs.items() if not callable(stub))
    if uncallable:
        raise ConfigurationError(
            f"the stub(s) for {', '.join(uncallable)} cannot be called; give a function"
        )
    names = _tool_names(live)
    unknown = names - set(agent.tools)
    if unknown:
        raise ConfigurationError(f"live names unknown tool(s): {', '.join(sorted(unknown))}")
    unguarded = sorted(
        t.name
        for t in agent.tools.values()
        if t.side_effects and t.name not in stubs and t.name not in names
    )
    if unguarded:
        raise ConfigurationError(
            "replay refused: side-effecting tool(s) "
            f"{', '.join(unguarded)} are neither stubbed nor named in live"
        )
    return names


def _tool_names(live: object) -> set[str]:
    """``live`` read once (a generator is used up by reading) as a set of tool names."""
    if isinstance(live, str | bytes | bytearray) or not isinstance(live, Iterable):
        raise ConfigurationError(
            f"live must be a list of tool names, not {type(live).__name__} {live!r:.60}"
        )
    names = list(live)
    if not all(isinstance(name, str) for name in names):
        raise ConfigurationError("live must be a list of tool names (text)")
    return set(names)


def usable_step(
    cp: Checkpoint | None,
    *,
    agent: Agent,
    run_id: str,
    tenant: str,
    from_step: int,
    stubs: Mapping[str, Callable[..., Any]],
    live: set[str],
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
    if cp.state_redacted:
        # Any tool that is handed ``ctx`` reads the state, live or not.
        reads_state = sorted(
            t.name
            for t in agent.tools.values()
            if t.name not in stubs and (t.name in live or t.takes_context)
        )
        if reads_state:
            raise ConfigurationError(
                f"step {from_step}'s state held a secret, which the stores keep masked; stub "
                f"{', '.join(reads_state)} to replay it (a tool would get the mask as if it "
                "were the value)"
            )
    return cp


async def _spent_before(checkpoints: Checkpointer, cp: Checkpoint) -> int:
    """What had been spent at ``cp``: its own micros and, for a replay's step, what its
    original had spent at the step it was replayed from (and so on: a replay's frontiers
    record only its own spend). A step no longer kept counts as nothing."""
    total, step, seen = cp.micros, cp, 0
    while step.replay_of and seen < _REPLAY_DEPTH:
        run_id, _, number = step.replay_of.rpartition("@")
        try:
            earlier = await checkpoints.at(step.tenant, run_id, int(number))
        except (ValueError, AdkError):
            break
        if earlier is None:
            break
        total, step, seen = total + earlier.micros, earlier, seen + 1
    return total


def replay_state(
    agent: Agent,
    cp: Checkpoint,
    messages: list[Any],
    new_id: str,
    *,
    spent_before: int | None = None,
) -> RunState:
    """The new run's state: the step's conversation under a run id of its own. It starts
    from the step's iterations, and its budget counts the step's spend, so the agent allows
    it no more than the original had left there; what it reports spent (its ledger, its
    frontiers, its ``Run``) is only what it spends itself."""
    return RunState(
        agent=agent,
        tenant=cp.tenant,
        run_id=new_id,
        messages=messages,
        iteration=cp.iteration,
        steps_used=cp.steps_used,
        spent_before=cp.micros if spent_before is None else spent_before,
        state=state_from_json(cp.state, agent.state_schema),
        grants=list(cp.grants),
        replay_of=f"{cp.run_id}@{cp.step}",
        observation=resolve_observation(cp.observation, messages),
    )


def replayed_frontier(cp: Checkpoint, run: RunState) -> Checkpoint:
    """The step as the new run's frontier. Keys name the run, so the replay's calls get
    keys of their own and never find (or complete) a record of the original run."""
    return dataclasses.replace(
        cp,
        run_id=run.run_id,
        replay_of=run.replay_of,
        pending_approval=None,
        micros=run.spent,
        usage=run.usage,
        outstanding=tuple(outstanding_calls(run, [oc.call for oc in cp.outstanding])),
    )
