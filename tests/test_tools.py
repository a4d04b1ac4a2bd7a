"""Tools: schema from the signature, keys, ToolContext, sync and async bodies."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import pytest

from tesserix_adk import ConfigurationError, Tool, ToolCall, ToolContext, default_key, tool


def _ctx(call: ToolCall) -> ToolContext:
    return ToolContext(
        tenant="acme", run_id="r", call=call, idempotency_key="k", fence=3, iteration=0
    )


def test_schema_is_derived_from_the_signature_and_ctx_is_left_out() -> None:
    @tool
    def book_seat(flight: str, seats: int = 1, *, ctx: ToolContext) -> str:
        """Book seats."""
        return flight

    assert book_seat.name == "book_seat"
    assert book_seat.description == "Book seats."
    assert book_seat.parameters["required"] == ["flight"]
    assert set(book_seat.parameters["properties"]) == {"flight", "seats"}
    assert book_seat.side_effects and not book_seat.idempotent and book_seat.keyed


def test_tool_usable_bare_and_with_keywords() -> None:
    @tool(side_effects=False, name="search")
    def find(q: str) -> str:
        return q

    assert isinstance(find, Tool)
    assert find.name == "search" and not find.side_effects


async def test_sync_and_async_tools_run_and_ctx_is_passed() -> None:
    seen: list[Any] = []

    @tool
    def sync_tool(x: int, ctx: ToolContext) -> int:
        seen.append(ctx.idempotency_key)
        return x + 1

    @tool
    async def async_tool(x: int) -> int:
        return x * 2

    call = ToolCall(id="c1", name="sync_tool", arguments={"x": 1})
    assert await sync_tool.invoke({"x": 1}, _ctx(call)) == 2
    assert await async_tool.invoke({"x": 4}, _ctx(call)) == 8
    assert seen == ["k"]


async def test_invalid_arguments_are_a_tool_error_not_a_crash() -> None:
    @tool
    def f(x: int) -> int:
        return x

    call = ToolCall(id="c1", name="f", arguments={"x": "nope"})
    with pytest.raises(ValueError, match="invalid arguments for f"):
        await f.invoke({"x": "nope"}, _ctx(call))
    with pytest.raises(ValueError):
        await f.invoke({"x": 1, "extra": 2}, _ctx(call))


def test_default_key_ignores_the_provider_call_id_and_argument_order() -> None:
    @tool
    def book_seat(flight: str, seat: str) -> str:
        return flight

    a = book_seat.key_for(
        tenant="acme",
        run_id="r",
        iteration=1,
        call=ToolCall(id="call_A", name="book_seat", arguments={"flight": "LH1", "seat": "2A"}),
    )
    b = book_seat.key_for(
        tenant="acme",
        run_id="r",
        iteration=1,
        call=ToolCall(id="toolu_B", name="book_seat", arguments={"seat": "2A", "flight": "LH1"}),
    )
    assert a == b and a is not None and a.startswith("k1:")


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "other"},
        {"run_id": "r2"},
        {"iteration": 2},
        {"tool": "cancel_seat"},
        {"arguments": {"flight": "LH2"}},
    ],
)
def test_default_key_changes_with_each_of_its_inputs(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "tenant": "acme",
        "run_id": "r",
        "iteration": 1,
        "tool": "book_seat",
        "arguments": {"flight": "LH1"},
    }
    assert default_key(**base) != default_key(**{**base, **change})


def test_key_none_opts_out_and_custom_keys_are_used() -> None:
    @tool(key=None)
    def email(to: str) -> str:
        return to

    @tool(key=lambda **k: f"refund:{k['arguments']['order']}")
    def refund(order: str) -> str:
        return order

    call = ToolCall(id="c", name="email", arguments={"to": "x"})
    assert email.key_for(tenant="t", run_id="r", iteration=0, call=call) is None
    assert not email.keyed
    call = ToolCall(id="c", name="refund", arguments={"order": "o-9"})
    # A custom key is kept per tenant: the tenant goes in front, percent-encoded.
    assert refund.key_for(tenant="t", run_id="r", iteration=0, call=call) == "t/refund:o-9"
    assert refund.key_for(tenant="a/b", run_id="r", iteration=0, call=call) == "a%2Fb/refund:o-9"


def test_var_args_are_refused() -> None:
    def f(*args: Any) -> None:
        return None

    with pytest.raises(ConfigurationError):
        Tool(f)


@pytest.mark.parametrize(
    "annotation",
    [
        ToolContext,
        ToolContext | None,
        Any,
        object,
        "ToolContext",
        Annotated[ToolContext, "x"],
        Optional["ToolContext"],
    ],
    ids=["ToolContext", "optional", "Any", "object", "text", "annotated", "optional-text"],
)
def test_ctx_may_be_annotated_as_what_it_is_handed(annotation: Any) -> None:
    def fn(query: str, ctx=None) -> str:  # type: ignore[no-untyped-def]
        """Search."""
        return query

    fn.__annotations__["ctx"] = annotation
    made = tool(fn)
    assert list(made.parameters["properties"]) == ["query"]


@pytest.mark.parametrize("annotation", [str, int, dict[str, Any], "str | None"])
def test_a_ctx_annotated_as_another_type_is_refused_when_the_tool_is_made(
    annotation: Any,
) -> None:
    def fn(query: str, ctx=None) -> str:  # type: ignore[no-untyped-def]
        """Search."""
        return query

    fn.__annotations__["ctx"] = annotation
    with pytest.raises(ConfigurationError, match="`ctx`"):
        tool(fn)


def test_a_tool_named_with_a_secret_or_with_nothing_is_refused_when_made() -> None:
    token = "ghp_" + "Zq9" * 12

    def fn(query: str) -> str:
        """Search."""
        return query

    with pytest.raises(ConfigurationError, match="reads as holding a secret") as refused:
        Tool(fn, name=f"lookup_{token}")
    assert token not in str(refused.value)  # the refusal does not repeat it either
    with pytest.raises(ConfigurationError, match="no name of its own"):
        Tool(fn, name="")
    assert Tool(fn).name == "fn"
