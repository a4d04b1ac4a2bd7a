"""Sending one call: the attempt's guard right before the tool starts (a refusal there is
``NotSent``: nothing went out), a replay's stub in the tool's place, and the tool's answer
or error as the call's outcome."""

from __future__ import annotations

import base64
import copy
import functools
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic_core import to_jsonable_python

from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.checkpoint.redaction.keys import MAX_KEY_NAME
from tesserix_adk.errors import AdkError, ToolOutcomeUnknownError
from tesserix_adk.messages import ToolCall, ToolOutcome, int_as_text
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.stores.grouping import outside_scope
from tesserix_adk.tools import (
    NotStarted,
    Tool,
    ToolContext,
    accepts_ctx,
    call_maybe_async,
    until_the_thread_returns,
)

__all__ = ["NotSent", "error_text", "invoke", "result_content"]

_log = logging.getLogger("tesserix_adk.runner")


class NotSent(Exception):
    """The guard refused right before the tool started: nothing was sent."""

    def __init__(self, error: AdkError) -> None:
        super().__init__(str(error))
        self.error = error


async def invoke(
    attempt: Attempt, tool: Tool, call: ToolCall, ctx: ToolContext, redactor: Redactor
) -> ToolOutcome:
    """Run the tool (or its replay stub); an ``Exception`` is the call's error outcome,
    except the guard's own refusal, which stops the run with nothing sent, and a
    ``ToolOutcomeUnknownError``, which stops it with the call left in doubt."""
    refused: list[AdkError] = []

    def guard() -> None:
        try:
            attempt.guard()
        except AdkError as exc:
            refused.append(exc)
            raise

    try:
        if attempt.stubs is not None and tool.name in attempt.stubs:
            stub = attempt.stubs[tool.name]
            # Called like the tool it stands for: with the arguments its parameters make;
            # a call whose arguments were masked gets them as stored (placeholders fail the
            # tool's validation, and the stub is what replay demands for such a call).
            args = (
                copy.deepcopy(dict(call.arguments))
                if call.id in attempt.masked_calls
                else tool.parsed_arguments(call.arguments)
            )
            guard()
            with outside_scope():
                value = await call_maybe_async(
                    stub, args, ctx if accepts_ctx(stub) else None, thread=True
                )
            result = _stub_result(value)
        else:
            with outside_scope():
                result = await tool.invoke(call.arguments, ctx, guard=guard)
        return ToolOutcome(call_id=call.id, content=await converted(result))
    except ToolOutcomeUnknownError as exc:
        # Sent, and whether it took effect is unknown: told to the model as an error it
        # would be asked for again under a new key. Its claim stays in flight, for the
        # reconciler or an operator, as if the process had died inside the call.
        _log.warning(
            "%s (%s) may have run, its outcome unknown: %s",
            tool.name,
            call.id,
            redactor.text(str(exc)),
        )
        exc.add_note(f"the call {tool.name} ({call.id}) is left in doubt, its claim in flight")
        raise
    except NotStarted as exc:
        if refused and exc.error is refused[0]:
            raise NotSent(refused[0]) from None
        return ToolOutcome(call_id=call.id, content=error_text(exc.error), is_error=True)
    except Exception as exc:
        if refused and exc is refused[0]:
            raise NotSent(refused[0]) from None
        return ToolOutcome(call_id=call.id, content=error_text(exc), is_error=True)


def error_text(exc: BaseException) -> str:
    """``Type: message`` of a tool's (or a reconciler's) exception, whatever its ``__str__``
    does: the outcome of a call that ended by raising is known, and is recorded, even
    when its exception cannot say what it is."""
    try:
        said = str(exc)
    except Exception:
        try:
            said = f"(its text cannot be read) {exc!r}"
        except Exception:
            said = "(its text cannot be read)"
    return f"{type(exc).__name__}: {said}"


# Results converted on the event loop: a text, a number, or a small flat list or dict of
# them, whose conversion is cheap for sure. Anything else (a tool's own objects, whose
# ``str`` may take any time; millions of items) is converted in a worker thread, so the
# event loop keeps renewing leases meanwhile.
_SCALARS = (str, int, float, bool, type(None))
_FLAT = 64


def _cheap(result: Any) -> bool:
    kind = type(result)
    if kind in _SCALARS:
        return True
    if kind is list or kind is tuple:
        return len(result) <= _FLAT and all(type(v) in _SCALARS for v in result)
    if kind is dict:
        return len(result) <= _FLAT and all(
            type(k) is str and type(v) in _SCALARS for k, v in result.items()
        )
    return False


async def converted(result: Any) -> Any:
    """``result_content(result)``, in a worker thread unless it is plainly cheap. Cancelled
    meanwhile, it waits for the thread and raises ``ThreadReturned`` carrying the content,
    so the call's outcome, already in hand, is recorded rather than left in doubt."""
    if _cheap(result):
        return result_content(result)
    with outside_scope():
        return await until_the_thread_returns(functools.partial(result_content, result))


def result_content(result: Any) -> Any:
    """What a tool returned, as JSON data (``to_jsonable_python``; what it cannot write,
    as its ``str``): the call completed, and the model must not be told it failed because
    its result is odd. Bytes are their UTF-8 text, or base64 text when they are not UTF-8
    (an image), and an int past Python's limit for text is its hex text, value by value in
    the dicts, lists, tuples and sets that hold them; inside other objects (a dataclass),
    one value that is not UTF-8 makes all their bytes base64 (URL-safe). In a dict whose
    keys would be written alike (``1`` and ``"1"``: JSON keys are text), each key that is
    not text and clashes is written after its type (``"(int) 1"``), so no value is lost."""
    try:
        prepared = _unclashed(result, set())
    except Exception:
        prepared = result  # a mapping that cannot be walked: written as pydantic can
    try:
        content = _in_pieces(prepared)
    except Exception:
        content = _written_otherwise(prepared)
    if isinstance(content, int) and not isinstance(content, bool):
        # Alone, as text: the model is told it alike first and from its record.
        return int_as_text(content)
    return content


# One call into pydantic-core keeps the GIL for its whole length (about half a second for
# a million rows), so the event loop's lease renewals wait even while a worker thread
# converts: a result of more items than this is converted a piece of about as many at a
# time, however its items are nested.
_PIECE = 10_000


def _in_pieces(value: Any) -> Any:
    """``to_jsonable_python(value)``, in pieces of about ``_PIECE`` items when it holds
    more, so that other threads run between the pieces."""
    if _items(value, _PIECE) <= _PIECE:
        return to_jsonable_python(value, fallback=_unknown)
    kind = type(value)
    if kind is list or kind is tuple:
        out: list[Any] = []
        for batch, big in _batches(value):
            if big:
                out.append(_in_pieces(batch[0]))
            else:
                out.extend(to_jsonable_python(batch, fallback=_unknown))
        return out
    if kind is dict:
        return {_written_key(k): _in_pieces(v) for k, v in value.items()}
    return to_jsonable_python(value, fallback=_unknown)


def _batches(values: Any) -> Iterator[tuple[list[Any], bool]]:
    """``values`` as lists of about ``_PIECE`` items in all, each with whether it is one
    value holding more than that alone (converted in pieces of its own)."""
    batch: list[Any] = []
    held = 0
    for value in values:
        count = _items(value, _PIECE)
        if count > _PIECE:
            if batch:
                yield batch, False
                batch, held = [], 0
            yield [value], True
            continue
        if held + count > _PIECE and batch:
            yield batch, False
            batch, held = [], 0
        batch.append(value)
        held += count
    if batch:
        yield batch, False


def _items(value: Any, past: int) -> int:
    """How many values ``value`` holds in its lists, tuples and dicts (itself counted),
    counted only until over ``past``."""
    total = 0
    pending: list[Iterator[Any]] = [iter((value,))]
    while pending and total <= past:
        item: Any = next(pending[-1], _END)
        if item is _END:
            pending.pop()
            continue
        total += 1
        kind = type(item)
        if kind is list or kind is tuple:
            pending.append(iter(item))
        elif kind is dict:
            pending.append(iter(item.values()))
    return total


_END = object()


def _written_key(key: Any) -> str:
    if type(key) is str:
        return key
    return str(next(iter(to_jsonable_python({key: None}, fallback=_unknown))))


def _unclashed(value: Any, path: set[int]) -> Any:
    """``value`` with each dict (in the plain containers that hold it) whose keys JSON
    would write alike given keys that no longer clash: text keys stay as they are (a
    redactor masks by key name, so ``password`` must stay ``password``), and each other
    key that clashes is written after its type (``"(int) 1"``). ``value`` itself, the same
    object, when nothing clashes (the common case costs a walk and no copy)."""
    if not isinstance(value, (Mapping, list, tuple, set, frozenset)) or id(value) in path:
        return value
    path.add(id(value))
    try:
        if isinstance(value, Mapping):
            given = list(value.items()) if type(value) is dict else _grouped(value)
            items = [(k, _unclashed(v, path)) for k, v in given]
            if not all(type(k) is str for k, _ in given) and _keys_clash(given):
                return _keys_apart(items)
            unchanged = all(a[1] is b[1] for a, b in zip(items, given, strict=True))
            # A mapping that is not a dict (response headers, a settings object) is written
            # as its items, keys and all: pydantic would write it as its ``str``, where a
            # redactor finds no key to mask a secret by.
            if unchanged and type(value) is dict:
                return value
            return dict(items)
        inner = [_unclashed(v, path) for v in value]
        if all(a is b for a, b in zip(inner, value, strict=True)):
            return value
        return inner
    finally:
        path.discard(id(value))


def _grouped(mapping: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """The items of a mapping that is not a dict, a key its items repeat (a multidict:
    query parameters, headers) holding the list of its values, in their order. A multidict
    whose ``items`` gives one value a key (starlette's, httpx's) gives every one through
    ``multi_items``."""
    every = getattr(mapping, "multi_items", None)
    try:
        pairs = every() if callable(every) else mapping.items()
    except Exception:
        pairs = mapping.items()  # a multidict that reads one way only
    values: dict[Any, list[Any]] = {}
    for key, value in pairs:
        values.setdefault(key, []).append(value)
    return [(k, vs[0] if len(vs) == 1 else vs) for k, vs in values.items()]


def _unknown(value: Any) -> Any:
    """What pydantic is handed for a value it cannot write: a mapping (one inside a
    dataclass or a model too) as its items, so each value sits under its key, where a
    redactor masks it by name and none is lost; anything else as its ``str``."""
    if isinstance(value, Mapping):
        try:
            return _unclashed(value, set())
        except Exception:
            pass
    return str(value)


def _keys_clash(items: list[tuple[Any, Any]]) -> bool:
    try:
        written = to_jsonable_python(dict.fromkeys(k for k, _ in items), fallback=str)
    except Exception:
        return False  # written otherwise, key by key (``_as_key``)
    return isinstance(written, dict) and len(written) < len(items)


def _keys_apart(items: list[tuple[Any, Any]]) -> dict[str, Any]:
    """``items`` as a dict of text keys, none lost: text keys as they are, then each other
    key as JSON writes it, or, taken already, after its type (and a count if need be)."""
    kept: dict[str, Any] = {k: v for k, v in items if type(k) is str}
    for key, v in items:
        if type(key) is str:
            continue
        written = str(next(iter(to_jsonable_python({key: None}, fallback=str))))
        name, n = written, 1
        while name in kept:
            # The type goes first: a redactor masks by how a key's name ends (``password``),
            # and only a name short enough to be one (so a long one keeps its end).
            tag = ("" if n == 1 else f"#{n} ") + f"({type(key).__name__}) "
            room = max(MAX_KEY_NAME - len(tag), 1) if len(written) <= MAX_KEY_NAME else None
            name = tag + (written if room is None else written[-room:])
            n += 1
        kept[name] = v
    return kept


def _written_otherwise(result: Any) -> Any:
    """What pydantic would not write as it came: its bytes and huge ints made text first;
    failing that (a cycle, a value whose own ``str`` raises), its text (``_last_text``)."""
    try:
        prepared = _as_text(result, set())
        try:
            return to_jsonable_python(prepared, fallback=_unknown)
        except UnicodeDecodeError:
            return to_jsonable_python(prepared, fallback=_unknown, bytes_mode="base64")
    except Exception:
        return _last_text(result)


def _last_text(result: Any) -> str:
    """A result nothing else can write, as text: its ``repr`` (which writes a cycle as
    ``[...]``), or what it is when even that raises."""
    try:
        return repr(result)
    except Exception:
        return f"<a {type(result).__name__} that cannot be written as text>"


def _as_text(value: Any, path: set[int]) -> Any:
    """``value`` with the bytes and ints pydantic cannot write made text, in the plain
    containers that hold them (``path``: the containers above, so a cycle is left to
    pydantic, which refuses it)."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, int) and not isinstance(value, bool):
        return int_as_text(value)
    if not isinstance(value, (Mapping, list, tuple, set, frozenset)) or id(value) in path:
        return value
    path.add(id(value))
    try:
        if isinstance(value, Mapping):
            return {_as_key(k, path): _as_text(v, path) for k, v in value.items()}
        return [_as_text(v, path) for v in value]
    finally:
        path.discard(id(value))


def _as_key(key: Any, path: set[int]) -> Any:
    """A dict key made text as ``_as_text`` makes values, and still a key: a tuple of
    bytes (a leg and a page) made a list cannot be one, so it is its JSON text."""
    made = _as_text(key, path)
    if isinstance(made, list):
        return json.dumps(made, ensure_ascii=False, default=str)
    return made


def _stub_result(value: Any) -> Any:
    if isinstance(value, Mapping):
        # Its items as a multidict gives them, each value kept; the stub mark beside them.
        items = list(value.items()) if type(value) is dict else _grouped(value)
        return {**dict(items), "stub": True}
    return {"stub": True, "value": value}
