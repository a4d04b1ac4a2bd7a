"""Transcript entries: one ``Message`` as a ``HistoryStore`` keeps it (or as a frontier
with an inline transcript lists it)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import (
    CHECKPOINT_FORMAT,
    _reads_fast,
    _sealed_now,
    _sealed_within,
    _versioned,
)
from tesserix_adk.checkpoint.payload.fields import _bool, _fields, _list, _obj, _opt_str, _str
from tesserix_adk.checkpoint.payload.redacting import _redacted_message
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import BinaryPart, Message, Part, Role, TextPart, ToolCall

__all__ = ["decode_message", "decode_messages", "encode_message"]


def encode_message(message: Message, redactor: Redactor) -> bytes:
    """One transcript entry as checksummed bytes, redacted (text, tool results and tool
    arguments; never binary). ``CheckpointTooLargeError`` if it nests too deep."""
    body = {"format": CHECKPOINT_FORMAT, **_redacted_message(message, redactor)}
    return _sealed_within(body, "a transcript entry")


def decode_message(data: bytes) -> Message:
    """Read one transcript entry; ``CheckpointCorruptError`` if it cannot be read or does
    not verify (an entry from before checksums is read in its exact old shape only)."""
    raw, _ = _versioned(data, "a transcript entry")
    return _read(raw)


def decode_messages(entries: Iterable[bytes]) -> list[Message]:
    """``decode_message`` of each entry, in order: the same messages and the same errors.

    An entry sealed as the kit writes today is verified and parsed with less work, and one
    holding text and plain tool calls (what a run of tool calls is made of) read without
    the general walk; any other entry goes through ``decode_message``, which decides.
    """
    messages: list[Message] = []
    for entry in entries:
        # The interpreter's digit limit is read for each entry, as ``_loads`` reads it.
        raw = _sealed_now(entry, _reads_fast())
        if raw is None:
            messages.append(decode_message(entry))
            continue
        message = _plain(raw)
        messages.append(_read(raw) if message is None else message)
    return messages


def _read(raw: dict[str, Any]) -> Message:
    try:
        return _message(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a transcript entry cannot be decoded: {exc}") from exc


_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "is_error"})


_REQUIRED = frozenset({"role", "content"})
_CALL_KEYS = frozenset({"id", "name", "arguments"})
_ROLES = {role.value: role for role in Role}


def _message(raw: Any) -> Message:
    data = _fields(raw, _REQUIRED, _MESSAGE_KEYS, "a message")
    content_raw = data["content"]
    content: str | tuple[Part, ...]
    if isinstance(content_raw, str):
        content = content_raw
    elif isinstance(content_raw, list):
        content = tuple(_part(p) for p in content_raw)
    else:
        raise TypeError("message content is neither text nor a list of parts")
    listed = data.get("tool_calls", ())
    calls = (
        ()
        if listed == () or listed == []
        else tuple(
            ToolCall(id=_str(c["id"]), name=_str(c["name"]), arguments=_obj(c["arguments"]))
            for c in (_fields(c, _CALL_KEYS, where="a tool call") for c in _list(listed))
        )
    )
    role = _ROLES.get(_str(data["role"]))
    if role is None:
        raise ValueError(f"{data['role']!r} is not a role")
    return Message(
        role,
        content,
        calls,
        tool_call_id=_opt_str(data.get("tool_call_id")),
        is_error=_bool(data.get("is_error", False)),
    )


def _plain(raw: dict[str, Any]) -> Message | None:
    """What ``_message`` reads from ``raw`` when its content is text and its calls are plain
    (exact JSON types, no stray key); ``None`` for anything else, even what it would read."""
    if not raw.keys() <= _MESSAGE_KEYS:
        return None
    role_name = raw.get("role")
    content = raw.get("content")
    if type(role_name) is not str or type(content) is not str:
        return None
    role = _ROLES.get(role_name)
    if role is None:
        return None
    calls: tuple[ToolCall, ...] = ()
    if "tool_calls" in raw:
        listed = raw["tool_calls"]
        if type(listed) is not list:
            return None
        built: list[ToolCall] = []
        for call in listed:
            if type(call) is not dict or call.keys() != _CALL_KEYS:
                return None
            call_id, name, arguments = call["id"], call["name"], call["arguments"]
            if type(call_id) is not str or type(name) is not str or type(arguments) is not dict:
                return None
            built.append(ToolCall(id=call_id, name=name, arguments=arguments))
        calls = tuple(built)
    answers = raw.get("tool_call_id")
    is_error = raw.get("is_error", False)
    if (answers is not None and type(answers) is not str) or type(is_error) is not bool:
        return None
    return Message(role, content, calls, tool_call_id=answers, is_error=is_error)


def _part(raw: Any) -> Part:
    kind = _str(_obj(raw).get("type"))
    if kind == "text":
        return TextPart(text=_str(_fields(raw, {"type", "text"}, where="a text part")["text"]))
    if kind == "binary":
        part = _fields(raw, {"type", "media_type", "data"}, where="a binary part")
        try:
            data = base64.b64decode(_str(part["data"]), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"a binary part is not base64: {exc}") from exc
        return BinaryPart(data=data, media_type=_str(part["media_type"]))
    raise ValueError(f"unknown part type {kind!r}")
