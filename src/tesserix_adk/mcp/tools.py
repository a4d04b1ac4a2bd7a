"""One MCP server tool as a kit ``Tool``: its flags from the server's annotations (or the
user's override), its call sent over the toolset's session with the idempotency key in the
request's ``_meta``, and its result turned into the call's outcome.

Annotations are hints a server chooses; the mapping is conservative: only ``readOnlyHint``
makes a tool free of side effects, only ``idempotentHint`` lets a call in doubt be sent
again, and everything else is side-effecting and keyed, so a resume refuses what it cannot
decide. ``MCPToolOverride`` is the user's word over the server's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tesserix_adk.mcp.errors import MCPToolError
from tesserix_adk.reconcile import Reconciler
from tesserix_adk.tools import KeyFunction, Tool, ToolContext, default_key

__all__ = [
    "IDEMPOTENCY_KEY_META",
    "MCPTool",
    "MCPToolOverride",
    "ServerTool",
    "outcome_of",
]

IDEMPOTENCY_KEY_META = "tesserix/idempotency_key"
"""The ``_meta`` entry of a ``tools/call`` request that carries the call's idempotency key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MCPToolOverride:
    """The user's flags for one server tool, over what its annotations say.

    ``side_effects`` and ``idempotent`` left ``None`` come from the annotations; the rest
    are as on ``@tool``: ``key=None`` sends the call unkeyed, ``reconcile`` settles a call
    in doubt on resume (it may call the server through the toolset).
    """

    side_effects: bool | None = None
    idempotent: bool | None = None
    requires_approval: bool = False
    key: KeyFunction | None = default_key
    reconcile: Reconciler | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerTool:
    """A tool as the server lists it: what the kit needs of ``mcp.types.Tool``."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    read_only: bool = False
    idempotent: bool = False

    @property
    def side_effects(self) -> bool:
        """Whether the kit treats it as changing the world (all but ``readOnlyHint``)."""
        return not self.read_only


class ServerCall(Protocol):
    """Sends one ``tools/call`` and answers its outcome content (the toolset does this)."""

    async def __call__(
        self, name: str, arguments: Mapping[str, Any], *, key: str | None
    ) -> Any: ...


def _sent_over_mcp(ctx: ToolContext) -> None:  # pragma: no cover - MCPTool.invoke runs instead
    raise AssertionError("an MCP tool is invoked over its session")


class MCPTool(Tool):
    """A kit tool whose body is a ``tools/call`` to an MCP server.

    ``name`` is the kit's (the server's name after the toolset's prefix); ``server_name``
    is what the server is asked for. ``parameters`` is the server's ``inputSchema`` as
    given: the server validates arguments, and a refusal is the call's error outcome.
    """

    __slots__ = ("_send", "server_name")

    def __init__(
        self,
        listed: ServerTool,
        send: ServerCall,
        *,
        name: str | None = None,
        override: MCPToolOverride | None = None,
    ) -> None:
        chosen = override or MCPToolOverride()
        side_effects = listed.side_effects if chosen.side_effects is None else chosen.side_effects
        idempotent = listed.idempotent if chosen.idempotent is None else chosen.idempotent
        super().__init__(
            _sent_over_mcp,
            name=name or listed.name,
            description=listed.description,
            side_effects=side_effects,
            idempotent=idempotent,
            requires_approval=chosen.requires_approval,
            key=chosen.key,
            reconcile=chosen.reconcile,
        )
        self.server_name = listed.name
        self.parameters = dict(listed.input_schema)
        self._send = send

    def invalid_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` lack what the server's schema requires (its ``required``
        names), else ``None``: the rest the server validates, against its own schema."""
        required = self.parameters.get("required")
        if not isinstance(required, list):
            return None
        missing = [name for name in required if isinstance(name, str) and name not in arguments]
        if not missing:
            return None
        return f"invalid arguments for {self.name}: missing required {', '.join(missing)}"

    @property
    def takes_context(self) -> bool:
        """Never: a call goes to the server with its arguments and key, not the state."""
        return False

    async def invoke(
        self,
        arguments: Mapping[str, Any],
        ctx: ToolContext,
        *,
        guard: Callable[[], None] | None = None,
    ) -> Any:
        """Send the call with ``ctx.idempotency_key`` in its ``_meta``; ``guard`` is called
        right before the request goes out, with nothing awaited in between."""
        if not isinstance(arguments, Mapping):
            raise ValueError(f"invalid arguments for {self.name}: not an object")
        if guard is not None:
            guard()
        return await self._send(self.server_name, dict(arguments), key=ctx.idempotency_key)

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r}, side_effects={self.side_effects})"


def outcome_of(content: Sequence[Any], *, is_error: bool, structured: Any = None) -> Any:
    """A ``CallToolResult`` as the call's outcome: its text blocks joined by newlines (the
    structured content when there is no text); ``isError`` raises ``MCPToolError``."""
    texts = [_text_of(block) for block in content]
    text = "\n".join(t for t in texts if t)
    if is_error:
        raise MCPToolError(text or "the tool reported an error and said nothing more")
    if not text and structured is not None:
        return structured
    return text


def _text_of(block: Any) -> str:
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind == "resource":
        inner = block.resource
        text = getattr(inner, "text", None)
        return str(text) if text is not None else f"[resource {inner.uri}]"
    if kind == "resource_link":
        return f"[resource {block.uri}]"
    # Binary blocks (image, audio) are named, not inlined: a record keeps text.
    mime = getattr(block, "mime_type", None) or "unknown"
    return f"[{kind} {mime}]"
