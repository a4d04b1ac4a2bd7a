"""Tools: ``@tool``/``Tool``, their JSON schema, idempotency keys and ``ToolContext``.

A tool says what it does to the world (``side_effects``, ``idempotent``) so that resume can
decide, without the agent at hand, whether a call that may have run can be sent again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import hashlib
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast, overload
from urllib.parse import quote

from pydantic import ValidationError

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import ToolCall
from tesserix_adk.reconcile import Reconciler
from tesserix_adk.tool_schema import CTX as _CTX
from tesserix_adk.tool_schema import arguments_model, check_flags, read_only

__all__ = [
    "KeyFunction",
    "Tool",
    "ToolContext",
    "ToolSpec",
    "canonical_json",
    "default_key",
    "tool",
]


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal data, equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class KeyFunction(Protocol):
    """Derives a call's idempotency key; must be a pure function of its inputs.

    A key function may also take ``occurrence`` (keyword): the index of this (tool,
    arguments) pair among identical calls of the same turn. One that does not take it gets
    ``#<occurrence>`` appended to its key for every twin after the first.
    """

    def __call__(
        self, *, tenant: str, run_id: str, iteration: int, tool: str, arguments: Mapping[str, Any]
    ) -> str: ...


def default_key(
    *,
    tenant: str,
    run_id: str,
    iteration: int,
    tool: str,
    arguments: Mapping[str, Any],
    occurrence: int = 0,
) -> str:
    """A digest of (tenant, run, iteration, tool, arguments, occurrence); never the
    provider's call id, so a model that asks the same call again after a crash finds the
    recorded outcome. ``occurrence`` tells twin calls of one turn apart (the first twin's
    key is the same as before twins were told apart)."""
    parts: list[Any] = [tenant, run_id, iteration, tool, dict(arguments)]
    if occurrence:
        parts.append(occurrence)
    body = canonical_json(parts)
    return "k1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


def key_digest(key: str) -> str:
    """An idempotency key as an operator sees it (``sha256:`` and 16 hex digits): enough
    to tell a run's calls apart, never the key, which a tool passes on to the world."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def replay_key(run_id: str, key: str) -> str:
    """The key a replay (run ``run_id``) gives a call its tool keys ``key``: one of its own,
    whatever the key names, so a stub's outcome is never recorded under the original run's
    record (a key naming the business object is shared by every run that books it), nor the
    original's outcome read as the replay's."""
    body = canonical_json(["replay", run_id, key])
    return "r1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolContext:
    """What a tool may know about the call it serves; pass ``idempotency_key`` on to the
    external system so it can deduplicate. ``state`` is the run's live state object."""

    tenant: str
    run_id: str
    call: ToolCall
    idempotency_key: str | None
    fence: int | None
    iteration: int
    state: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """What a model is told about a tool."""

    name: str
    description: str
    parameters: Mapping[str, Any]


class Tool:
    """A function the model may call, with what it does to the world declared up front."""

    __slots__ = (
        "_accepts_ctx",
        "_args_model",
        "_key_takes_occurrence",
        "_pinned",
        "description",
        "fn",
        "idempotent",
        "inline",
        "key",
        "name",
        "parameters",
        "reconcile",
        "requires_approval",
        "side_effects",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        side_effects: bool = True,
        idempotent: bool = False,
        requires_approval: bool = False,
        key: KeyFunction | None = default_key,
        inline: bool = False,
        reconcile: Reconciler | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigurationError(
                f"a tool is made of a function, a method or a callable object, not "
                f"{type(fn).__name__}"
            )
        self.fn = fn
        named = getattr(fn, "__name__", None) if name is None else name
        if not isinstance(named, str) or not named:
            raise ConfigurationError(
                f"a tool made of {type(fn).__name__} {fn!r} has no name of its own; give "
                "it one: Tool(fn, name=...)"
            )
        masked = default_redactor().text(named)
        if masked != named:
            # A tool's name is kept as it is in every record of its calls and matched with
            # what the model asks for, so it cannot be stored masked (an MCP server's
            # listing is not ours to trust).
            raise ConfigurationError(
                f"the name of tool {masked!r} reads as holding a secret, and a tool's name is "
                "kept in every store as it is; name the tool otherwise"
            )
        self.name = named
        check_flags(
            named,
            description=description,
            side_effects=side_effects,
            idempotent=idempotent,
            requires_approval=requires_approval,
            inline=inline,
            key=key,
            reconcile=reconcile,
        )
        self.description = (description or inspect.getdoc(fn) or "").strip()
        self.side_effects = side_effects
        self.idempotent = idempotent
        self.requires_approval = requires_approval
        self.key = key
        # A sync tool runs in a worker thread so it never stalls lease renewals; ``inline``
        # is for the rare one that must run on the event loop's thread.
        self.inline = inline
        # Asked, on resume, whether a call of this tool left in doubt happened (reconcile.py).
        self.reconcile = reconcile
        if reconcile is not None and key is None:
            raise ConfigurationError(
                f"tool {self.name!r} has a reconciler but no idempotency key: a reconciler "
                "looks a call up by its key"
            )
        self._key_takes_occurrence = key is not None and _takes(key, "occurrence")
        self._args_model, self._accepts_ctx, schema = arguments_model(fn, self.name)
        self.parameters: Mapping[str, Any] = schema

    @property
    def takes_context(self) -> bool:
        """Whether the tool may read the run's state: its function declares a ``ctx``
        parameter, or its class sends calls its own way (``invoke`` is handed ``ctx``)."""
        return self._accepts_ctx or type(self).invoke is not Tool.invoke

    def __setattr__(self, name: str, value: Any) -> None:
        # Fixed once an agent holds it: the agent's revision pins the tool's contract as it
        # was then, and a tool changed afterwards would be resumed under a stale revision.
        if getattr(self, "_pinned", False) and hasattr(self, name):
            raise AttributeError(
                f"tool {self.name!r} is fixed once an agent holds it (the agent's revision "
                "pins it); make a new one"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if getattr(self, "_pinned", False):
            raise AttributeError(f"tool {self.name!r} is fixed once an agent holds it")
        object.__delattr__(self, name)

    def pin(self) -> None:
        """Fix the tool as it is (``Agent`` does, as it computes its revision): its fields
        and its schema, which becomes read-only all the way down."""
        if not getattr(self, "_pinned", False):
            object.__setattr__(self, "parameters", read_only(self.parameters))
            object.__setattr__(self, "_pinned", True)

    @property
    def keyed(self) -> bool:
        """Calls of this tool carry an idempotency key."""
        return self.key is not None

    @property
    def spec(self) -> ToolSpec:
        """The description a provider sends to the model."""
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)

    def key_for(
        self, *, tenant: str, run_id: str, iteration: int, call: ToolCall, occurrence: int = 0
    ) -> str | None:
        """The call's idempotency key, or ``None`` for a tool that opted out.

        ``occurrence`` is the index of this call among identical (tool, arguments) calls of
        the same turn, so twins get keys of their own.
        """
        if self.key is None:
            return None
        key = self._raw_key(
            tenant=tenant, run_id=run_id, iteration=iteration, call=call, occurrence=occurrence
        )
        if not isinstance(key, str) or not key:
            raise ConfigurationError(
                f"the key function of tool {self.name!r} returned {type(key).__name__} "
                f"{key!r}; an idempotency key is a non-empty str"
            )
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            # A lone surrogate (text cut by bytes): no store can keep it, and each would
            # fail its own way, a retry never mending it.
            raise ConfigurationError(
                f"the key function of tool {self.name!r} made a key that is not valid "
                "Unicode (a lone surrogate); an idempotency key must be whole text"
            ) from exc
        if not self._key_takes_occurrence and occurrence:
            key = f"{key}#{occurrence}"
        if self.key is not default_key:
            # Records are kept per (tenant, key): a business key such as "order-5" names no
            # tenant, so the tenant (percent-encoded: no "/" left in it) goes in front.
            key = f"{quote(tenant, safe='')}/{key}"
        return key

    def _raw_key(
        self, *, tenant: str, run_id: str, iteration: int, call: ToolCall, occurrence: int
    ) -> Any:
        assert self.key is not None
        if self._key_takes_occurrence:
            return cast(Callable[..., Any], self.key)(
                tenant=tenant,
                run_id=run_id,
                iteration=iteration,
                tool=self.name,
                arguments=call.arguments,
                occurrence=occurrence,
            )
        return self.key(
            tenant=tenant,
            run_id=run_id,
            iteration=iteration,
            tool=self.name,
            arguments=call.arguments,
        )

    def invalid_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` cannot be given to this tool (they fail its parameters'
        validation), or ``None``: such a call is answered without being sent."""
        try:
            self._args_model.model_validate(dict(arguments))
        except ValidationError as exc:
            return f"invalid arguments for {self.name}: {exc}"
        return None

    def parsed_arguments(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments the function is called with: ``arguments`` validated
        against its parameters (``ValueError`` if they fail), as a copy."""
        try:
            # A copy: a tool that changes what it was given (a list under an untyped
            # parameter) must not change the call the model asked for, as the live
            # conversation (and a same-runner retry) would then tell it.
            parsed = self._args_model.model_validate(copy.deepcopy(dict(arguments)))
        except ValidationError as exc:
            raise ValueError(f"invalid arguments for {self.name}: {exc}") from exc
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    async def invoke(
        self,
        arguments: Mapping[str, Any],
        ctx: ToolContext,
        *,
        guard: Callable[[], None] | None = None,
    ) -> Any:
        """Validate the arguments and run the function: a sync one in a worker thread
        (unless ``inline``). ``guard`` is called right before the function starts, with
        nothing awaited in between, so a holder that lost the run sends nothing."""
        kwargs = self.parsed_arguments(arguments)
        if guard is not None:
            guard()
        return await call_maybe_async(
            self.fn,
            kwargs,
            ctx if self._accepts_ctx else None,
            thread=not self.inline,
            guard=guard,
        )

    def __repr__(self) -> str:
        return f"Tool({self.name!r}, side_effects={self.side_effects})"


async def call_maybe_async(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    ctx: ToolContext | None,
    *,
    thread: bool = False,
    guard: Callable[[], None] | None = None,
) -> Any:
    """Call ``fn`` with keyword arguments (and ``ctx`` when given), sync or async; with
    ``thread``, a sync ``fn`` runs in a worker thread, off the event loop, and ``guard``
    is called again in that thread right before ``fn`` starts (``NotStarted`` if it
    raises)."""
    if ctx is not None:
        kwargs = {**kwargs, _CTX: ctx}
    if _is_async(fn):
        return await cast(Callable[..., Awaitable[Any]], fn)(**kwargs)
    if thread:
        result = await until_the_thread_returns(functools.partial(_in_thread, fn, kwargs, guard))
    else:
        result = fn(**kwargs)
    if inspect.isawaitable(result):
        return await result
    return result


class NotStarted(Exception):
    """A sync tool's thread did not start it: the guard, asked again as the thread took
    the call up, refused (``error``). A call waits for a free thread for as long as other
    calls hold them, and the run's lease may lapse meanwhile: nothing was sent."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class ThreadReturned(asyncio.CancelledError):
    """The cancellation of a sync tool's call, raised once its thread returned: what the
    call did is known (``done``), so the dispatch unit records it before letting the
    cancellation go on instead of leaving the call in doubt."""

    def __init__(self, done: asyncio.Future[Any]) -> None:
        super().__init__("cancelled while a sync tool ran; its thread has returned")
        self.done = done


async def until_the_thread_returns(call: Callable[[], Any]) -> Any:
    """``call()`` in a worker thread. A thread cannot be cancelled: cancelled meanwhile,
    this still waits for it to return before the cancellation goes on (as
    ``ThreadReturned``, carrying what it returned), so the run keeps its lease (and its
    renewals) for as long as the call may still be sending."""
    done = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        while not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({done})
        if done.cancelled():
            raise
        done.exception()  # retrieved here; the dispatch unit reads it again from ``done``
        raise ThreadReturned(done) from None


def _in_thread(
    fn: Callable[..., Any], kwargs: dict[str, Any], guard: Callable[[], None] | None
) -> Any:
    if guard is not None:
        try:
            guard()
        except Exception as exc:
            raise NotStarted(exc) from exc
    try:
        return fn(**kwargs)
    except StopIteration as exc:
        # A future cannot carry StopIteration (asyncio drops it and the await never ends).
        raise RuntimeError(f"the tool raised StopIteration: {exc!r}") from exc
    except (asyncio.CancelledError, concurrent.futures.CancelledError, GeneratorExit) as exc:
        # Nothing cancels a thread: the tool's own (a cancelled future's result), which
        # the await would take for the run being cancelled (or, GeneratorExit, for the
        # coroutine being closed) and leave its outcome unrecorded, the call in doubt.
        raise RuntimeError(f"the tool raised {type(exc).__name__}: {exc!r}") from exc


def _is_async(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    # Only a parameter of that name: ``**kw`` takes anything without meaning to honour it.
    param = params.get(name)
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


def accepts_ctx(fn: Callable[..., Any]) -> bool:
    """``fn`` declares a ``ctx`` parameter (a callable whose signature cannot be read, a
    builtin type, declares none)."""
    try:
        return _CTX in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    side_effects: bool = True,
    idempotent: bool = False,
    requires_approval: bool = False,
    key: KeyFunction | None = default_key,
    inline: bool = False,
    reconcile: Reconciler | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effects: bool = True,
    idempotent: bool = False,
    requires_approval: bool = False,
    key: KeyFunction | None = default_key,
    inline: bool = False,
    reconcile: Reconciler | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a function a ``Tool``; usable bare (``@tool``) or with keywords."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            f,
            name=name,
            description=description,
            side_effects=side_effects,
            idempotent=idempotent,
            requires_approval=requires_approval,
            key=key,
            inline=inline,
            reconcile=reconcile,
        )

    if fn is not None:
        return wrap(fn)
    return wrap
