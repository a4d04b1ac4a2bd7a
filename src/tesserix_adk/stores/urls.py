"""``open_stores(url)``: the whole set of stores of one backend, named by a URL.

``memory://``, ``sqlite:///relative/path``, ``sqlite:////absolute/path`` (as in SQLAlchemy),
``redis://`` / ``rediss://`` (a Redis Cluster: ``redis+cluster://host:port,host:port/`` /
``rediss+cluster://``) and ``postgresql://`` / ``postgres://``. Opening does no I/O:
a backend touches its file or server on first use, and only ``create_schema()`` creates
anything. Drivers are imported only for the scheme that needs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.bundle import Stores

__all__ = ["checked_server_url", "open_stores", "redact_url"]

_SCHEMES = (
    "memory://, sqlite:///path, redis://, rediss://, redis+cluster://, rediss+cluster://, "
    "postgresql:// or postgres://"
)


def open_stores(url: str) -> Stores:
    """Build the six stores named by ``url`` as a ``Stores`` bundle; no I/O.

    Options come from the query: ``keep_last=N`` (memory, SQLite) and
    ``synchronous=full|normal`` (SQLite); Redis and PostgreSQL read theirs in their openers
    (``prefix``, ``allow_volatile``; ``pool_min``, ``pool_max``, ``timeout``). A relative
    SQLite path is relative to the current directory at the time of this call. Anything
    else is a ``ConfigurationError``.
    """
    try:
        parts = urlsplit(url.strip())
    except ValueError as exc:
        raise ConfigurationError(f"cannot read the store URL {redact_url(url)!r}: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme == "memory":
        return _open_memory(url, parts.netloc, parts.path, parts.query)
    if scheme == "sqlite":
        return _open_sqlite(url, parts.netloc, parts.path, parts.query)
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        checked_server_url(url.strip(), scheme)
        return _open_adapter("redis", "open_redis_stores", url)
    if scheme in ("postgresql", "postgres"):
        checked_server_url(url.strip(), scheme)
        return _open_adapter("postgres", "open_postgres_stores", url)
    shown = redact_url(url)
    if not scheme:
        raise ConfigurationError(f"the store URL {shown!r} has no scheme; use {_SCHEMES}")
    raise ConfigurationError(
        f"the store URL {shown!r} has an unknown scheme {scheme!r}; use {_SCHEMES}"
    )


def redact_url(url: str) -> str:
    """``url`` with its password (and any ``password=`` query option) masked, for display.

    The password is what lies between the user's ``:`` and the *last* ``@`` (a password
    holding ``@``, ``/``, ``?`` or ``#`` unescaped too), also in a URL missing its ``//``
    or its scheme (``bob:pw@host``): more is masked than a driver would read, never less."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, after = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.split(':', 1)[0]}:***@{after}"
    shown = f"{scheme}{sep}{rest}"
    try:
        parts = urlsplit(shown)
    except ValueError:
        return shown
    query = parts.query
    if not query:
        return shown
    pairs = []
    for pair in query.split("&"):
        name, eq, _ = pair.partition("=")
        secret = unquote(name).lower() in ("password", "pass", "pwd")
        pairs.append(f"{name}=***" if eq and secret else pair)
    if pairs == query.split("&"):
        return shown
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "&".join(pairs), parts.fragment))


def checked_server_url(url: str, scheme: str) -> None:
    """Refuse a server's URL a driver would read otherwise than it is written: with no
    ``//`` after its scheme, or with ``/``, ``?`` or ``#`` unescaped in its user or password
    (read as the end of the host: the password's tail taken for a path or a port, and
    quoted in the driver's error)."""
    shown = redact_url(url)
    head, sep, rest = url.partition("://")
    if not sep or head.lower() != scheme:
        raise ConfigurationError(
            f"the store URL {shown!r} needs '//' after '{scheme}:' ({scheme}://host/...)"
        )
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    if "@" not in rest[:cut] and "@" in rest[cut:]:
        raise ConfigurationError(
            f"the store URL {shown!r} holds '/', '?' or '#' in its user or password (or '@' "
            "in what follows the host); percent-encode it: %2F, %3F, %23, %40"
        )


# --- backends ----------------------------------------------------------------------------


# Every option the kit itself reads from a store URL, by backend. An adapter hands the rest
# of the query to its driver, but never another backend's option: that is a mistake in the
# URL, not a driver setting.
KIT_OPTIONS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "memory": ("keep_last",),
        "SQLite": ("keep_last", "synchronous"),
        "Redis": ("prefix", "allow_volatile", "keep_last"),
        "PostgreSQL": (
            "keep_last",
            "pool_min",
            "pool_max",
            "timeout",
            "schema",
            "prepare_threshold",
        ),
    }
)


def store_options(
    url: str, query: str, backend: str, *, driver: bool
) -> tuple[dict[str, str], str]:
    """The kit's options of ``backend`` (a key of ``KIT_OPTIONS``) out of ``query``, decoded,
    and the rest of the query for its driver, segment for segment as written.

    Without a ``driver`` every other option is unknown (and the query is read strictly);
    with one, only another backend's option is refused. An option set twice is refused.
    """
    shown = redact_url(url)
    own = KIT_OPTIONS[backend]
    others = {name for names in KIT_OPTIONS.values() for name in names} - set(own)
    options: dict[str, str] = {}
    rest: list[str] = []
    for segment in query.split("&") if query else ():
        try:
            name, value = _pair(segment, strict=not driver)
        except ValueError as exc:
            raise ConfigurationError(f"cannot read the options of {shown!r}: {exc}") from exc
        if name in own:
            if name in options:
                raise ConfigurationError(f"the store URL {shown!r} sets {name!r} twice")
            options[name] = value
        elif not driver:
            known = ", ".join(own) if own else "none"
            raise ConfigurationError(
                f"the store URL {shown!r} has an unknown option {name!r} (known: {known})"
            )
        elif name in others:
            raise ConfigurationError(
                f"{name!r} is not an option of {backend} stores (theirs: {', '.join(own)})"
            )
        else:
            rest.append(segment)
    return options, "&".join(rest)


def _pair(segment: str, *, strict: bool) -> tuple[str, str]:
    # One segment as parse_qsl reads it; an empty one is a field without a name.
    if not segment:
        if strict:
            raise ValueError("bad query field: ''")
        return "", ""
    [(name, value)] = parse_qsl(segment, keep_blank_values=True, strict_parsing=strict)
    return name, value


def keep_last_option(url: str, options: Mapping[str, str]) -> int | None:
    """The ``keep_last`` option as a whole number of at least 1, ``None`` when absent."""
    raw = options.get("keep_last")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(
            f"keep_last in {redact_url(url)!r} must be a whole number of at least 1, got {raw!r}"
        )
    return value


def _open_adapter(module: str, opener_name: str, url: str) -> Stores:
    # Imported here, and only for its scheme: the adapter imports its driver, which a user
    # of another backend need not have installed.
    adapter = importlib.import_module(f"tesserix_adk.adapters.{module}")
    opener: Callable[[str], Stores] = getattr(adapter, opener_name)
    return opener(url)


def _open_memory(url: str, netloc: str, path: str, query: str) -> Stores:
    from tesserix_adk.stores.memory import (
        MemoryApprovalStore,
        MemoryCheckpointStore,
        MemoryHistoryStore,
        MemoryIdempotencyStore,
        MemoryLeaseStore,
        MemoryLedger,
        MemoryWorkIndex,
    )

    if netloc or path:
        raise ConfigurationError(
            f"a memory store URL takes no host or path: use 'memory://', not {redact_url(url)!r}"
        )
    options, _ = store_options(url, query, "memory", driver=False)
    leases = MemoryLeaseStore()
    return Stores(
        checkpoints=MemoryCheckpointStore(keep_last=keep_last_option(url, options)),
        idempotency=MemoryIdempotencyStore(),
        leases=leases,
        history=MemoryHistoryStore(),
        ledger=MemoryLedger(),
        approvals=MemoryApprovalStore(),
        # On the same lease store, so a lease the runner holds keeps the run out of ``due``.
        work=MemoryWorkIndex(leases),
        url=url,
    )


def _open_sqlite(url: str, netloc: str, path: str, query: str) -> Stores:
    from tesserix_adk.stores.sqlite import open_sqlite_stores

    # Every sentence names the URL with its password masked: one typed with a host has a
    # user and password in it as often as not.
    shown = redact_url(url)
    if netloc:
        raise ConfigurationError(
            f"a SQLite store URL has no host ({shown!r} names one); use "
            f"sqlite:///relative/path or sqlite:////absolute/path"
        )
    if not url.strip().partition(":")[2].startswith("//"):
        # sqlite:/srv/adk.sqlite3 (a slash short of sqlite:////srv/...) would be read as
        # the relative srv/adk.sqlite3: processes started in other directories would each
        # open a store of their own.
        raise ConfigurationError(
            f"the SQLite store URL {shown!r} lacks the // after 'sqlite:'; use "
            f"sqlite:///relative/path or sqlite:////absolute/path"
        )
    # SQLAlchemy style: the first slash ends the (empty) authority; what follows is the
    # path, so sqlite:///a is relative and sqlite:////a absolute.
    file = unquote(path[1:] if path.startswith("/") else path)
    if not file:
        raise ConfigurationError(
            f"the SQLite store URL {shown!r} names no file; use sqlite:///relative/path or "
            f"sqlite:////absolute/path"
        )
    options, _ = store_options(url, query, "SQLite", driver=False)
    synchronous = options.get("synchronous", "full").lower()
    if synchronous not in ("full", "normal"):
        raise ConfigurationError(
            f"synchronous in {shown!r} must be 'full' or 'normal', got {options['synchronous']!r}"
        )
    return open_sqlite_stores(
        file, keep_last=keep_last_option(url, options), synchronous=synchronous, url=url
    )
