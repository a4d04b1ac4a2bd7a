"""Redaction: the one place secrets are masked before any byte reaches a store.

A ``Redactor`` masks secrets in *user data*: message text, tool arguments, outcomes, state,
approval notes, log lines and error messages. The caller decides which parts of a payload
are user data (so ``usage.input_tokens`` is never looked at); the redactor only walks what it
is given. Two entry points, both linear in the size of their input:

- ``Redactor.text(s)`` for any string: free text, a log line, an exception message, a tool
  result (which may be JSON text);
- ``Redactor.value(v)`` for JSON-like data (dicts, lists, strings, numbers).

What is masked, one module per concept:

- ``patterns``: secrets a pattern finds inside any string (API keys, tokens, JWTs, private
  keys, passwords in URLs, wrapped across lines or not), each becoming
  ``[redacted:<kind>]``;
- ``keys``: the key names that mark a credential (``accessToken``, ``db.password``), whose
  values are masked whatever they look like;
- ``free_text``: ``key: value`` pairs with such a key in free text, and pydantic validation
  messages that echo a secret input;
- ``redactor``: the ``Redactor`` itself, walking data and JSON text and applying the rules
  above and any ``extra_patterns`` (matches become ``[redacted:custom]``).

Redaction is idempotent: the placeholders match no pattern, so redacting twice changes
nothing the first pass left. Bytes are never touched. Every built-in pattern is linear-time;
patterns given in ``extra_patterns`` run on Python's backtracking engine as written.
"""

from __future__ import annotations

from tesserix_adk.checkpoint.redaction.redactor import Masked, Redactor, default_redactor

__all__ = ["Masked", "Redactor", "default_redactor"]
