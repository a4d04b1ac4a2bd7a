"""How a tool's signature becomes what the model is told (its JSON schema) and what the
function is called with (a pydantic model of its parameters): which parameters a call may
pass, the ones it may not (``ctx``, a partial's bound keywords), and the flags a tool is
made with, checked when it is made.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema

from tesserix_adk.errors import ConfigurationError

__all__ = ["CTX", "arguments_model", "check_flags"]

# The parameter a tool declares to get its ToolContext (never the model's to pass).
CTX = "ctx"


def arguments_model(
    fn: Callable[..., Any], name: str
) -> tuple[type[BaseModel], bool, dict[str, Any]]:
    """The pydantic model of the arguments ``fn`` takes from a call, whether it declares
    ``ctx``, and the JSON schema the model is told (``_SetsInOrder``)."""
    try:
        # From the signature, which sees through a partial or a callable object's
        # ``__call__`` (the object's own annotations would be none: every type ``Any``).
        sig = inspect.signature(fn, eval_str=True)
    except (TypeError, ValueError, NameError) as exc:
        raise ConfigurationError(f"cannot read the signature of tool {name!r}: {exc}") from exc
    own_call = None if inspect.isroutine(fn) else inspect.getattr_static(type(fn), "__call__", None)
    if inspect.isasyncgenfunction(fn) or inspect.isasyncgenfunction(own_call):
        raise ConfigurationError(
            f"tool {name!r} is an async generator: calling it runs nothing; make it a "
            "coroutine (async def ... return) or a plain function"
        )
    if _method_in_class_body(fn, sig):
        raise ConfigurationError(
            f"tool {name!r} is a method in its class body: the model would be asked for "
            "`self`; make a tool of the bound method instead (`tool(shop.charge)`), or a "
            "staticmethod"
        )
    # A partial's bound keywords are fixed by its author: the signature lists them as
    # parameters with defaults, and the model must not be offered (or allowed) to change them.
    fixed = _fixed_keywords(fn)
    fields: dict[str, Any] = {}
    has_ctx = False
    for param in sig.parameters.values():
        if param.name in fixed:
            continue
        if param.name == CTX:
            if not _holds_a_context(param.annotation):
                raise ConfigurationError(
                    f"tool {name!r} has a parameter `ctx` annotated {param.annotation!r}: the "
                    "kit hands `ctx` a ToolContext and hides it from the model; annotate it "
                    "ToolContext, or give the model's parameter another name"
                )
            has_ctx = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(f"tool {name!r} cannot take *args or **kwargs")
        unpassable = _unpassable(param)
        if unpassable is not None:
            raise ConfigurationError(
                f"tool {name!r} has a parameter {param.name!r} {unpassable}, so no call "
                "could pass it; rename it, or make it keyword"
            )
        annotation = Any if param.annotation is param.empty else param.annotation
        default = ... if param.default is param.empty else param.default
        if isinstance(default, FieldInfo) and default.examples:
            # Examples only describe: a set among them is written in one order everywhere.
            default = FieldInfo.merge_field_infos(
                default, examples=_sets_in_order(default.examples)
            )
        fields[param.name] = (annotation, default)
    try:
        model = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        schema = model.model_json_schema(schema_generator=_SetsInOrder)
    except Exception as exc:  # pydantic's schema errors: a type it cannot describe
        raise ConfigurationError(
            f"tool {name!r} has parameters the kit cannot describe to a model: {exc}"
        ) from exc
    return cast(type[BaseModel], model), has_ctx, schema


def _holds_a_context(annotation: Any) -> bool:
    """Whether a ``ctx`` annotated so may be handed a ``ToolContext``: none, ``Any``,
    ``object``, a type ``ToolContext`` is (``ToolContext | None`` too, its name as text
    inside ``Optional["ToolContext"]``), or one the kit cannot check (a protocol): only a
    type that plainly is not one is refused."""
    # Imported here: tools.py, which defines it, builds on this module.
    from tesserix_adk.tools import ToolContext

    if annotation in (inspect.Parameter.empty, Any, object, ToolContext):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _holds_a_context(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_holds_a_context(arg) for arg in typing.get_args(annotation))
    if isinstance(annotation, typing.ForwardRef):
        # A name left as text inside another annotation (``Optional["ToolContext"]``).
        return annotation.__forward_arg__.rpartition(".")[2] == ToolContext.__name__
    kind = annotation if origin is None else origin
    if not isinstance(kind, type):
        return False
    try:
        return issubclass(ToolContext, kind)
    except TypeError:
        return True  # a protocol ``issubclass`` cannot check: ToolContext may well be one


def _method_in_class_body(fn: Callable[..., Any], sig: inspect.Signature) -> bool:
    """A plain function defined in a class body (``Shop.charge``, not one nested in a
    function) whose first parameter is ``self`` or ``cls``: ``@tool`` on a method."""
    if not inspect.isfunction(fn):
        return False
    parents = fn.__qualname__.split(".")[:-1]
    first = next(iter(sig.parameters), None)
    return bool(parents) and parents[-1] != "<locals>" and first in ("self", "cls")


def check_flags(
    name: str,
    *,
    description: object,
    key: object,
    reconcile: object,
    **flags: object,
) -> None:
    """Refuse, when the tool is made, flags of the wrong type: ``side_effects="no"`` would
    read as true, and a key or reconciler that cannot be called would fail only once a
    call was paid for (or after a crash)."""
    wrong = [f"{flag}={value!r}" for flag, value in flags.items() if not isinstance(value, bool)]
    if description is not None and not isinstance(description, str):
        wrong.append(f"description={description!r:.60}")
    if key is not None and not callable(key):
        wrong.append(f"key={key!r:.60} (a function of the call, or None)")
    if reconcile is not None and not callable(reconcile):
        wrong.append(f"reconcile={reconcile!r:.60} (a function, or None)")
    if wrong:
        raise ConfigurationError(f"tool {name!r}: {', '.join(wrong)}; flags are True or False")


def _fixed_keywords(fn: Callable[..., Any]) -> set[str]:
    """The keywords partials bind on the way to the function, through decorators that say
    what they wrap (``functools.wraps``), as ``inspect.signature`` follows them."""
    fixed: set[str] = set()
    seen: set[int] = set()
    current: Any = fn
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, functools.partial):
            fixed |= set(current.keywords)
            current = current.func
        else:
            current = getattr(current, "__wrapped__", None)
    return fixed


def _sets_in_order(value: Any) -> Any:
    """``value`` with every set in it a list in one order, whatever the hash seed (pydantic
    writes a set it cannot sort, of mixed types, in the order it iterates)."""
    if isinstance(value, set | frozenset):
        items = [_sets_in_order(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True, default=repr))
    if isinstance(value, list | tuple):
        return [_sets_in_order(v) for v in value]
    if isinstance(value, dict):
        return {k: _sets_in_order(v) for k, v in value.items()}
    return value


class _SetsInOrder(GenerateJsonSchema):
    """The schema a model is told, the same in every process: a tool's schema is part of
    the agent's revision, and a resume under another revision is refused."""

    def encode_default(self, dft: Any) -> Any:
        return super().encode_default(_sets_in_order(dft))


def _unpassable(param: inspect.Parameter) -> str | None:
    """Why a call could never pass ``param`` by name (the model sends arguments by name,
    validated by a pydantic model), or ``None``."""
    if param.kind is param.POSITIONAL_ONLY:
        return "that is positional-only"
    if param.name.startswith("_"):
        return "whose name starts with '_' (pydantic keeps such names private)"
    own = inspect.getattr_static(BaseModel, param.name, None)
    if param.name == "model_config" or hasattr(type(own), "__set__"):
        # model_extra, model_fields_set: a property of pydantic's model, which would be
        # read back instead of the value the model sent (a method such as json is not).
        return f"named {param.name} (pydantic's own name)"
    return None


def read_only(value: Any) -> Any:
    """``value`` (a JSON schema) with its dicts and lists made read-only, all the way down:
    what a tool's revision pins cannot be changed in place. They are still a ``dict`` and a
    ``list`` to whatever reads them (an SDK, ``json``), and a copy of them (``copy``,
    ``deepcopy``, ``pickle``) is a plain one, which a provider may adapt as it likes."""
    if isinstance(value, dict):
        return _ReadOnlyDict({k: read_only(v) for k, v in value.items()})
    if isinstance(value, list):
        return _ReadOnlyList(read_only(v) for v in value)
    return value


def _refused(*_: Any, **__: Any) -> Any:
    raise TypeError("a tool's schema is fixed once an agent holds it; make a new tool")


class _ReadOnlyDict(dict[str, Any]):
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refused
    clear = pop = popitem = setdefault = update = _refused

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


class _ReadOnlyList(list[Any]):
    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refused
    append = extend = insert = pop = remove = clear = sort = reverse = _refused

    def __reduce__(self) -> Any:
        return (list, (list(self),))
