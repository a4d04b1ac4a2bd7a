"""Messages, their parts, tool calls and outcomes, usage: the conversation's value objects.

The JSON shape written here (``message_to_json``/``message_from_json``) is part of the
checkpoint format: fields may grow, never silently change.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "MALFORMED_ARGUMENTS",
    "REFUSED_ARGUMENTS",
    "BinaryPart",
    "Message",
    "Part",
    "Role",
    "TextPart",
    "ToolCall",
    "ToolOutcome",
    "Usage",
    "content_json",
    "int_as_text",
    "message_from_json",
    "message_to_json",
    "refusal_of",
]


class Role(StrEnum):
    """Who said a message."""

    system = "system"
    user = "user"
    assistant = "assistant"
    tool = "tool"


@dataclass(frozen=True, slots=True, kw_only=True)
class TextPart:
    """A piece of text inside a message."""

    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BinaryPart:
    """Bytes with a media type (an image, a PDF); never redacted, never altered."""

    data: bytes
    media_type: str


Part = TextPart | BinaryPart


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A call the model asked for: the provider's id, the tool's name, JSON arguments."""

    id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolOutcome:
    """What a tool call produced, as the model will see it."""

    call_id: str
    content: Any
    is_error: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Token counts of one or more model calls."""

    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
        )


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of the conversation; ``content`` is text or a sequence of parts."""

    role: Role | str
    content: str | Sequence[Part] = ""
    tool_calls: Sequence[ToolCall] = ()
    tool_call_id: str | None = None
    is_error: bool = False

    def __post_init__(self) -> None:
        # Each field set only when it is not already what it becomes: a resume builds a
        # message per transcript entry, thousands at a time.
        if type(self.role) is not Role:
            object.__setattr__(self, "role", Role(self.role))
        if not isinstance(self.content, str) and type(self.content) is not tuple:
            object.__setattr__(self, "content", tuple(self.content))
        if type(self.tool_calls) is not tuple:
            object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    @property
    def text(self) -> str:
        """The message's text parts joined; binary parts are left out."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @classmethod
    def user(cls, content: str | Sequence[Part]) -> Message:
        """A user message."""
        return cls(Role.user, content)

    @classmethod
    def assistant(cls, content: str = "", tool_calls: Sequence[ToolCall] = ()) -> Message:
        """An assistant message, possibly asking for tool calls."""
        return cls(Role.assistant, content, tool_calls)

    @classmethod
    def tool_result(cls, outcome: ToolOutcome) -> Message:
        """The message that answers one tool call."""
        content = outcome.content if isinstance(outcome.content, str) else _json_text(outcome)
        return cls(Role.tool, content, tool_call_id=outcome.call_id, is_error=outcome.is_error)


def _json_text(outcome: ToolOutcome) -> str:
    return content_json(outcome.content, sort_keys=True, default=str)


def content_json(content: Any, **options: Any) -> str:
    """A tool result's ``content`` as JSON text (``json.dumps`` with ``options``). An int
    past Python's limit for writing one as text (4,300 digits) is written as its hex text
    (``"0x…"``, exact): the call it answers completed, and must be recorded so."""
    try:
        return json.dumps(content, **options)
    except ValueError:
        return json.dumps(_big_ints_as_hex(content, sys.get_int_max_str_digits()), **options)


def int_as_text(value: int) -> int | str:
    """``value``, or its hex text (``"0x…"``, exact) when it is past Python's limit for
    writing an int as decimal text (``sys.get_int_max_str_digits``)."""
    return _int_as_text(value, sys.get_int_max_str_digits())


def _int_as_text(value: int, digits: int) -> int | str:
    # At most this many decimal digits (bit_length * log10 2, plus one): near the limit, a
    # few that would still fit are written as hex too.
    return hex(value) if digits and value.bit_length() * 0.30103 + 1 > digits else value


def _big_ints_as_hex(value: Any, digits: int) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return _int_as_text(value, digits)
    if isinstance(value, Mapping):
        return {k: _big_ints_as_hex(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_big_ints_as_hex(v, digits) for v in value]
    return value


def message_to_json(message: Message) -> dict[str, Any]:
    """The JSON form of a message (binary parts as base64)."""
    content: Any
    if isinstance(message.content, str):
        content = message.content
    else:
        content = [
            {"type": "text", "text": p.text}
            if isinstance(p, TextPart)
            else {
                "type": "binary",
                "media_type": p.media_type,
                "data": base64.b64encode(p.data).decode("ascii"),
            }
            for p in message.content
        ]
    out: dict[str, Any] = {"role": str(message.role), "content": content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.is_error:
        out["is_error"] = True
    return out


def message_from_json(data: Mapping[str, Any]) -> Message:
    """Read a message written by ``message_to_json``; raises ``ValueError``/``KeyError``."""
    raw = data["content"]
    content: str | list[Part]
    if isinstance(raw, str):
        content = raw
    elif isinstance(raw, list):
        content = []
        for part in raw:
            if part["type"] == "text":
                content.append(TextPart(text=str(part["text"])))
            elif part["type"] == "binary":
                content.append(
                    BinaryPart(
                        data=base64.b64decode(part["data"], validate=True),
                        media_type=str(part["media_type"]),
                    )
                )
            else:
                raise ValueError(f"unknown part type {part['type']!r}")
    else:
        raise ValueError("message content is neither text nor a list of parts")
    calls = [
        ToolCall(id=str(c["id"]), name=str(c["name"]), arguments=dict(c["arguments"]))
        for c in data.get("tool_calls", ())
    ]
    return Message(
        Role(data["role"]),
        content,
        calls,
        tool_call_id=data.get("tool_call_id"),
        is_error=bool(data.get("is_error", False)),
    )


MALFORMED_ARGUMENTS = "_malformed_arguments"
"""The one key of a tool call's arguments when the model sent arguments that are not a JSON
object; the raw text is kept under it, so the tool's validation fails, the model is told so
(``is_error``) and can ask again, and the transcript keeps exactly what the model said."""

REFUSED_ARGUMENTS = "__tesserix_refused__"
"""The one key of a tool call's arguments when the kit refused to carry the call (nested too
deep, text that is not Unicode, a key that would hold a secret); its value says why, and the
call is answered "not sent"."""


def refusal_of(call: ToolCall) -> str | None:
    """Why the kit answers ``call`` "not sent" whatever its tool, or ``None``: its arguments
    are the kit's own refusal (exactly ``{REFUSED_ARGUMENTS: why}``), or not one JSON object
    (whatever a tool made of them would be a guess at what the model meant, and a tool
    elsewhere, an MCP server, may fill in defaults for what is missing). A model that puts
    the refusal's name among real arguments gets no refusal, and no pass: its call is keyed,
    claimed and sent like any other."""
    arguments = call.arguments
    if len(arguments) == 1 and isinstance(why := arguments.get(REFUSED_ARGUMENTS), str):
        return why
    if MALFORMED_ARGUMENTS in arguments:
        return (
            "its arguments were not one JSON object; ask for the call again with complete arguments"
        )
    return None
