"""Reading a backend's rows back into records: a damaged row is a typed error, never a
``ValueError``/``KeyError``/``TypeError`` from deep inside a decoder."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from tesserix_adk.errors import CheckpointCorruptError

__all__ = ["decoded"]

P = ParamSpec("P")
T = TypeVar("T")

_DAMAGE = (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError)


def decoded(what: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Wrap a row decoder so damage surfaces as ``CheckpointCorruptError`` naming ``what``."""

    def wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def read(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return fn(*args, **kwargs)
            except _DAMAGE as exc:
                raise CheckpointCorruptError(
                    f"a stored {what} cannot be read ({type(exc).__name__}: {exc}); the "
                    "store holds a damaged row"
                ) from exc

        return read

    return wrap
