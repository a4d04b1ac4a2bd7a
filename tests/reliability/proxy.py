"""A loopback TCP proxy that holds replies back or goes half-open, between workers and a
server (the reply-dropping one is ``adapters.throwaway.ReplyDroppingProxy``).

- ``slow(skip, count, lo, hi)``: ``skip`` requests later, each of the next ``count``
  replies is held ``uniform(lo, hi)`` seconds before it is forwarded (later replies on the
  same connection queue behind it, as on a slow link).
- ``half_open(skip, forward)``: ``skip`` requests later the proxy stops forwarding in both
  directions on every connection open then, and on any opened while it stays dark
  (``dark_for`` seconds), but keeps each socket open and reads what the client sends: the
  client learns only by its own timeouts. The request that trips it is forwarded to the
  server first if ``forward`` (applied, reply lost), else swallowed (never applied).
  Connections that went dark stay dark; ones opened afterwards work.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

__all__ = ["FaultyProxy"]


@dataclass(eq=False)  # hashed by identity: a set of them
class _Conn:
    dark: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultyProxy:
    """A proxy in front of ``host:port`` on a loopback port of its own."""

    def __init__(self, host: str, port: int, rng: random.Random) -> None:
        self.host = host
        self.port = port
        self.rng = rng
        self.delayed = 0  # replies held back
        self.darkened = 0  # times it went half-open
        self._skip: int | None = None
        self._fault = ""
        self._count = 0
        self._lo = self._hi = 0.0
        self._forward = True
        self._dark_until = 0.0
        self._dark_for = 0.0
        self._slow_left = 0
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None

    @property
    def listen_port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def slow(self, *, skip: int, count: int, lo: float, hi: float) -> None:
        self._fault, self._skip, self._count, self._lo, self._hi = "slow", skip, count, lo, hi

    def half_open(self, *, skip: int, forward: bool, dark_for: float) -> None:
        self._fault, self._skip, self._forward, self._dark_for = "dark", skip, forward, dark_for

    async def __aenter__(self) -> FaultyProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        tasks = [t for conn in list(self._conns) for t in conn.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _trip(self) -> bool:
        """Counts one request; true if it is the one the armed fault trips on."""
        if self._skip is None:
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._skip = None
        return True

    def _go_dark(self) -> None:
        self.darkened += 1
        self._dark_until = time.monotonic() + self._dark_for
        for conn in self._conns:
            conn.dark = True

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Conn(dark=time.monotonic() < self._dark_until)
        serving = asyncio.current_task()
        assert serving is not None
        conn.tasks.append(serving)
        self._conns.add(conn)
        writers = [client_w]
        try:
            server_r, server_w = await asyncio.open_connection(self.host, self.port)
            writers.append(server_w)
            up = asyncio.create_task(self._requests(conn, client_r, server_w))
            down = asyncio.create_task(self._replies(conn, server_r, client_w))
            conn.tasks += [up, down]
            try:
                await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (up, down):
                    task.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for writer in writers:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            self._conns.discard(conn)

    async def _requests(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if conn.dark:
                    continue  # read and dropped: the socket stays open, nothing goes on
                if self._trip():
                    if self._fault == "slow":
                        self._slow_left = self._count
                    else:
                        if self._forward:
                            writer.write(data)
                            await writer.drain()
                        self._go_dark()
                        continue
                writer.write(data)
                await writer.drain()

    async def _replies(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if conn.dark:
                    continue
                if self._slow_left > 0:
                    self._slow_left -= 1
                    self.delayed += 1
                    await asyncio.sleep(self.rng.uniform(self._lo, self._hi))
                    if conn.dark:
                        continue
                writer.write(data)
                await writer.drain()
        # The server closed: a dark connection stays open for the client regardless.
        if conn.dark:
            await asyncio.Event().wait()  # until the client closes (the task is cancelled)
