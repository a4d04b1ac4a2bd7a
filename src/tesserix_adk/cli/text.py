"""What the CLI prints of text it did not write: ids, names, notes and error messages.

Run ids, tenants, holders and operator names come from whoever started a run or typed a
command; printed raw, a newline or a terminal escape code in one of them could forge a line
of output or rewrite the operator's screen. Every such value goes through ``escaped``.
"""

from __future__ import annotations

__all__ = ["escaped", "sentence"]


def escaped(text: str, *, keep: str = "") -> str:
    """``text`` with every character that is not printable written as Python would escape
    it (``\\n``, ``\\x1b``, ``\\u202e``, a lone surrogate as ``\\ud800``), but those in
    ``keep`` (the console keeps line breaks and tabs of text it lays out); printable text,
    which is every ordinary id, comes back unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def sentence(text: str) -> str:
    """``text`` as one line: runs of whitespace (a driver's multi-line message) become one
    space, then whatever else is not printable is escaped."""
    return escaped(" ".join(text.split()))
