"""What a tool returned, as the JSON data a call's outcome holds: converted off the event
loop unless plainly cheap, in pieces when large, and with no value lost to JSON's text keys
(a dict whose keys would be written alike, a mapping that is not a dict, either inside a
plain dataclass, a deque or a generator). A pydantic model is written as it writes itself
for JSON."""

from __future__ import annotations

import base64
import functools
import json
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from pydantic_core import to_jsonable_python

from tesserix_adk.checkpoint.payload.envelope import DEFAULT_MAX_BYTES, MAX_NESTING
from tesserix_adk.checkpoint.payload.weighing import weighed
from tesserix_adk.checkpoint.redaction.keys import MAX_KEY_NAME
from tesserix_adk.messages import int_as_text
from tesserix_adk.run.error_text import error_text
from tesserix_adk.run.model_sight import ModelSight
from tesserix_adk.run.result_kinds import (
    held_inside,
    holds_a_model,
    mapping_items,
    plain_dataclass,
    pydantic_writes,
)
from tesserix_adk.run.result_text import last_text
from tesserix_adk.stores.grouping import outside_scope
from tesserix_adk.tools import until_the_thread_returns

__all__ = ["MOST_READ", "MOST_WALKED", "converted", "error_text", "mapping_items", "result_content"]


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
    the dicts, lists, tuples, sets and plain dataclasses that hold them; inside other
    objects (a model), one value that is not UTF-8 makes all their bytes base64
    (URL-safe). In a dict whose keys would be written alike (``1`` and ``"1"``: JSON keys
    are text), each key that is not text and clashes is written after its type (``"(int)
    1"``), so no value is lost."""
    try:
        prepared = _walked(result, _Walk())
    except _TooMany:
        return (
            f"(this result was not converted: it holds more than {MOST_WALKED} values, "
            "counting each time a value is held again; the call completed)"
        )
    content = _converted(prepared, set(), ModelSight())
    if isinstance(content, int) and not isinstance(content, bool):
        # Alone, as text: the model is told it alike first and from its record.
        return int_as_text(content)
    return content


# One call into pydantic-core keeps the GIL for its whole length (about half a second for
# a million rows), so the event loop's lease renewals wait even while a worker thread
# converts: a result of more items than this is converted a piece of about as many at a
# time, however its items are nested.
_PIECE = 10_000


def _in_pieces(value: Any, sight: ModelSight, path: frozenset[int] = frozenset()) -> Any:
    """``to_jsonable_python(value)``, in pieces of about ``_PIECE`` items when it holds
    more, so that other threads run between the pieces. ``path``: the containers being cut
    above it; one met again is a cycle (which holds more items than any piece, however
    small), refused at once rather than cut round and round."""
    unknown = functools.partial(_unknown, sight)
    if _items(value, _PIECE) <= _PIECE:
        return to_jsonable_python(value, fallback=unknown)
    if id(value) in path:
        raise ValueError("a result that holds itself cannot be written as JSON")
    kind = type(value)
    inside = path | {id(value)}
    if kind is list or kind is tuple:
        out: list[Any] = []
        for batch, big in _batches(value):
            if big:
                out.append(_in_pieces(batch[0], sight, inside))
            else:
                out.extend(to_jsonable_python(batch, fallback=unknown))
        return out
    if kind is dict:
        return {_written_key(k): _in_pieces(v, sight, inside) for k, v in value.items()}
    return to_jsonable_python(value, fallback=unknown)


def _converted(value: Any, path: set[int], sight: ModelSight) -> Any:
    """``_in_pieces(value)``; failing that, a plain container value by value, so one value
    nothing can write loses only itself (``path``: the containers above, so a cycle is
    written as its text, and the nesting a record keeps at most)."""
    try:
        return _in_pieces(value, sight)
    except Exception:
        pass
    kind = type(value)
    if kind not in (list, tuple, dict) or id(value) in path or len(path) >= MAX_NESTING:
        return _written_otherwise(value, sight)
    path.add(id(value))
    try:
        if kind is dict:
            return {_written_key(k): _converted(v, path, sight) for k, v in value.items()}
        return [_converted(v, path, sight) for v in value]
    except Exception:
        return _written_otherwise(value, sight)
    finally:
        path.discard(id(value))


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
    """How many values ``value`` holds in its lists, tuples and dicts (itself and a dict's
    keys counted), counted only until over ``past``."""
    return weighed(value, _one, past=past)


def _one(item: Any) -> int:
    return 1


def _written_key(key: Any) -> str:
    """A dict key as JSON writes it (text keys as they are), or, a key pydantic cannot
    write (bytes that are not UTF-8, an int past the digit limit, a frozenset), as
    ``_as_key`` makes it text; one whose text cannot be read at all says what it is."""
    name, _ = _key_name(key)
    return name


_PLAIN_KEYS = frozenset({int, float, bool, type(None), bytes, tuple, frozenset})


def _shows_a_model(key: Any) -> bool:
    """Whether pydantic would write ``key`` as text showing a model: a model in it, or a
    key of a text or number type's subclass (its ``str`` may show what it holds), or an
    enum member whose value does (written as its value's text; its class is not looked
    through, which holds every other member)."""
    if isinstance(key, Enum):
        key = key.value
    return holds_a_model(key, 0) or (type(key) not in _PLAIN_KEYS and ModelSight().shows(key))


def _key_name(key: Any) -> tuple[str, bool]:
    """``key`` written as text, and whether pydantic writes it so itself. A key that is or
    holds a pydantic model is written as ``_text_of`` writes it, the model as a note:
    pydantic would write its ``str``, every field as held."""
    if type(key) is str:
        return key, True
    try:
        holds = _shows_a_model(key)
    except Exception:
        holds = False  # a key that cannot be looked into is written as below
    if holds:
        return last_text(key), False
    try:
        return str(next(iter(to_jsonable_python({key: None}, fallback=str)))), True
    except Exception:
        pass
    try:
        made = _as_key(key, set())
        if type(made) is not str:
            made = str(next(iter(to_jsonable_python({made: None}, fallback=str))))
        return made, False
    except Exception:
        pass
    try:
        return str(key), False
    except Exception:
        return f"<a {type(key).__name__} key that cannot be written as text>", False


def _walked(value: Any, walk: _Walk) -> Any:
    """``_unclashed(value)``, or, where walking it raises (a dataclass field never set, a
    list whose iteration raises, nesting past the interpreter's limit), the value as it
    came, left to the conversion: what the walk read from a generator beside it is kept.
    Only a result past ``MOST_WALKED`` values stops the walk (``_TooMany``)."""
    try:
        return _unclashed(value, walk)
    except _TooMany:
        raise
    except Exception:
        return value


def _unclashed(value: Any, walk: _Walk) -> Any:
    """``value`` with each dict it holds whose keys JSON would write alike (or one key
    pydantic cannot write) given text keys that no longer clash: text keys stay as they
    are (a redactor masks by key name, so ``password`` must stay ``password``), and each
    other key is written as JSON writes it, or, taken already, after its type (``"(int)
    1"``). It looks in plain containers, deques and iterators (which pydantic writes as
    lists, and which are read here once), and in plain dataclasses (as the dict of their
    fields pydantic writes); a pydantic model is left to pydantic whole, iterators and
    all, since it may write itself otherwise for JSON (a serializer that masks, an alias,
    its settings, a serializer of each item an iterator yields), though what it holds is
    counted against ``MOST_WALKED``. ``value``
    itself, the same object, when nothing clashes (the common case costs a walk and no
    copy)."""
    walk.values -= 1
    if walk.values < 0:
        raise _TooMany
    if isinstance(value, Iterator) and not isinstance(value, (str, bytes, bytearray)):
        return _read_once(value, walk)
    if pydantic_writes(value):
        _count_inside(value, walk)
        return value
    if plain_dataclass(value):
        if id(value) in walk.path:
            return _again(value)
        walk.path.add(id(value))
        try:
            # Written as pydantic writes it, so that what it holds is walked (and cut into
            # pieces when large) as the dict's values are.
            return {f.name: _walked(getattr(value, f.name), walk) for f in fields(value)}
        finally:
            walk.path.discard(id(value))
    if not isinstance(value, (Mapping, list, tuple, set, frozenset, deque)):
        return value
    if id(value) in walk.path:
        return _again(value)
    walk.path.add(id(value))
    try:
        if isinstance(value, Mapping):
            given = mapping_items(value)
            items = [(k, _walked(v, walk)) for k, v in given]
            if not all(type(k) is str for k, _ in given) and _keys_clash(given):
                return _keys_apart(items)
            unchanged = all(a[1] is b[1] for a, b in zip(items, given, strict=True))
            # A mapping that is not a dict (response headers, a settings object) is written
            # as its items, keys and all: pydantic would write it as its ``str``, where a
            # redactor finds no key to mask a secret by.
            if unchanged and type(value) is dict:
                return value
            return dict(items)
        inner = [_walked(v, walk) for v in value]
        if all(a is b for a, b in zip(inner, value, strict=True)):
            return value
        return inner
    finally:
        walk.path.discard(id(value))


def _count_inside(model: Any, walk: _Walk) -> None:
    """Count against ``MOST_WALKED`` each value a pydantic model (or pydantic dataclass)
    holds, each time held, as pydantic will write them (``_TooMany`` past it): shared lists
    inside a model hold billions as readily as outside one. Its iterators are not read
    (pydantic reads them, through the model's serializers), and a cycle stops the count
    (pydantic refuses it)."""
    waiting: list[tuple[Any, bool]] = [(model, False)]
    path: set[int] = set()
    while waiting:
        part, leaving = waiting.pop()
        if leaving:
            path.discard(id(part))
            continue
        walk.values -= 1
        if walk.values < 0:
            raise _TooMany
        if id(part) in path:
            continue
        held = held_inside(part)
        if held:
            path.add(id(part))
            waiting.append((part, True))
            waiting.extend((h, False) for h in held)


def _again(value: Any) -> str:
    """A container met again inside itself, as ``repr`` writes one (``[...]``): what it
    holds is written where it was met first, so the copy holds no cycle, and no dict inside
    the cycle is handed to pydantic, which writes a model key as the model's ``str``."""
    return f"<{type(value).__name__} ...>"


MOST_READ = DEFAULT_MAX_BYTES
"""The most values a result's iterators are read for, all together: each takes two bytes
of JSON at least, so a result of more is over the default ``max_bytes`` and recorded as too
large anyway, and an endless generator (``itertools.count()``) cannot hold up the run."""


MOST_WALKED = 4 * MOST_READ
"""The most values a result is walked for, counting a value each time it is held (a list
held a thousand times over is a thousand lists): a few shared lists can hold billions, which
neither this walk nor pydantic would finish, and no record could keep."""


class _TooMany(Exception):
    """A result past ``MOST_WALKED`` values."""


@dataclass(slots=True)
class _Walk:
    """One walk of a result: the containers it is inside (a cycle is left to pydantic,
    which refuses it), how many more values its iterators may yield, and how many more
    values it may look at."""

    path: set[int] = field(default_factory=set)
    left: int = MOST_READ
    values: int = MOST_WALKED


def _read_once(values: Iterator[Any], walk: _Walk) -> list[Any]:
    """What an iterator yields, as a list; when reading it raises (a page that failed),
    what it yielded before, then a text saying how it stopped: the call completed, and
    neither its pages nor its failure is dropped. Past ``MOST_READ`` values read in the
    whole result, it is not read further, and a text says so."""
    out: list[Any] = []
    walk.path.add(id(values))
    try:
        _read_into(out, values, walk)
    finally:
        walk.path.discard(id(values))
    return out


def _read_into(out: list[Any], values: Iterator[Any], walk: _Walk) -> None:
    while True:
        if walk.left <= 0:
            out.append(
                f"(the rest of this result was not read: its iterators yielded more than "
                f"{MOST_READ} values)"
            )
            return
        try:
            value = next(values)
        except StopIteration:
            return
        except Exception as exc:
            out.append(f"(the rest of this result could not be read: {error_text(exc)})")
            return
        walk.left -= 1
        if isinstance(value, Iterator) and id(value) in walk.path:
            out.append("(the rest of this result was not read: it yields itself)")
            return
        out.append(_walked(value, walk))


def _unknown(sight: ModelSight, value: Any) -> Any:
    """What pydantic is handed for a value it cannot write: a mapping (one inside a
    dataclass or a model too) as its items, so each value sits under its key, where a
    redactor masks it by name and none is lost; anything else as its ``str``, or as a note
    where that may show a pydantic model's ``repr`` (``ModelSight``)."""
    if isinstance(value, Mapping):
        try:
            return _unclashed(value, _Walk())
        except Exception:
            pass
    if sight.shows(value):
        return sight.note(value)
    return str(value)


def _keys_clash(items: list[tuple[Any, Any]]) -> bool:
    """Whether JSON would write two keys alike, or pydantic cannot write one of them."""
    seen: set[str] = set()
    for key, _ in items:
        name, by_pydantic = _key_name(key)
        if not by_pydantic or name in seen:
            return True
        seen.add(name)
    return False


def _keys_apart(items: list[tuple[Any, Any]]) -> dict[str, Any]:
    """``items`` as a dict of text keys, none lost: text keys as they are, then each other
    key as JSON writes it, or, taken already, after its type (and a count if need be)."""
    kept: dict[str, Any] = {k: v for k, v in items if type(k) is str}
    for key, v in items:
        if type(key) is str:
            continue
        written = _written_key(key)
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


def _written_otherwise(result: Any, sight: ModelSight) -> Any:
    """What pydantic would not write as it came: its bytes and huge ints made text first;
    failing that (a cycle, a value whose own ``str`` raises), its text (``last_text``)."""
    unknown = functools.partial(_unknown, sight)
    try:
        prepared = _as_text(result, set())
        try:
            return to_jsonable_python(prepared, fallback=unknown)
        except UnicodeDecodeError:
            return to_jsonable_python(prepared, fallback=unknown, bytes_mode="base64")
    except Exception:
        return last_text(result, sight)


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
