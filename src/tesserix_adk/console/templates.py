"""Rendering the console's HTML templates (package files, ``string.Template`` syntax).

Every value is HTML-escaped unless it is ``Markup`` (HTML this package rendered itself), so
an id, a note or a tool argument can never add markup to a page; its bidirectional controls
are written as escapes (``\\u202e``), as the CLI writes them, so none can make a name or a
reason read backwards.
"""

from __future__ import annotations

import html
import re
import string
from functools import lru_cache
from importlib.resources import files

__all__ = ["Markup", "join", "render"]


class Markup(str):
    """HTML that is already safe: a rendered template, never text from a store."""


@lru_cache(maxsize=64)
def _template(name: str) -> string.Template:
    text = (files("tesserix_adk.console") / "templates" / name).read_text(encoding="utf-8")
    return string.Template(text)


def render(name: str, **values: object) -> Markup:
    """The template ``name`` with ``values`` put in (escaped unless ``Markup``)."""
    safe = {k: v if isinstance(v, Markup) else html.escape(_text(v)) for k, v in values.items()}
    return Markup(_template(name).substitute(safe))


def join(parts: list[Markup]) -> Markup:
    """Rendered fragments side by side."""
    return Markup("".join(parts))


# Marks and overrides that reorder what follows them (U+061C, U+200E/F, U+202A-E, U+2066-9).
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _text(value: object) -> str:
    text = "" if value is None else str(value)
    return _BIDI.sub(lambda m: repr(m.group())[1:-1], text)
