"""The Redis client the stores share: building it from a URL, and translating its errors.

Errors say whether the outcome is unknown: a failure before any command of the call left
the client (connection refused, connect timeout, a full pool) and a server's refusal of a
command as a whole (OOM, READONLY, LOADING, BUSY, ...) are ``StoreUnavailableError``; a
timeout or a dropped connection once a command was sent is ``StoreReplyLostError``. What
was sent is known because every connection of a client the stores use marks, for the kit
call in progress, the moment it writes a command (not its own handshake).

This is the one module of the package that imports the driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

try:
    import redis.asyncio as aioredis
    from redis.commands.core import AsyncScript
    from redis.exceptions import (
        AuthenticationError,
        BusyLoadingError,
        ClusterDownError,
        NoPermissionError,
        OutOfMemoryError,
        ReadOnlyError,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        'tesserix_adk.adapters.redis needs the redis package: pip install "tesserix-adk[redis]"'
    ) from exc

from tesserix_adk.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    StoreReplyLostError,
    StoreUnavailableError,
)

__all__ = ["AsyncScript", "Client", "ResponseError"]

Client = aioredis.Redis

# Server refusals that mean "not now" rather than "never"; each refuses a command whole.
# redis-py raises a class for most and strips the code from the message, so the classes
# are what is matched (BusyLoadingError is LOADING; ClusterDownError covers MASTERDOWN).
_TRANSIENT_ERRORS = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    TryAgainError,
    ClusterDownError,
)
# Codes redis-py leaves in the message, as the server sent it.
_TRANSIENT_REPLIES = ("BUSY", "OOM", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")
_PERMISSION_REPLIES = ("NOPERM", "NOAUTH", "WRONGPASS")


def _client_from_url(url: str) -> Client:
    """A client on ``url`` (redis-py's own options only); no I/O. ``ConfigurationError`` for
    a URL or an option the driver cannot use."""
    try:
        # Defaults only: options in the URL win. Without them a server that stops answering
        # would hold a live run for minutes instead of failing its write as unavailable.
        client = aioredis.from_url(url, socket_connect_timeout=5.0, socket_timeout=10.0)
        # Builds a connection object without connecting: an option the driver does not
        # know fails here, as a usage mistake, instead of as a TypeError on first use.
        client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, RedisError) as exc:
        raise ConfigurationError(f"cannot read the Redis store URL: {exc}") from exc
    return client


def _require_bytes(client: Client) -> None:
    """Refuse a client that decodes replies, and make it mark what it sends."""
    # Payloads are bytes; a client that decodes replies would hand back str or fail on them.
    if client.get_encoder().decode_responses:  # type: ignore[no-untyped-call]
        raise ConfigurationError(
            "the Redis client decodes responses (decode_responses=True); the stores keep "
            "bytes and need a client built with decode_responses=False"
        )
    _track_sends(client)


# --- what was sent -----------------------------------------------------------------------


class _Sends:
    """Whether any command of the kit call in progress left the client."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


_sends: ContextVar[_Sends | None] = ContextVar("tesserix_adk_redis_sends", default=None)


class _MarksSends:
    """Mixed into the client's connection class: a command written for a kit call marks
    that call's ``_Sends``; the connection's own handshake does not."""

    _adk_connecting = 0

    async def connect(self, *args: Any, **kwargs: Any) -> Any:
        self._adk_connecting += 1
        try:
            return await super().connect(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._adk_connecting -= 1

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        self._adk_connecting += 1
        try:
            return await super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._adk_connecting -= 1

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
        sends = _sends.get()
        if sends is not None and not self._adk_connecting:
            if not self.is_connected:  # type: ignore[attr-defined]
                await self.connect()  # a refused connection is not a sent command
            sends.sent = True
        return await super().send_packed_command(*args, **kwargs)  # type: ignore[misc]


_MARKING: dict[type[Any], type[Any]] = {}


def _marking(cls: type[Any]) -> type[Any]:
    if issubclass(cls, _MarksSends):
        return cls
    if cls not in _MARKING:
        _MARKING[cls] = type(f"Marking{cls.__name__}", (_MarksSends, cls), {})
    return _MARKING[cls]


def _track_sends(client: Client) -> None:
    """Make every connection of ``client`` mark what it sends (idempotent)."""
    pool = client.connection_pool
    pool.connection_class = _marking(pool.connection_class)
    existing: list[Any] = [getattr(client, "connection", None)]
    for name in ("_available_connections", "_in_use_connections", "_connections"):
        existing.extend(getattr(pool, name, None) or ())
    for conn in existing:
        if conn is not None and not isinstance(conn, _MarksSends):
            # Only a method override is added, so the object's layout is unchanged.
            conn.__class__ = _marking(type(conn))


# --- error translation -------------------------------------------------------------------


@contextmanager
def _driver_errors(action: str) -> Iterator[None]:
    """Translate redis-py errors into the kit's, once, at the boundary, saying whether the
    outcome is unknown (a command was sent) or certainly nothing happened."""
    sends = _Sends()
    token = _sends.set(sends)
    try:
        yield
    except AuthenticationError as exc:
        raise ConfigurationError(f"Redis refused the credentials while {action}: {exc}") from exc
    except _TRANSIENT_ERRORS as exc:
        raise StoreUnavailableError(
            f"Redis refused {action} for now ({type(exc).__name__}): {exc}", retryable=True
        ) from exc
    except NoPermissionError as exc:
        raise ConfigurationError(f"Redis refused {action}: {exc}") from exc
    except (RedisConnectionError, RedisTimeoutError) as exc:
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis did not answer while {action} after the command was sent; it may "
                f"have been applied: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis could not be reached while {action}: {exc}") from exc
    except ResponseError as exc:
        reply = str(exc)
        if reply.startswith(_PERMISSION_REPLIES):
            raise ConfigurationError(f"Redis refused {action}: {reply}") from exc
        if "WRONGTYPE" in reply:
            # A key of the kit's holds another kind of value: damage, not "retry later".
            raise CheckpointCorruptError(
                f"Redis holds a damaged key while {action}: {reply}"
            ) from exc
        raise StoreUnavailableError(
            f"Redis refused {action}: {reply}",
            retryable=reply.startswith(_TRANSIENT_REPLIES),
        ) from exc
    except RedisError as exc:
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis failed while {action} after the command was sent: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis failed while {action}: {exc}") from exc
    finally:
        _sends.reset(token)
