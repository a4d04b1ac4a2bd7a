"""What of a model's tool calls the kit refuses to carry, before any is keyed: a call it
cannot encode as asked (arguments nested too deep, text that is not Unicode), whose key its
tool's key function cannot make from arguments the tool refuses anyway (one the model left
out), whose key not every store can keep (a NUL in it, or too long), or whose key that
function would build from a secret. Such a call keeps the model's id and name, its
arguments replaced by the kit's refusal (``messages.REFUSED_ARGUMENTS``): it is answered
"not sent", saying why, and never keyed, claimed or dispatched."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Mapping, Sequence
from urllib.parse import quote

from tesserix_adk.checkpoint.payload import MAX_NESTING, within_nesting
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import REFUSED_ARGUMENTS, Message, ToolCall, refusal_of
from tesserix_adk.run.state import RunState
from tesserix_adk.tools import Tool, canonical_json, default_key

__all__ = ["MAX_KEY_BYTES", "SECRET_KEY", "id_as_kept", "refused", "screened", "without_secret_ids"]


def screened(
    run: RunState, message: Message, redactor: Redactor, recorded: Collection[str] = ()
) -> Message:
    """The model's ``message`` with every call the kit will not carry refused
    (``_within_nesting``, then ``without_secret_keys``), and every call id that holds a
    secret replaced (``_ids_without_secrets``)."""
    message = _ids_without_secrets(message, redactor)
    return without_secret_keys(run, _within_nesting(message), redactor, recorded)


def _ids_without_secrets(message: Message, redactor: Redactor) -> Message:
    """``message`` with each call id that holds a secret replaced by one made from its
    digest, before any store, record, frontier or page sees it. A model chooses its call
    ids (a local server, a prompt injection); the kit keeps, shows and fences by them. Not
    masked: two masked ids would be one, and the id pairs a call with its result. The same
    id always gets the same replacement, so a turn asked again is named as before."""
    kept = [_kept_id(c.id, redactor) for c in message.tool_calls]
    if all(k == c.id for k, c in zip(kept, message.tool_calls, strict=True)):
        return message
    calls = tuple(
        c if k == c.id else dataclasses.replace(c, id=k)
        for k, c in zip(kept, message.tool_calls, strict=True)
    )
    return dataclasses.replace(message, tool_calls=calls)


def without_secret_ids(messages: Sequence[Message], redactor: Redactor) -> list[Message]:
    """A run's input with the call ids ``_ids_without_secrets`` replaces replaced, in the
    calls and in the results that answer them alike (they still pair)."""
    out = []
    for m in messages:
        m = _ids_without_secrets(m, redactor)
        if m.tool_call_id is not None:
            kept = _kept_id(m.tool_call_id, redactor)
            if kept != m.tool_call_id:
                m = dataclasses.replace(m, tool_call_id=kept)
        out.append(m)
    return out


_REPLACED = "call_masked_"


def _kept_id(call_id: str, redactor: Redactor) -> str:
    """The id the kit keeps for ``call_id``: its replacement when it holds a secret or a
    NUL (PostgreSQL's text keeps none), or looks like a replacement already (the model's
    own ``call_masked_...`` must not become another call's id); else itself. One
    redaction per id."""
    if call_id.startswith(_REPLACED) or _replaced(call_id, redactor):
        return _id_without_secret(call_id)
    return call_id


def id_as_kept(call_id: str, redactor: Redactor) -> str:
    """The id the kit keeps for a call the model gave ``call_id``, for an operator who has
    the raw one (from a tool's own logs): its replacement when it holds a secret."""
    return _id_without_secret(call_id) if _replaced(call_id, redactor) else call_id


def _replaced(call_id: str, redactor: Redactor) -> bool:
    return "\x00" in call_id or redactor.text(call_id) != call_id


def _id_without_secret(call_id: str) -> str:
    digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{_REPLACED}{digest[:24]}"


def refused(call: ToolCall) -> bool:
    """Whether ``call`` is answered "not sent" whatever its tool (``refusal_of``)."""
    return refusal_of(call) is not None


def _within_nesting(message: Message) -> Message:
    """The model's message with every call the kit cannot carry replaced by a refusal: one
    whose arguments nest deeper than the kit encodes, or whose id, name or arguments hold
    text that is not Unicode (a lone surrogate, half an emoji a stream cut). Such a call
    cannot be keyed, recorded or checkpointed as asked, so it is answered with an error
    rather than sent (and the frontier stays writable)."""
    if all(_carriable(c) is None for c in message.tool_calls):
        return message
    calls = tuple(
        c
        if (why := _carriable(c)) is None
        else dataclasses.replace(c, arguments={REFUSED_ARGUMENTS: why})
        for c in message.tool_calls
    )
    return dataclasses.replace(message, tool_calls=calls)


def _carriable(call: ToolCall) -> str | None:
    """Why the kit cannot carry ``call`` as asked, or ``None``."""
    if not within_nesting(call.arguments):
        return f"arguments nest deeper than {MAX_NESTING} levels"
    try:
        canonical_json([call.id, call.name, dict(call.arguments)]).encode("utf-8")
    except UnicodeEncodeError:
        return (
            "its id, name or arguments hold text that is not valid Unicode (a lone "
            "surrogate); ask for the call again with whole characters"
        )
    except (TypeError, ValueError) as exc:
        # A provider of the user's own (a scripted turn) can hand over a datetime or a
        # Decimal; no model sends one, and no key, record or frontier can hold it.
        return (
            f"its arguments are not JSON ({str(exc)[:120]}); ask for the call again with "
            "JSON values"
        )
    return None


# A tenant's and its key's bytes together at most this many (the key as a store keeps it,
# with the tenant escaped in front, and the tenant again beside it): within PostgreSQL's
# b-tree row limit (2704 bytes) even when they do not compress.
MAX_KEY_BYTES = 2400

SECRET_KEY = (
    "its idempotency key (made by the tool's key function) would hold a secret, and the "
    "kit never stores one; it needs a key built from values that are not secret"
)


def without_secret_keys(
    run: RunState, message: Message, redactor: Redactor, recorded: Collection[str] = ()
) -> Message:
    """The model's message with every call whose key a tool's own key function would build
    from a secret replaced by a refusal (answered "not sent", never dispatched): the key is
    what every store keeps, the frontier and the tool's downstream system too. Refused,
    not stored masked or digested: under another redaction setting (another process, a
    later kit) the same call would get another key and could go out twice. A key already
    ``recorded`` (a call that went out before the frontier, under a process that masked
    less) is kept: its outcome is replayed, never refused as if the model had not asked."""
    seen: dict[tuple[str, str], int] = {}
    calls: list[ToolCall] = []
    for call in message.tool_calls:
        tool = run.agent.tools.get(call.name)
        if refused(call) or tool is None or tool.key is None or tool.key is default_key:
            calls.append(call)
            continue
        # Occurrences counted as outstanding_calls counts them: refused twins left out.
        twin = (call.name, canonical_json(dict(call.arguments)))
        occurrence = seen.get(twin, 0)
        key, unkeyable = _key_of(run, tool, call, occurrence)
        if unkeyable is not None:
            calls.append(dataclasses.replace(call, arguments={REFUSED_ARGUMENTS: unkeyable}))
            continue
        unkept = None if key is None or key in recorded else _unkept_key(run, call, key)
        if unkept is not None:
            calls.append(dataclasses.replace(call, arguments={REFUSED_ARGUMENTS: unkept}))
            continue
        if _key_holds_a_secret(run, tool, call, occurrence, key, redactor, recorded):
            calls.append(dataclasses.replace(call, arguments={REFUSED_ARGUMENTS: SECRET_KEY}))
            continue
        seen[twin] = occurrence + 1
        calls.append(call)
    if all(a is b for a, b in zip(calls, message.tool_calls, strict=True)):
        return message
    return dataclasses.replace(message, tool_calls=tuple(calls))


def _key_of(
    run: RunState, tool: Tool, call: ToolCall, occurrence: int
) -> tuple[str | None, str | None]:
    """``call``'s key, or why it is not sent: ``tool``'s key function cannot make its key
    and the tool's parameters refuse its arguments too (the model left one out or misnamed
    it), as the tool's validation would later. A key function failing on arguments the
    tool accepts is its author's bug: ``ConfigurationError``, nothing sent."""
    try:
        key = tool.key_for(
            tenant=run.tenant,
            run_id=run.run_id,
            iteration=run.iteration,
            call=call,
            occurrence=occurrence,
        )
    except Exception as exc:
        why = tool.invalid_arguments(call.arguments)
        if why is not None:
            return None, f"{why} (so its idempotency key could not be made from them)"
        if isinstance(exc, ConfigurationError):
            raise  # what it made is no key (not a str, empty, not Unicode): it says so
        raise ConfigurationError(
            f"the key function of tool {tool.name!r} raised {type(exc).__name__} for "
            "arguments its parameters accept; it must make a key from any arguments the "
            "tool takes"
        ) from exc
    return key, None


def _unkept_key(run: RunState, call: ToolCall, key: str) -> str | None:
    """Why not every store can keep ``key``, the key a tool's key function made for
    ``call`` (a NUL in it, or longer than ``MAX_KEY_BYTES`` with its tenant), as a
    refusal's words; ``None`` when each can. Made from the model's
    arguments, such a key is the model's to mend, not a store outage every retry would
    meet again; a NUL none of them holds is the key function's own (``ConfigurationError``)."""
    own = key.removeprefix(quote(run.tenant, safe="") + "/")
    if "\x00" in own:
        if not _holds_nul(call.arguments):
            raise ConfigurationError(
                f"the key function of tool {call.name!r} made a key holding a NUL "
                "character, which not every store keeps; an idempotency key must not hold one"
            )
        return (
            "its idempotency key (made by the tool's key function) holds a NUL character, "
            "which not every store keeps; ask for the call again without it"
        )
    room = MAX_KEY_BYTES - len(run.tenant.encode("utf-8")) - (len(key) - len(own))
    size = len(own.encode("utf-8"))
    if size > room:
        return (
            f"its idempotency key (made by the tool's key function) is {size} bytes long; "
            f"under this tenant a key may be at most {room} bytes, since not every store "
            "can index a longer one"
        )
    return None


def _holds_nul(value: object) -> bool:
    """Whether a NUL character is in any text of ``value`` (keys too): the character, not
    the six characters of its JSON escape, which an argument may hold as text."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_nul(v) for v in value)
    return False


def _key_holds_a_secret(
    run: RunState,
    tool: Tool,
    call: ToolCall,
    occurrence: int,
    key: str | None,
    redactor: Redactor,
    recorded: Collection[str],
) -> bool:
    """Whether ``key``, the key ``tool``'s key function made for ``call``, holds what
    ``redactor`` masks: a secret in it, or one it took from the arguments (its key from
    the masked arguments differs, or it cannot make one from them). The kit's own part of
    the key, the tenant in front, is not asked about."""
    if key is None or key in recorded:
        return False
    own = key.removeprefix(quote(run.tenant, safe="") + "/")
    if redactor.text(own) != own:
        return True
    arguments = dict(call.arguments)
    if not redactor.changed(arguments):
        return False
    masked = dataclasses.replace(call, arguments=redactor.value(arguments))
    try:
        return (
            tool.key_for(
                tenant=run.tenant,
                run_id=run.run_id,
                iteration=run.iteration,
                call=masked,
                occurrence=occurrence,
            )
            != key
        )
    except Exception:
        return True
