"""The errors of an MCP toolset: a branch of the kit's one tree, with ``.retryable``.

Whether a call reached the server decides what is safe, so "not sent" and "sent, the reply
lost" are different errors (as ``StoreUnavailableError`` and ``StoreReplyLostError`` are)::

    AdkError (.retryable)
    └── MCPError
        ├── MCPToolError              the server answered with an error (isError, or a
        │                             JSON-RPC error); nothing to retry
        └── MCPUnavailableError       the server could not be reached; nothing was sent
            └── MCPReplyLostError     sent, and the connection or the wait ended before the
                                      reply: whether the tool ran is unknown (also a
                                      ``ToolOutcomeUnknownError``)

Raised by a tool, the first two are that call's error outcome (SPEC §2); a lost reply
leaves the call in doubt instead, for the tool's reconciler or an operator: told to the
model as an error, it would be asked for again under a new key.
"""

from __future__ import annotations

from tesserix_adk.errors import AdkError, ToolOutcomeUnknownError

__all__ = ["MCPError", "MCPReplyLostError", "MCPToolError", "MCPUnavailableError"]


class MCPError(AdkError):
    """Something about an MCP server or one of its tools; ``outcome_unknown`` says whether
    a call may have run all the same."""

    outcome_unknown: bool = False


class MCPToolError(MCPError):
    """The server answered the call with an error; it is the call's answer, not a fault."""


class MCPUnavailableError(MCPError):
    """The server could not be reached (not started, refused, gone); nothing was sent, so
    trying again later is the right answer. ``outcome_unknown`` is ``False``."""

    retryable = True
    outcome_unknown: bool = False


class MCPReplyLostError(MCPUnavailableError, ToolOutcomeUnknownError):
    """The request was sent but no reply came (the connection closed, the wait timed out):
    the tool may have run. Whoever cares asks the server by the call's idempotency key."""

    outcome_unknown = True
