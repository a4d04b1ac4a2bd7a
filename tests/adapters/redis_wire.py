"""What the Redis tests do to the wire: count what a client sends, lose a reply, and a
client that sends again after a lost one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from adapters import services


def sent_by(client: Any) -> list[str]:
    """What ``client`` sends from now on: each command's name, ``PIPELINE`` for a pipeline
    (one write, one read)."""
    sent: list[str] = []
    send, make_pipeline = client.execute_command, client.pipeline

    async def execute_command(*args: Any, **options: Any) -> Any:
        sent.append(str(args[0]))
        return await send(*args, **options)

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make_pipeline(*args, **kwargs)
        run = pipe.execute

        async def execute(*a: Any, **kw: Any) -> Any:
            sent.append("PIPELINE")
            return await run(*a, **kw)

        pipe.execute = execute
        return pipe

    client.execute_command = execute_command
    client.pipeline = pipeline
    return sent


@contextmanager
def lose_the_next_reply(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The next reply is read and then lost, as when a connection drops after the server
    ran the command: redis-py reconnects and sends the command again."""
    real = Connection.read_response
    armed = [True]

    async def read_response(self: Connection, *args: Any, **kwargs: Any) -> Any:
        reply = await real(self, *args, **kwargs)
        if armed[0]:
            armed[0] = False
            raise RedisConnectionError("the reply was lost (test)")
        return reply

    monkeypatch.setattr(Connection, "read_response", read_response)
    try:
        yield
    finally:
        monkeypatch.setattr(Connection, "read_response", real)
    assert not armed[0], "no reply was lost"


@asynccontextmanager
async def resending_client() -> AsyncIterator[Redis]:
    """A client that sends a command again after a connection error, as ``Redis(...)``
    built directly does by default (``from_url`` clients do not)."""
    client = Redis.from_url(
        services.REDIS_URL, retry=Retry(NoBackoff(), 3), retry_on_error=[RedisConnectionError]
    )
    try:
        yield client
    finally:
        await client.aclose()
