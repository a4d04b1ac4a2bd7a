"""What JSON cannot hold, as text (``run.model_sight``): an object whose own text would
show a pydantic model's ``repr`` is written as a note, wherever the model sits, and an
object that shows none keeps its text."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from tesserix_adk.run import model_sight
from tesserix_adk.run.model_sight import ModelSight
from tesserix_adk.run.result_data import error_text, result_content

SECRET = "SIGNKEYqzv81x"


class _Card(pydantic.BaseModel):
    memo: str

    @pydantic.field_serializer("memo")
    def _mask(self, memo: str) -> str:
        return "***"


class _Plain:
    """Prints its attributes, as many hand-written classes do."""

    def __init__(self, held: Any) -> None:
        self.held = held

    def __repr__(self) -> str:
        return f"_Plain({self.held!r})"


class _Slotted:
    __slots__ = ("held",)

    def __init__(self, held: Any) -> None:
        self.held = held

    def __repr__(self) -> str:
        return f"_Slotted({self.held!r})"


def _card() -> _Card:
    return _Card(memo=SECRET)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _Plain(_card()), id="attribute"),
        pytest.param(lambda: _Slotted(_card()), id="slot"),
        pytest.param(lambda: _Plain({"deep": [(_card(),)]}), id="in-containers"),
        pytest.param(lambda: _Plain(ValueError("no", _card())), id="exception-argument"),
        pytest.param(lambda: _Plain(_card().model_dump), id="bound-method"),
        pytest.param(lambda: _Plain(_Plain(_Slotted(_card()))), id="nested-objects"),
    ],
)
def test_an_object_holding_a_model_is_a_note_never_its_text(make: Any) -> None:
    held = make()
    assert SECRET in repr(held)  # what writing it as its text would show
    for result in (held, ["page-1", held], _looped(held)):
        written = json.dumps(result_content(result))
        assert SECRET not in written
        assert "holding a pydantic model" in written


def _looped(value: Any) -> list[Any]:
    loop: list[Any] = ["page-1", value]
    loop.append(loop)  # a cycle: written by ``last_text``
    return loop


def test_an_object_holding_no_model_keeps_its_text() -> None:
    written = result_content(["page-1", _Plain({"n": [1, 2]}), _Slotted("x")])
    assert written == ["page-1", "_Plain({'n': [1, 2]})", "_Slotted('x')"]


def test_objects_sharing_one_structure_are_looked_through_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thousand objects holding one list of 5,000 values: looked through once, not a
    thousand times, or the budget of 20,000 looks would take the later ones as notes."""
    monkeypatch.setattr(model_sight, "MOST_LOOKED_AT", 20_000)
    shared = list(range(5_000))
    held = [_Slotted(shared) for _ in range(1_000)]
    sight = ModelSight()
    assert not any(sight.shows(h) for h in held)


def test_past_the_budget_an_object_is_taken_to_show_a_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_sight, "MOST_LOOKED_AT", 100)
    # Each object and each value it holds is one look: 30 holders of a number are 62.
    assert not ModelSight().shows(_Plain([_Slotted(n) for n in range(30)]))
    assert ModelSight().shows(_Plain([_Slotted(n) for n in range(500)]))
    assert ModelSight().shows(_Plain(list(range(500))))


def test_an_object_that_cannot_be_looked_into_is_taken_to_show_a_model() -> None:
    class _Raising:
        __slots__ = ()

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("working outside of application context")

    assert ModelSight().shows(_Raising())


def test_a_part_in_a_cycle_with_a_model_is_never_taken_as_clear() -> None:
    """``y`` leads back to ``x``, which holds a model met only after ``y`` was looked
    through: ``y`` shows it too, however it is met later."""
    x = _Plain(None)
    y = _Plain(x)
    x.held = [y, _card()]
    sight = ModelSight()
    assert sight.shows(x)
    assert sight.shows(y)
    assert sight.shows(_Plain(y))
    assert SECRET not in json.dumps(result_content([x, y, _Plain(y)]))


def test_a_tool_error_keeps_its_message_and_never_shows_a_model() -> None:
    error = ValueError("page 2 refused", _card())
    assert SECRET in str(error)  # what writing its text would show
    said = error_text(error)
    assert said.startswith("ValueError: page 2 refused, <a _Card") and SECRET not in said
