"""The one rule for run ids and tenants: non-empty, UTF-8 without NUL, at most
``MAX_ID_BYTES``; the runner and the CLI both ask it, so an id the CLI accepts is one the
runner keeps, on every store."""

from __future__ import annotations

from tesserix_adk.errors import ConfigurationError

__all__ = ["MAX_ID_BYTES", "check_ids", "check_worker", "id_problem"]

MAX_ID_BYTES = 512


def check_ids(*, tenant: str, run_id: str) -> None:
    """Refuse, before anything is read or written, an id no store can keep as given:
    empty, not encodable as UTF-8 (a lone surrogate), holding NUL, or longer than
    ``MAX_ID_BYTES``."""
    for what, value in (("tenant", tenant), ("run id", run_id)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"the {what} is empty; give every run a non-empty {what}")
        problem = id_problem(value)
        if problem is not None:
            raise ConfigurationError(f"the {what} {problem}")


def check_worker(worker: str) -> None:
    """Refuse a worker name no store can keep in a lease or a claim (every holder id starts
    with it), by the rule for ids."""
    if not isinstance(worker, str) or not worker:
        raise ConfigurationError("the worker name is empty; name every worker")
    problem = id_problem(worker)
    if problem is not None:
        raise ConfigurationError(f"the worker name {problem}")


def id_problem(value: str) -> str | None:
    """Why not every store can keep ``value`` as an id (not UTF-8, NUL, over
    ``MAX_ID_BYTES``), as the end of a sentence; ``None`` when each can."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate at position {exc.start} and cannot be stored as UTF-8"
    if "\x00" in value:
        return (
            f"holds a NUL character at position {value.index(chr(0))}, which PostgreSQL's "
            "text cannot keep"
        )
    if size > MAX_ID_BYTES:
        return f"is {size} bytes long; ids longer than {MAX_ID_BYTES} bytes are refused"
    return None
