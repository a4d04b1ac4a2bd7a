"""Servers and faults of a test's own: a throwaway ``redis-server`` on a free port, and a
loopback TCP proxy that forwards a request and then drops its reply.

Tests that kill, fill or reconfigure a server use these, never the shared servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisServer:
    """A running throwaway ``redis-server``: its URL and process."""

    url: str
    port: int
    process: subprocess.Popen[bytes]

    def stores_url(self, prefix: str) -> str:
        """The stores' URL on this server, their keys under ``prefix``."""
        return f"{self.url}?prefix={prefix}"

    @asynccontextmanager
    async def client(self) -> AsyncIterator[Redis]:
        """A plain client of this server (the test's own view of its keys), closed after."""
        client = Redis.from_url(self.url)
        try:
            yield client
        finally:
            await client.aclose()

    def kill(self) -> None:
        """SIGKILL: the server dies at once, mid-whatever it was doing."""
        self.process.kill()
        self.process.wait(timeout=10)

    def shutdown(self) -> None:
        """``SHUTDOWN NOSAVE``: an orderly stop that writes nothing; returns once it exited."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock,
        ):
            sock.sendall(b"SHUTDOWN NOSAVE\r\n")
            sock.recv(64)
        self.process.wait(timeout=20)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(*config: str, port: int | None = None) -> Iterator[RedisServer]:
    """A ``redis-server`` on a free loopback port (or on ``port``, to start one again where
    an earlier one ran) with ``config`` (``"--name", "value"`` pairs after the defaults: no
    persistence, no protected mode); stopped after."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    with tempfile.TemporaryDirectory(prefix="adk-redis-") as directory:
        port = free_port() if port is None else port
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no", *config]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not _answers(port):
                if process.poll() is not None:
                    pytest.fail(f"redis-server {' '.join(config)} exited with {process.returncode}")
                if time.monotonic() > deadline:
                    pytest.fail("the throwaway redis-server did not answer within 20 s")
                time.sleep(0.05)
            yield RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, process=process)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


class ReplyDroppingProxy:
    """A loopback TCP proxy in front of ``host:port``.

    Forwards both ways until ``drop_next_reply()`` is called; then, ``skip`` requests
    later, a request is forwarded to the server, the server's reply is read and thrown
    away, and the client's connection is closed (``then="close"``) or left open and silent
    (``then="hang"``): the request was applied, its reply lost.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.dropped = 0
        self._armed = False
        self._skip = 0
        self._then = "close"
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def listen_port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def drop_next_reply(self, *, skip: int = 0, then: str = "close") -> None:
        assert then in ("close", "hang")
        self._armed = True
        self._skip = skip
        self._then = then

    async def __aenter__(self) -> ReplyDroppingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            server_r, server_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        replies = asyncio.create_task(self._pipe(server_r, client_w))
        self._tasks.add(replies)
        try:
            while data := await client_r.read(65536):
                if self._armed and self._skip > 0:
                    self._skip -= 1
                elif self._armed:
                    self._armed = False
                    replies.cancel()
                    server_w.write(data)
                    await server_w.drain()
                    # The server answers (so it applied the request); the client never
                    # hears it.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(server_r.read(65536), 5)
                    self.dropped += 1
                    if self._then == "hang":
                        while await client_r.read(65536):
                            pass
                    break
                server_w.write(data)
                await server_w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            replies.cancel()
            for writer in (client_w, server_w):
                writer.close()
            self._tasks.discard(replies)
            self._tasks.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()


@asynccontextmanager
async def reply_dropping_proxy(host: str, port: int) -> AsyncIterator[ReplyDroppingProxy]:
    """A ``ReplyDroppingProxy`` in front of ``host:port``, listening on loopback."""
    async with ReplyDroppingProxy(host, port) as proxy:
        yield proxy
