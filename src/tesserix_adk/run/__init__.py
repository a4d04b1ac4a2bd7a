"""The run loop, split by what each part decides.

- ``runner``: ``AgentRunner`` and its verbs (``run``, ``resume``, ``replay``, ``from_stores``);
- ``state``: ``RunState``, what a frontier persists;
- ``attempt``: ``Attempt``, one try at carrying a run (holder, lease, run claim);
- ``loop``: one iteration as SPEC §2 reads, and divergence;
- ``dispatch``: the dispatch unit (claim → invoke → complete, lost replies read back);
- ``approvals``, ``frontier``, ``resume``, ``replay``, ``result``.
"""

from tesserix_adk.run.attempt import RESUME_CLAIM_TTL, run_claim_key
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.run.runner import AgentRunner

__all__ = ["RESUME_CLAIM_TTL", "AgentRunner", "Run", "RunStatus", "run_claim_key"]
