"""Errors to exit codes: what an operator can do about each, in one sentence.

    0 carried on (or printed what was asked)      3 not now: held elsewhere / store down
    1 nothing checkpointed under that id          4 must not be carried on
    2 a command line it could not read

The kit's error types decide most codes. A few store troubles arrive as a generic kit error
whose cause is a driver's, and would read as "retry later" or as a driver internal; they are
told apart here, by that cause, so the code says what helps: a damaged database file is 4
(retrying never helps), a PostgreSQL database that does not exist is 1 (create it, then
apply the schema), a Redis database index the server lacks or an option no one knows is 2.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import TextIO

from tesserix_adk.checkpoint.redaction import Redactor, default_redactor
from tesserix_adk.cli.text import sentence
from tesserix_adk.errors import (
    AdkError,
    CarriedByWorkflowError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointTooLargeError,
    ConfigurationError,
    DivergedRunError,
    HistoryUnavailableError,
    IndeterminateToolCallError,
    LeaseError,
    NoCheckpointError,
    ReplayNotResumableError,
    ResumeConflictError,
    RevisionMismatchError,
    RunFailedError,
    StaleFenceError,
    StateRedactedError,
    StoreUnavailableError,
)

__all__ = [
    "OUTPUT_CLOSED",
    "ExitCode",
    "Refused",
    "UsageError",
    "exit_code_for",
    "explain",
    "told_by",
    "output_closed",
    "say",
]


class ExitCode(IntEnum):
    """What a script reads from a command."""

    CARRIED_ON = 0
    NOTHING_CHECKPOINTED = 1
    USAGE = 2
    HELD = 3
    MUST_NOT_CARRY_ON = 4


class UsageError(Exception):
    """A command line that could not be read (exit 2)."""


class Refused(Exception):
    """A decision that conflicts with one already made (exit 4)."""


_HELD = (ResumeConflictError, LeaseError, StoreUnavailableError, StaleFenceError)
_MUST_NOT = (
    IndeterminateToolCallError,
    DivergedRunError,
    HistoryUnavailableError,
    CheckpointFormatError,
    CheckpointCorruptError,
    CheckpointTooLargeError,
    RevisionMismatchError,
    RunFailedError,
    ReplayNotResumableError,
    CarriedByWorkflowError,
    StateRedactedError,
)


# What a command whose reader went away exits with (``yes | head`` does the same): 128 +
# SIGPIPE, as if the signal had ended it, and nothing said, since nobody reads on.
OUTPUT_CLOSED = 128 + signal.SIGPIPE


def output_closed(out: TextIO) -> int:
    """Stop writing to ``out``, whose reader went away, without a second error at exit
    (the interpreter flushes standard output as it ends); ``OUTPUT_CLOSED``."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    return int(OUTPUT_CLOSED)


def say(stream: TextIO, line: str) -> None:
    """Write ``line`` to ``stream`` (stderr, mostly); if its reader went away, write no more
    there: the exit code still says what happened."""
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        output_closed(stream)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented exit code of an error."""
    return explain(exc)[0]


def explain(exc: BaseException, *, told: Iterable[str] = ()) -> tuple[ExitCode, str]:
    """The exit code of ``exc`` and the one line of stderr that says it, redacted: an
    error's text may repeat what it was given (a provider's echoing its API key).

    ``told`` are what the operator gave the command (a run id, a tenant, a store's path):
    one the redactor would take for a secret on its own (a run id may look like an AWS key)
    is shown as given, since a sentence naming a run or a command to type is no use with it
    masked; a secret it sits in or beside is still masked whole."""
    redact = _redacting(default_redactor(), told)
    code, said = _explained(exc, redact)
    return code, redact(said)


def told_by(args: object) -> tuple[str, ...]:
    """What a parsed command line names that ``explain`` shows as given: its run ids
    (``run``, ``run --resume``, ``--new-run-id``), its tenant, the approval request or call
    it names and, for a SQLite store, the store's file and URL without their query (the URL
    of any other store, and any query, may hold a password)."""
    told = [
        value
        for name in ("run", "resume", "tenant", "new_run_id", "request", "call")
        if isinstance(value := getattr(args, name, None), str)
    ]
    store = getattr(args, "store", None)
    if isinstance(store, str) and store.startswith("sqlite:///"):
        path = store.removeprefix("sqlite:///").partition("?")[0]
        told += ["sqlite:///" + path, path, os.path.abspath(path)]
    return tuple(told)


def _redacting(redactor: Redactor, told: Iterable[str]) -> Callable[[str], str]:
    # Only a word the redactor would mask on its own needs keeping; any other is left to
    # the redactor in its place, where it may be the context that shows a secret beside it
    # (the user of ``postgresql://acme-prod:<password>@db``).
    kept = sorted(
        {t for t in told if isinstance(t, str) and redactor.text(t) != t},
        key=len,
        reverse=True,
    )
    if not kept:
        return redactor.text
    between = re.compile("|".join(map(re.escape, kept)))

    def redact(text: str) -> str:
        # Each kept word is a plain token while the whole text is redacted, then put back:
        # a secret the word sits in or beside is masked with its context intact (the token
        # inside it is masked with it, so nothing of the secret comes back).
        stand_ins: dict[str, str] = {}

        def stand_in(match: re.Match[str]) -> str:
            token = f"tesserixtold{len(stand_ins)}x"
            stand_ins[token] = match[0]
            return token

        masked = redactor.text(between.sub(stand_in, text))
        for token, word in stand_ins.items():
            masked = masked.replace(token, word)
        return masked

    return redact


def _explained(exc: BaseException, redact: Callable[[str], str]) -> tuple[ExitCode, str]:
    trouble = _store_trouble(exc)
    if trouble is not None:
        return trouble
    # Redacted before its lines are joined, as the redactor finds a key wrapped across them.
    text = sentence(redact(str(exc))) or type(exc).__name__
    if isinstance(exc, (AdkError, UsageError, Refused)):
        return _code_of(exc), "tesserix: " + text
    return _code_of(exc), f"tesserix: {type(exc).__name__}: {text}"


def _code_of(exc: BaseException) -> ExitCode:
    if isinstance(exc, (UsageError, ImportError)):
        # An ImportError is an extra not installed (its message says which): fix the set-up.
        return ExitCode.USAGE
    if isinstance(exc, NoCheckpointError):
        return ExitCode.NOTHING_CHECKPOINTED
    if isinstance(exc, ResumeConflictError) and not exc.retryable:
        # A conflict no retry resolves: another input or agent under an id submitted before.
        return ExitCode.MUST_NOT_CARRY_ON
    if isinstance(exc, _HELD):
        return ExitCode.HELD
    if isinstance(exc, (*_MUST_NOT, Refused)):
        return ExitCode.MUST_NOT_CARRY_ON
    if isinstance(exc, ConfigurationError):
        # A store file or schema that does not exist: nothing can be checkpointed there.
        if "schema apply" in str(exc):
            return ExitCode.NOTHING_CHECKPOINTED
        return ExitCode.USAGE
    if isinstance(exc, AdkError) and exc.retryable:
        return ExitCode.HELD
    return ExitCode.MUST_NOT_CARRY_ON


# --- store troubles told apart by their driver's cause -------------------------------------

_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
_UNKNOWN_KEYWORD = re.compile(r"unexpected keyword argument '([^']*)'")
_UNKNOWN_URI_PARAMETER = re.compile(r'invalid URI query parameter: "([^"]*)"')
_NO_DATABASE = re.compile(r'database "([^"]*)" does not exist')
# What a PostgreSQL server says when it answered and refused what the URL asks of it: a
# setting, TLS, a user, a password. No retry changes it.
_REFUSED_SETTING = re.compile(
    r"(unrecognized configuration parameter \S+|invalid value for parameter \S+"
    r"|server does not support SSL, but SSL was required"
    r"|password authentication failed for user \S+|role \S+ does not exist"
    r"|no pg_hba\.conf entry for [^,\n]*)"
)


def _store_trouble(exc: BaseException) -> tuple[ExitCode, str] | None:
    if not isinstance(exc, AdkError):
        return None
    for cause in _causes(exc):
        code = getattr(cause, "sqlite_errorcode", None)
        damaged = isinstance(code, int) and code & 0xFF in _DAMAGED
        if isinstance(cause, sqlite3.DatabaseError) and damaged:
            said = sentence(str(exc))
            if "restore it from a backup" in said:  # the store said it already
                return ExitCode.MUST_NOT_CARRY_ON, f"tesserix: {said}"
            return ExitCode.MUST_NOT_CARRY_ON, (
                f"tesserix: {said}; the database file is damaged and "
                "retrying will not help: restore it from a backup"
            )
        module = type(cause).__module__
        text = str(cause)
        if module.startswith("redis") and "DB index is out of range" in text:
            return ExitCode.USAGE, (
                "tesserix: the Redis server has no database with the number the store URL "
                "names (its path, as in redis://host:6379/0); use one from 0 up to the "
                "server's `databases` setting minus one (16 databases by default)"
            )
        unknown = _UNKNOWN_KEYWORD.search(text) if isinstance(cause, TypeError) else None
        if unknown is None and module.startswith("psycopg"):
            unknown = _UNKNOWN_URI_PARAMETER.search(text)
        if unknown is not None:
            return ExitCode.USAGE, (
                f"tesserix: the store URL has an unknown option {sentence(unknown[1])!r}: "
                "neither tesserix nor the database driver takes it; check its spelling"
            )
        refused = _REFUSED_SETTING.search(text) if module.startswith("psycopg") else None
        if refused is not None:
            return ExitCode.USAGE, (
                f"tesserix: the PostgreSQL server refused what the store URL asks of it "
                f"({sentence(refused[1])}); fix the URL (its options, sslmode, user or "
                "password): retrying will not help"
            )
        missing = _NO_DATABASE.search(text) if module.startswith("psycopg") else None
        if missing is not None:
            name = sentence(missing[1])
            return ExitCode.NOTHING_CHECKPOINTED, (
                f"tesserix: PostgreSQL has no database {name!r}, so nothing is checkpointed "
                f"there; create it (e.g. `createdb {name}`), then run "
                "`tesserix schema apply --store URL`"
            )
    return None


def _causes(exc: BaseException) -> list[BaseException]:
    """The errors ``exc`` was raised from, nearest first (at most a few, never a cycle)."""
    seen: list[BaseException] = []
    current = exc.__cause__ or exc.__context__
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen
