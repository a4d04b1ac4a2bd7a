"""Agent runs on Temporal: ``AgentWorkflow``, its activities, continue-as-new.

``agent_worker`` builds a Temporal worker from a runner (stores and provider) and agents;
``start_run`` starts a run as a workflow whose id is the kit's run id; ``carry_on_run``
starts a new execution of a run whose workflow closed unfinished, from its frontier. Needs
``temporalio`` (``pip install "tesserix-adk[temporal]"``); importing ``tesserix_adk`` never
imports it.
"""

from __future__ import annotations

try:
    import temporalio  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'tesserix_adk.temporal needs temporalio: pip install "tesserix-adk[temporal]"'
    ) from exc

from tesserix_adk.temporal.activities import AgentActivities
from tesserix_adk.temporal.shapes import ActivityOptions, ContinueReason, RunInput, RunOutcome
from tesserix_adk.temporal.worker import agent_worker, carry_on_run, start_run
from tesserix_adk.temporal.workflow import APPROVAL_SIGNAL, AgentWorkflow

__all__ = [
    "APPROVAL_SIGNAL",
    "ActivityOptions",
    "AgentActivities",
    "AgentWorkflow",
    "ContinueReason",
    "RunInput",
    "RunOutcome",
    "agent_worker",
    "carry_on_run",
    "start_run",
]
