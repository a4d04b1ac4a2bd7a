"""MCP tools: the tools of an MCP server (stdio or streamable HTTP) as kit tools.

Needs the ``mcp`` extra (``pip install "tesserix-adk[mcp]"``). Where each part lives:
``toolset`` connects, lists and calls, translating the SDK's errors; ``tools`` is one
server tool as a kit ``Tool`` (flags from annotations, the key in ``_meta``, the result as
the outcome); ``errors`` is the MCP branch of the error tree.
"""

from __future__ import annotations

# The toolset first: it is the module that imports the SDK, and says what to install when
# it is missing.
from tesserix_adk.mcp.toolset import MCPToolset  # isort: skip
from tesserix_adk.mcp.errors import (
    MCPError,
    MCPReplyLostError,
    MCPToolError,
    MCPUnavailableError,
)
from tesserix_adk.mcp.tools import IDEMPOTENCY_KEY_META, MCPTool, MCPToolOverride
from tesserix_adk.mcp.weighing import DEFAULT_MAX_REPLY_ITEMS

__all__ = [
    "DEFAULT_MAX_REPLY_ITEMS",
    "IDEMPOTENCY_KEY_META",
    "MCPError",
    "MCPReplyLostError",
    "MCPTool",
    "MCPToolError",
    "MCPToolOverride",
    "MCPToolset",
    "MCPUnavailableError",
]
