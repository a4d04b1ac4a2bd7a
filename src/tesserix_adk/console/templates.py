"""Rendering the console's HTML templates (package files, ``string.Template`` syntax).

Every value is HTML-escaped unless it is ``Markup`` (HTML this package rendered itself), so
an id, a note or a tool argument can never add markup to a page; and every character that
is not printable but a line break or a tab (bidirectional controls, zero-width and format
characters, control codes) is written as an escape (``\\u202e``), as the CLI writes it, so
no name reads backwards and no two ids that differ look alike.
"""

from __future__ import annotations

import html
import string
from functools import lru_cache
from importlib.resources import files

from tesserix_adk.cli.text import escaped

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


def _text(value: object) -> str:
    return "" if value is None else escaped(str(value), keep="\n\t")
