"""The run loop's old import path; it lives in ``tesserix_adk.run`` now."""

from tesserix_adk.run import RESUME_CLAIM_TTL, AgentRunner, Run, RunStatus, run_claim_key
from tesserix_adk.run.runner import FrontierObserver

__all__ = [
    "RESUME_CLAIM_TTL",
    "AgentRunner",
    "FrontierObserver",
    "Run",
    "RunStatus",
    "run_claim_key",
]
