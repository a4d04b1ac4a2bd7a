"""The text a tool's (or a reconciler's) exception is recorded as: its ``str``, unless that
would show a pydantic model's ``repr`` (``ModelSight``), or cannot be read."""

from __future__ import annotations

from pydantic_core import ValidationError

from tesserix_adk.run.model_sight import MOST_LOOKED_AT_IN_AN_ERROR, ModelSight

__all__ = ["MOST_READ_NEAR", "error_text"]

MOST_READ_NEAR = 500_000
"""How many values of an exception are read level by level for a model near it, before it
is looked through (``ModelSight.near``): a few hundredths of a second on the event loop."""


_ERRORS_SAID = 20
_MOST_ERRORS_SAID = 1_000


def error_text(exc: BaseException) -> str:
    """``Type: message`` of a tool's (or a reconciler's) exception, whatever its ``__str__``
    does: the outcome of a call that ended by raising is known, and is recorded, even
    when its exception cannot say what it is."""
    try:
        said = _said(exc)
    except Exception:
        # Not its ``repr`` either: it shows its arguments, a model among them perhaps.
        said = "(its text cannot be read)"
    return f"{type(exc).__name__}: {said}"


def _said(exc: BaseException) -> str:
    # Written on the event loop (a tool raised): looked through for fewer objects.
    sight = ModelSight(most=MOST_LOOKED_AT_IN_AN_ERROR)
    near = sight.near(exc, MOST_READ_NEAR)
    if not near and (not sight.shows(exc) or sight.past_the_budget(exc)):
        # Past both budgets its own text is written: a model neither 500,000 values read
        # nearest first nor a look through 100,000 reach is a risk taken so that the
        # message is never lost.
        return str(exc)
    if isinstance(exc, ValidationError):
        # Its text quotes what it was given: where and why each value was refused instead
        # (the first ones: its errors are built whole when asked for).
        count = exc.error_count()
        where = (
            "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(the value)'}: {e['type']}"
                for e in exc.errors(include_url=False)[:_ERRORS_SAID]
            )
            if count <= _MOST_ERRORS_SAID
            else "too many to list"
        )
        return (
            f"{count} validation error(s) for {exc.title} ({where}); what it was given is "
            "not written: it may hold a pydantic model"
        )
    # One holding a model (``ValueError("page 2 refused", card)``) would show it: its
    # arguments are written instead, each that would show one as a note.
    said = (sight.note(a) if sight.shows(a) else str(a) for a in exc.args)
    return ", ".join(said) or sight.note(exc)
