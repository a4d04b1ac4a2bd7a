"""Reading a backend's rows back into records: a damaged row is a typed error, never a
``ValueError``/``KeyError``/``TypeError`` from deep inside a decoder."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores.protocols.work import (
    DamagedEntry,
    WorkIndex,
    WorkItem,
    WorkListing,
    WorksAroundDamage,
    WorkState,
)

__all__ = [
    "decoded",
    "due_items",
    "leading",
    "listed_items",
    "listed_past_damage",
    "listing_around_damage",
    "stored_calls",
    "typed",
    "with_damaged",
]

_log = logging.getLogger("tesserix_adk.stores")

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")

_DAMAGE = (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError)


def decoded(what: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Wrap a row decoder so damage surfaces as ``CheckpointCorruptError`` naming ``what``."""

    def wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def read(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return fn(*args, **kwargs)
            except _DAMAGE as exc:
                # The store's damage in the kit's words; the Python error stays the cause.
                raise CheckpointCorruptError(
                    f"a stored {what} cannot be read ({exc}); the store holds a damaged row"
                ) from exc

        return read

    return wrap


def stored_calls(raw: Any) -> tuple[ToolCall, ...]:
    """The calls of an approval request as a store kept them (parsed JSON), checked: a
    list of objects with a str ``id`` and ``name`` and an object of ``arguments``
    (``ValueError`` otherwise, which ``decoded`` makes typed)."""
    if not isinstance(raw, list):
        raise ValueError(f"calls are {type(raw).__name__}, not a list")
    calls = []
    for c in raw:
        if not (
            isinstance(c, dict)
            and isinstance(c.get("id"), str)
            and isinstance(c.get("name"), str)
            and isinstance(c.get("arguments"), dict)
        ):
            raise ValueError(f"a call is not an object with id, name and arguments: {c!r}")
        calls.append(ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]))
    return tuple(calls)


def typed(value: Any, *kinds: type, what: str) -> Any:
    """``value`` if it is one of ``kinds`` (``None`` passes when ``type(None)`` is given;
    a ``bool`` never passes for an ``int``), else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"{what} is {value!r}")
    if not isinstance(value, kinds):
        raise ValueError(f"{what} is {type(value).__name__} {value!r}")
    return value


def due_items(
    rows: Iterable[R], read: Callable[[R], T], named: set[str], where: Callable[[R], str]
) -> list[T]:
    """The work index rows a worker polled, read; a damaged one (a hand edit, another kit's)
    is left out rather than stop the worker from carrying every other run, and named
    (``where``: its tenant and run, as far as they read) in the log once per store
    (``named`` remembers which)."""
    items: list[T] = []
    for row in rows:
        try:
            items.append(read(row))
        except CheckpointCorruptError:
            try:
                run = where(row)
            except Exception:
                run = "(unreadable)"
            if run not in named:
                named.add(run)
                # Not the error's words: they quote the stored values, which may hold
                # anything (a secret); `tesserix runs` shows them, redacted.
                _log.warning(
                    "the work index entry of run %r is left out: it cannot be read (a "
                    "damaged row; `tesserix runs` says what is wrong)",
                    run,
                )
    return items


def listing_around_damage(
    rows: Iterable[R],
    read: Callable[[R], WorkItem],
    names: Callable[[R], tuple[str | None, str | None]],
) -> WorkListing:
    """The rows of an operator's listing, read; each damaged one named (``names``: its
    tenant and run, as far as they read) and passed by."""
    items: list[WorkItem] = []
    damaged: list[DamagedEntry] = []
    for row in rows:
        try:
            items.append(read(row))
        except CheckpointCorruptError as exc:
            try:
                tenant, run_id = names(row)
            except Exception:
                tenant, run_id = None, None
            damaged.append(DamagedEntry(tenant, run_id, str(exc)))
    return WorkListing(tuple(items), tuple(damaged))


async def listed_past_damage(
    work: WorkIndex, tenant: str | None, state: WorkState | None
) -> WorkListing:
    """The entries of ``tenant`` (every tenant: ``None``) in ``state``, past any damaged
    one when the index can say which (``WorksAroundDamage``); else as ``items`` has them,
    which stops at the first."""
    if isinstance(work, WorksAroundDamage):
        return await work.listing(tenant, state=state)
    return WorkListing(tuple(await work.items(tenant, state=state)), ())


def listed_items(listing: WorkListing) -> list[WorkItem]:
    """``WorkIndex.items`` from a ``listing``: its entries, or ``CheckpointCorruptError``
    naming the first damaged one, so the operator knows which entry to mend."""
    if listing.damaged:
        first = listing.damaged[0]
        raise CheckpointCorruptError(f"work index: {first.named}: {first.why}")
    return list(listing.items)


# At most this many damaged entries are asked past a poll's limit: beyond it, more damage
# than any store should hold, a worker may find fewer runs than it has room for.
MAX_DAMAGED_ASKED = 100


def with_damaged(limit: int, named: set[str]) -> int:
    """How many entries a poll of ``limit`` asks for: as many more as damaged entries this
    store has met, since they come back and are left out, and must not take the place of
    runs behind them (a worker with one free slot would otherwise only ever meet the
    damaged one)."""
    return limit + min(len(named), MAX_DAMAGED_ASKED)


def leading(row: Sequence[Any]) -> str:
    """``tenant/run`` of a row that starts with them (bytes or text)."""
    return "/".join(
        p.decode("utf-8", "replace") if isinstance(p, bytes) else str(p) for p in row[:2]
    )
