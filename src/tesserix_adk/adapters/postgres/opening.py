"""``open_postgres_stores(url)``: the six PostgreSQL stores and the work index on one pool,
named by a URL.

The kit's own options (``keep_last``, ``pool_min``, ``pool_max``, ``timeout``, ``schema``,
``prepare_threshold``) are taken out of the URL's query by ``stores.urls.store_options``
(another backend's option is refused); everything else is handed to psycopg byte for byte.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import psycopg
from psycopg.conninfo import conninfo_to_dict

from tesserix_adk.adapters.postgres.approvals import PostgresApprovalStore
from tesserix_adk.adapters.postgres.checkpoints import PostgresCheckpointStore
from tesserix_adk.adapters.postgres.connection import (
    DEFAULT_TIMEOUT,
    PREPARE_THRESHOLD,
    PostgresDatabase,
)
from tesserix_adk.adapters.postgres.history import PostgresHistoryStore
from tesserix_adk.adapters.postgres.idempotency import PostgresIdempotencyStore
from tesserix_adk.adapters.postgres.leases import PostgresLeaseStore
from tesserix_adk.adapters.postgres.ledger import PostgresLedger
from tesserix_adk.adapters.postgres.work import PostgresWorkIndex
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import keep_last_option, redact_url, store_options

__all__ = ["open_postgres_stores"]


# A day: any deadline past it is a mistake (the server's timeouts are set in milliseconds
# below it, and must fit its 32-bit settings).
_MOST_SECONDS = 86_400.0


def _positive_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= _MOST_SECONDS):
        raise ConfigurationError(
            f"{name} in the PostgreSQL store URL must be a positive number of seconds up to "
            f"{_MOST_SECONDS:,.0f}, got {raw!r}"
        )
    return value


def _whole(name: str, raw: str, *, least: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ConfigurationError(
            f"{name} in the PostgreSQL store URL must be a whole number of at least {least}, "
            f"got {raw!r}"
        )
    return value


def _prepare_threshold(raw: str | None) -> int | None:
    if raw is None:
        return PREPARE_THRESHOLD
    if raw.strip().lower() == "none":
        return None
    return _whole("prepare_threshold", raw, least=0)


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """The URL for psycopg and the kit's own options, taken out of its query.

    Everything but the kit's options is handed on byte for byte: no re-encoding (libpq reads
    ``+`` literally) and no rebuilding (``postgresql:///db?host=/socket`` has no host part).
    """
    base, _, rest = url.partition("?")
    authority = base.partition("://")[2].partition("/")[0]
    if authority.count("@") > 1:
        # libpq ends the user and password at the first '@', so the rest of the password
        # would be taken for the host, and quoted as one in its error.
        raise ConfigurationError(
            f"the PostgreSQL store URL {redact_url(url)!r} holds an '@' in its user or "
            "password; write it as %40"
        )
    query, hash_, fragment = rest.partition("#")
    options, kept = store_options(url, query, "PostgreSQL", driver=True)
    out = base + ("?" + kept if kept else "") + (hash_ + fragment if fragment else "")
    try:
        # Parses only: a typo'd option is a usage mistake, not an outage.
        params = conninfo_to_dict(out)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"the PostgreSQL store URL is not usable: "
            f"{_libpq_said(str(exc), kept, authority.rpartition('@')[0])}"
        ) from None
    _check_params(params)
    return out, options


def _libpq_said(error: str, query: str, userinfo: str) -> str:
    """What libpq could not read in a URL, without what it quotes: the URL whole, or a
    piece of it alone (a password, in the URL or in ``?password=``, holding a '%' that is
    no escape). A query option's name, or a mark of punctuation, it quotes is said: neither
    is a secret; nothing quoted is said where the user, password or query holds a quote
    (what is quoted then cannot be told apart)."""
    said = error.strip().splitlines()[0] if error.strip() else "libpq could not read it"
    pieces = said.split('"')
    out = pieces[0]
    names = {part.partition("=")[0] for part in query.split("&")} - {"password"}
    if '"' in userinfo or '"' in query:
        return out.rstrip(": ")
    for inside, after in zip(pieces[1:-1:2], pieces[2::2], strict=False):
        if not (inside in names or (len(inside) == 1 and not inside.isalnum())):
            break
        out += f'"{inside}"{after}'
    return out.rstrip(": ")


def _whole_number(text: str) -> bool:
    try:
        int(text)  # what libpq reads: signs and spaces around it included
    except ValueError:
        return False
    return True


_SSLMODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})


def _check_params(params: Mapping[str, object]) -> None:
    """What libpq would refuse only on connecting (and the kit would report as an outage
    to retry): ports, ``sslmode`` and ``connect_timeout``, checked now."""
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigurationError(
                f"the PostgreSQL store URL names port {port!r}; a port is 1 to 65535"
            )
    sslmode = params.get("sslmode")
    if sslmode is not None and str(sslmode) not in _SSLMODES:
        raise ConfigurationError(
            f"sslmode in the PostgreSQL store URL must be one of {', '.join(sorted(_SSLMODES))}, "
            f"got {sslmode!r}"
        )
    timeout = params.get("connect_timeout")
    if timeout is not None and not _whole_number(str(timeout)):
        raise ConfigurationError(
            f"connect_timeout in the PostgreSQL store URL must be whole seconds, got {timeout!r}"
        )


def open_postgres_stores(url: str) -> Stores:
    """The six PostgreSQL stores and the work index on one pool, as a ``Stores`` bundle; no
    I/O until first use.

    Options in the query: ``keep_last``, ``pool_min`` (default 1), ``pool_max`` (default
    4), ``timeout`` (seconds, default 5: the client-side deadline of every call, kept
    below the lease ttl; the server's statement and lock timeouts are set below it),
    ``schema`` (the schema the kit's tables are in, qualified in every statement: no
    startup parameter, so it works behind a pooler; default: the search_path's first) and
    ``prepare_threshold`` (``none``: never prepare a statement on the server, as behind a
    transaction pooler; or after how many runs as text on a direct connection, default 5:
    see ``prepared``); everything else
    goes to psycopg (e.g. ``options=-csearch_path%3Dmy_schema`` on a direct connection).
    ``create_schema()`` applies ``EXPECTED_CHECKPOINT_SCHEMA``; ``verify()`` checks it;
    ``aclose()`` closes the pool.
    """
    conninfo, options = _split_url(url)
    keep_last = keep_last_option(url, options)
    pool_min = _whole("pool_min", options.get("pool_min", "1"), least=0)
    pool_max = _whole("pool_max", options.get("pool_max", "4"), least=1)
    timeout = (
        _positive_seconds("timeout", options["timeout"])
        if "timeout" in options
        else DEFAULT_TIMEOUT
    )
    database = PostgresDatabase.from_url(
        conninfo,
        pool_min=pool_min,
        pool_max=pool_max,
        timeout=timeout,
        schema=options.get("schema"),
        prepare_threshold=_prepare_threshold(options.get("prepare_threshold")),
    )
    return Stores(
        checkpoints=PostgresCheckpointStore(database, keep_last=keep_last),
        idempotency=PostgresIdempotencyStore(database),
        leases=PostgresLeaseStore(database),
        history=PostgresHistoryStore(database),
        ledger=PostgresLedger(database),
        approvals=PostgresApprovalStore(database),
        work=PostgresWorkIndex(database),
        url=url,
        on_create_schema=database.create_schema,
        on_verify=database.verify,
        on_close=(database.aclose,),
        schema=database.schema.ddl,
    )
