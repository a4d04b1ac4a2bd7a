"""The kit's own log lines never format a caught exception bare: a store's error can quote
its URL, password and all, so each goes through ``redaction.Masked``. Read from the
source (every ``except ... as name`` handler of ``src/``), so a log line added later
without it fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import tesserix_adk

ROOT = Path(tesserix_adk.__file__).parent
_LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def _bare_exceptions(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for handler in ast.walk(tree):
        if not isinstance(handler, ast.ExceptHandler) or handler.name is None:
            continue
        for node in ast.walk(handler):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _LEVELS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id.endswith("log")
            ):
                continue
            for arg in node.args[1:]:
                if isinstance(arg, ast.Name) and arg.id == handler.name:
                    found.append((node.lineno, arg.id))
    return found


def test_no_log_line_of_the_kit_formats_a_caught_exception_unmasked() -> None:
    bare = [
        f"{path.relative_to(ROOT)}:{line} ({name})"
        for path in sorted(ROOT.rglob("*.py"))
        for line, name in _bare_exceptions(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert bare == [], "wrap these in Masked(...): " + ", ".join(bare)


def test_the_check_finds_a_bare_exception() -> None:
    source = (
        "try:\n    pass\nexcept Exception as exc:\n"
        "    _log.warning('x %r', exc)\n    _log.warning('y %r', Masked(exc))\n"
    )
    assert _bare_exceptions(ast.parse(source)) == [(4, "exc")]
