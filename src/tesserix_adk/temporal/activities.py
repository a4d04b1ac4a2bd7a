"""The workflow's two activities, and how the kit's errors reach Temporal.

An activity runs at least once, and Temporal says nothing about a lost attempt's side
effect; each attempt here is a kit attempt with a holder id of its own (the activity, its
attempt number, a random suffix), so a zombie attempt left running after a timeout is told
apart from its successor and refused by the lease's fence. A kit error that trying again
cannot cure (a call in doubt, a changed agent, a frontier that does not fit) is a
non-retryable ``ApplicationError`` whose type is the kit's class name and whose message
names the call; a retryable one (a held lease, a store out of reach) lets Temporal retry.
A tool call heartbeats while it runs, so a worker that died inside it is noticed within
the heartbeat timeout rather than the call's whole timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping, Sequence
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import (
    AdkError,
    ConfigurationError,
    LeaseError,
    SchemaMismatchError,
    StaleFenceError,
    StorePermissionError,
)
from tesserix_adk.run.attempt import new_holder
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.temporal import steps
from tesserix_adk.temporal.shapes import (
    MODEL_ACTIVITY,
    TOOL_ACTIVITY,
    ModelStep,
    StepResult,
    ToolInput,
    ToolResult,
)

__all__ = ["AgentActivities"]

T = TypeVar("T")


class AgentActivities:
    """The activities a worker registers: one runner (stores and provider) for all the
    agents it carries, found by name."""

    def __init__(
        self, runner: AgentRunner, agents: Sequence[Agent], *, heartbeat_every: float = 1.0
    ) -> None:
        names = [a.name for a in agents]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"two agents share a name: {names}")
        self.runner = runner
        self.agents: Mapping[str, Agent] = {a.name: a for a in agents}
        self.heartbeat_every = heartbeat_every

    @activity.defn(name=MODEL_ACTIVITY)
    async def model_turn(self, step: ModelStep) -> StepResult:
        """One model turn of the run (see ``steps.model_turn``)."""
        agent = self._agent(step.agent_name)
        return await _translated(
            steps.model_turn(self.runner, agent, step, _holder()), self.runner.redactor
        )

    @activity.defn(name=TOOL_ACTIVITY)
    async def tool_call(self, call: ToolInput) -> ToolResult:
        """One tool call through the dispatch unit (see ``steps.tool_call``), heartbeating."""
        agent = self._agent(call.agent_name)
        retried = activity.info().attempt > 1
        beating = asyncio.create_task(self._heartbeat())
        try:
            return await _translated(
                steps.tool_call(self.runner, agent, call, _holder(), retried=retried),
                self.runner.redactor,
            )
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    async def _heartbeat(self) -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(self.heartbeat_every)

    def _agent(self, name: str) -> Agent:
        agent = self.agents.get(name)
        if agent is None:
            raise ApplicationError(
                f"this worker carries no agent named {name!r} (it carries "
                f"{', '.join(sorted(self.agents))})",
                type="ConfigurationError",
                non_retryable=True,
            )
        return agent


def _holder() -> str:
    """A holder id of this attempt alone (the workflow id is the kit's run id)."""
    info = activity.info()
    return new_holder(f"temporal-{info.activity_type.rsplit('.', 1)[-1]}-{info.attempt}")


async def _translated(work: Awaitable[T], redactor: Redactor) -> T:
    """``work``'s errors as Temporal's, their text redacted and their chain dropped: both
    are written to the workflow's history (a provider's 5xx text may echo a credential it
    was sent). A kit error keeps whether it is retried; any other error is retried."""
    try:
        return await work
    except AdkError as exc:
        # A held or lost lease, a stale fence: this attempt only; the next one reads the
        # records back and decides again.
        # A store not (yet) of this kit's schema, or refusing its user: retried until an
        # operator applies the schema or the grant, never the end of the run's workflow.
        retry = exc.retryable or isinstance(
            exc, LeaseError | StaleFenceError | SchemaMismatchError | StorePermissionError
        )
        raise ApplicationError(
            redactor.text(str(exc)), type=type(exc).__name__, non_retryable=not retry
        ) from None
    except ApplicationError:
        raise  # the kit's own, already worded for the history
    except Exception as exc:
        # Anything else (a hand-written provider's HTTP client raising its own error, whose
        # text may echo the credential it sent): retried, as Temporal retries any error,
        # with the same redacted text and no chain.
        raise ApplicationError(redactor.text(str(exc)), type=type(exc).__name__) from None
