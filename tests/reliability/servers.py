"""Servers of the suite's own, which it may restart: a ``redis-server`` with AOF and a
PostgreSQL cluster (``initdb`` + ``pg_ctl``), each on a free loopback port in a temporary
directory; and the reply-dropping proxy on a thread of its own, so worker processes can
talk through it while the test goes on.

The shared servers are never stopped: faults that take a server down happen here.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.throwaway import ReplyDroppingProxy, free_port

__all__ = ["Faulter", "PostgresCluster", "ProxyThread", "RedisAof"]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisAof:
    """A ``redis-server`` persisting by AOF (``appendfsync always``), with ``config`` (more
    ``"--name", "value"`` pairs), stopped and started again on the same port and directory."""

    def __init__(self, directory: Path, *config: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.config = config  # more "--name", "value" pairs
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.directory), "--save", "", "--protected-mode", "no"]
        args += ["--appendonly", "yes", "--appendfsync", "always", *self.config]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not _answers(self.port):
            assert self.process.poll() is None, f"redis-server exited {self.process.returncode}"
            assert time.monotonic() < deadline, "the throwaway redis-server did not answer"
            time.sleep(0.02)

    def down(self, how: str) -> None:
        """``SHUTDOWN NOSAVE`` (an orderly stop that writes no snapshot) or ``kill`` (SIGKILL:
        whatever AOF has on disk is all that survives)."""
        assert self.process is not None
        if how == "nosave":
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                    sock.sendall(b"SHUTDOWN NOSAVE\r\n")
                    sock.recv(64)
            except OSError:
                pass
        else:
            self.process.kill()
        self.process.wait(timeout=20)

    def restart(self, rng: random.Random) -> None:
        self.down(rng.choice(("nosave", "kill")))
        time.sleep(rng.uniform(0.05, 0.4))
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class PostgresCluster:
    """A PostgreSQL cluster of its own (``initdb``), restarted with ``pg_ctl -m fast`` or
    ``-m immediate`` (a crash: recovery replays the WAL)."""

    def __init__(self) -> None:
        initdb = shutil.which("initdb")
        if initdb is None:
            pytest.skip("initdb (PostgreSQL server binaries) is not installed")
        self.bin = Path(os.path.realpath(initdb)).parent
        # Not under pytest's tmp_path: its parents are private to the user running pytest.
        directory = Path(tempfile.mkdtemp(prefix="adk-pg-"))
        self.directory = directory
        self.data = directory / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.restarts = 0
        self._as: list[str] = []
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root: run it as the postgres user.
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no postgres user to run a cluster")
            os.chown(directory, owner.pw_uid, owner.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.bin / tool), *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{tool} failed: {done.stdout}{done.stderr}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1"
        log = str(self.directory / "log")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def restart(self, rng: random.Random) -> None:
        mode = rng.choice(("fast", "immediate"))
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
        time.sleep(rng.uniform(0.05, 0.3))
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        subprocess.run(
            [*self._as, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(self.directory, ignore_errors=True)


class ProxyThread:
    """A proxy (``ReplyDroppingProxy`` unless ``proxy`` is given) in front of ``host:port``,
    served by a thread's event loop."""

    def __init__(self, host: str, port: int, proxy: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = ReplyDroppingProxy(host, port) if proxy is None else proxy
        asyncio.run_coroutine_threadsafe(self.proxy.__aenter__(), self.loop).result(10)
        self.port = self.proxy.listen_port

    def drop(self, skip: int, then: str) -> None:
        self.loop.call_soon_threadsafe(lambda: self.proxy.drop_next_reply(skip=skip, then=then))

    def call(self, fn: Callable[[], object]) -> None:
        """``fn()`` on the proxy's loop (arming a fault)."""
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.__aexit__(None, None, None), self.loop).result(
            30
        )
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Faulter:
    """Calls ``fault`` at random intervals on a thread until stopped."""

    def __init__(self, fault: Callable[[random.Random], None], rng: random.Random, every: float):
        self.fault = fault
        self.rng = rng
        self.every = every
        self.count = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.2, 2.0) * self.every):
            try:
                self.fault(self.rng)
            except BaseException as exc:
                self.error = exc
                return
            self.count += 1

    def __enter__(self) -> Faulter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        if self.error is not None:
            raise self.error
