"""Attacks on a Redis Cluster and on PostgreSQL behind PgBouncer (transaction pooling) under
faults the existing attack files left out: a node of the cluster SIGKILLed while a tool runs
and started again from its AOF, lost replies on a cluster's claim and outcome, operator
commands against a cluster whose node is down (noticed by the cluster or not yet), the
pooler's server connections terminated mid-turn, the pooler itself killed and started again
mid-turn, and operator commands against a pooler that is down.

Every server here is the test's own (throwaway cluster, throwaway PgBouncer); the shared
PostgreSQL is only written to in a schema of the test's own. Side effects are counted in a
list the tool appends to (the tool runs in this process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from adapters import services
from adapters.cluster import ThrowawayCluster, delete_prefixed, redis_cluster
from adapters.pooler import PgBouncer, pgbouncer
from adapters.services import redis_prefix, with_query
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    LeasePolicy,
    ScriptedProvider,
    tool,
)
from tesserix_adk.adapters.redis.keys import _Keys
from tesserix_adk.cli.failures import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
FAST = LeasePolicy(ttl=1, renew_within=0.5)


# --- helpers ---------------------------------------------------------------------------------


def _turns(*seats: str) -> list[Any]:
    return [*([("book", {"seat": seat})] for seat in seats), "done"]


def _booking(sent: list[str], on_send: Callable[[str], None] | None = None) -> Agent:
    @tool
    def book(seat: str) -> str:
        """Book a seat."""
        sent.append(seat)
        if on_send is not None:
            on_send(seat)
        return f"booked {seat}"

    return Agent("g", "book", tools=[book], max_iterations=20)


def _wait_for(done: Callable[[], bool], what: str, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def _node(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)


def _admin(port: int, *args: Any) -> Any:
    with contextlib.closing(_node(port)) as node:
        return node.execute_command(*args)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _cluster_state(port: int) -> str:
    try:
        info = _admin(port, "CLUSTER", "INFO").decode()
    except redis.RedisError:
        return ""
    return next(line for line in info.splitlines() if line.startswith("cluster_state:"))


def _slot(tenant: str, run_id: str) -> int:
    return key_slot(_Keys.tag(tenant, run_id).encode())


def _owner(ports: tuple[int, ...], slot: int) -> int:
    for port in ports:
        for line in _admin(port, "CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            if "myself" not in fields[2]:
                continue
            for part in fields[8:]:
                if part.startswith("["):
                    continue
                low, _, high = part.partition("-")
                if int(low) <= slot <= int(high or low):
                    return port
    raise AssertionError(f"no node serves slot {slot}")


def _node_config(port: int, name: str) -> str:
    with contextlib.closing(_node(port)) as node:
        return str(node.config_get(name)[name])


class _Restartable:
    """Kill a node of a throwaway cluster and start it again on its port, from its own
    directory (its AOF and ``nodes.conf``), as an operator restarting a crashed node."""

    def __init__(self, cluster: ThrowawayCluster, port: int, config: tuple[str, ...]) -> None:
        self.cluster, self.port, self.config = cluster, port, config
        self.bus = int(_node_config(port, "cluster-port"))
        self.process: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        pid = int(_admin(self.port, "INFO", "server")["process_id"])
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not _answers(self.port), f"redis-server on {self.port} dying")

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server is not None
        node = self.cluster.directory / str(self.port)
        args = [server, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(node)]
        args += ["--cluster-enabled", "yes", "--cluster-port", str(self.bus)]
        args += ["--cluster-config-file", "nodes.conf", "--protected-mode", "no"]
        args += ["--save", "", *self.config]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(lambda: _answers(self.port), f"redis-server on {self.port} answering again")
        _wait_for(
            lambda: all(_cluster_state(p) == "cluster_state:ok" for p in self.cluster.ports),
            "the cluster being ok again",
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _agent_file(tmp_path: Path, seats: tuple[str, ...], sent_file: Path) -> str:
    """A module for ``tesserix run --resume --agent``: ``book`` appends to ``sent_file``."""
    path = tmp_path / f"cli_agent_{secrets.token_hex(4)}.py"
    path.write_text(
        "from tesserix_adk import Agent, ScriptedProvider, tool\n\n"
        "@tool\n"
        "def book(seat: str) -> str:\n"
        '    """Book a seat."""\n'
        f"    with open({str(sent_file)!r}, 'a') as f:\n"
        "        f.write(seat + '\\n')\n"
        "    return f'booked {seat}'\n\n"
        "agent = Agent('g', 'book', tools=[book], max_iterations=20)\n"
        f"PROVIDER = ScriptedProvider({_turns(*seats)!r})\n"
    )
    return f"{path}:agent"


async def _until_lapsed(stores: Any, run_id: str) -> None:
    for _ in range(100):
        if await stores.leases.current(T, run_id) is None:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"the lease of {run_id} did not lapse")


def _in_doubt(url: str, run_id: str, sent: list[str]) -> str:
    """A run that died between sending ``book`` and recording it; its lease lapsed. The
    call's id."""

    async def go() -> str:
        async with open_stores(url) as stores:

            async def dying(*args: Any, **kwargs: Any) -> Any:
                raise SimulatedCrash

            real = stores.idempotency.complete
            stores.idempotency.complete = dying  # type: ignore[method-assign]
            runner = AgentRunner.from_stores(
                ScriptedProvider(_turns("0")), stores, lease_policy=FAST
            )
            with pytest.raises(SimulatedCrash):
                await runner.run(_booking(sent), "go", tenant=T, run_id=run_id)
            stores.idempotency.complete = real  # type: ignore[method-assign]
            await _until_lapsed(stores, run_id)
            [record] = [r for r in await stores.idempotency.records(T, run_id) if r.tool]
            assert record.call_id is not None
            return record.call_id

    return asyncio.run(go())


ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")


# --- operator commands against a cluster whose node is down -----------------------------------


def _commands(url: str, run_id: str, call_id: str, agent: str) -> dict[str, list[str]]:
    base = ["--store", url]
    return {
        "inspect": [*base, "inspect", run_id, "--tenant", T],
        "show": [*base, "show", run_id, "--tenant", T],
        "steps": [*base, "steps", run_id, "--tenant", T],
        "runs": [*base, "runs", "--tenant", T],
        "runs --stuck": [*base, "runs", "--tenant", T, "--stuck"],
        "cancel": [*base, "cancel", run_id, "--tenant", T, "--by", "ops"],
        "resolve": [
            *base,
            *("resolve", run_id, "--tenant", T, "--call", call_id),
            *("--outcome", '"booked 0"', "--by", "ops"),
        ],
        "run --resume": [*base, "run", "--resume", run_id, "--tenant", T, "--agent", agent],
    }


# Slow (redis-py and psycopg wait out a dead server): run with ADK_SLOW=1.
@pytest.mark.slow
@pytest.mark.parametrize("noticed", [True, False], ids=["cluster-down", "node-down-unnoticed"])
def test_operator_commands_on_a_cluster_whose_node_is_down_say_one_sentence_exit_3_and_lose_nothing(
    noticed: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeout = "500" if noticed else "600000"
    config = (*ALWAYS, "--cluster-node-timeout", timeout)
    with redis_cluster(config, config, config) as cluster:
        prefix = redis_prefix()
        url = with_query(cluster.url, prefix=prefix)
        run_id = "doubt"
        sent: list[str] = []
        call_id = _in_doubt(url, run_id, sent)
        assert sent == ["0"]
        doomed = _owner(cluster.ports, _slot(T, run_id))
        node = _Restartable(cluster, doomed, config)
        sent_file = tmp_path / "sent.txt"
        agent = _agent_file(tmp_path, ("0",), sent_file)
        node.kill()
        try:
            if noticed:
                others = [p for p in cluster.ports if p != doomed]
                _wait_for(
                    lambda: all(_cluster_state(p) == "cluster_state:fail" for p in others),
                    "the cluster declaring itself down",
                )
            seen: dict[str, tuple[int, str]] = {}
            for name, argv in _commands(url, run_id, call_id, agent).items():
                code, out, err = _main(capsys, *argv)
                seen[name] = (code, err)
            bad = {
                name: (code, err)
                for name, (code, err) in seen.items()
                if code != ExitCode.HELD
                or err.count("\n") != 1
                or not err.startswith("tesserix: ")
                or "Traceback" in err
            }
            assert not bad, bad
            assert not sent_file.exists()
            node.start()
            # Nothing lost: the call is still in doubt, the operator decides, one booking.
            code, out, err = _main(capsys, "--store", url, "inspect", run_id, "--tenant", T)
            assert code == ExitCode.CARRIED_ON and "indeterminate" in out, (out, err)
            code, out, err = _main(capsys, *_commands(url, run_id, call_id, agent)["resolve"])
            assert code == ExitCode.CARRIED_ON, (out, err)
            code, out, err = _main(capsys, *_commands(url, run_id, call_id, agent)["run --resume"])
            assert code == ExitCode.CARRIED_ON, (out, err)
            assert not sent_file.exists() and sent == ["0"]
        finally:
            node.stop()
            with contextlib.suppress(Exception):
                asyncio.run(delete_prefixed(cluster, prefix))


# --- a node of the cluster killed while a tool runs -------------------------------------------

UNNOTICED = (*ALWAYS, "--cluster-node-timeout", "600000")
_RESTARTED: list[_Restartable] = []


@pytest.fixture(scope="module")
def slow_cluster() -> Iterator[ThrowawayCluster]:
    """A cluster of this module's own whose nodes fsync every write and never declare a
    peer failed during a test: its nodes are killed and started again."""
    with redis_cluster(UNNOTICED, UNNOTICED, UNNOTICED) as cluster:
        try:
            yield cluster
        finally:
            for node in _RESTARTED:
                node.stop()


async def test_the_runs_node_restarted_while_a_tool_runs_the_run_completes_with_one_send(
    slow_cluster: ThrowawayCluster,
) -> None:
    run_id = f"restarted-{secrets.token_hex(3)}"
    node = _Restartable(slow_cluster, _owner(slow_cluster.ports, _slot(T, run_id)), UNNOTICED)
    sent: list[str] = []

    def bounce(seat: str) -> None:
        if seat == "0":
            node.kill()
            node.start()

    prefix = redis_prefix()
    try:
        async with open_stores(with_query(slow_cluster.url, prefix=prefix)) as stores:
            runner = AgentRunner.from_stores(ScriptedProvider(_turns("0", "1")), stores)
            try:
                run = await runner.run(_booking(sent, bounce), "go", tenant=T, run_id=run_id)
            except (StoreUnavailableError, StoreReplyLostError) as stopped:
                assert stopped.retryable, str(stopped)
                await _until_lapsed(stores, run_id)
                later = AgentRunner.from_stores(ScriptedProvider(_turns("0", "1")), stores)
                run = await later.resume(_booking(sent), run_id, tenant=T)
            assert run.status.value == "completed", run
            assert sent == ["0", "1"]
            records = [r for r in await stores.idempotency.records(T, run_id) if r.tool]
            assert sorted(r.status.value for r in records) == ["completed", "completed"]
    finally:
        _RESTARTED.append(node)  # stopped with the cluster, which the next test uses
        await delete_prefixed(slow_cluster, prefix)


# Slow (redis-py and psycopg wait out a dead server): run with ADK_SLOW=1.
@pytest.mark.slow
async def test_the_runs_node_down_through_a_tools_outcome_stops_retryably_and_never_guesses(
    slow_cluster: ThrowawayCluster,
) -> None:
    run_id = f"down-{secrets.token_hex(3)}"
    node = _Restartable(slow_cluster, _owner(slow_cluster.ports, _slot(T, run_id)), UNNOTICED)
    sent: list[str] = []

    def die(seat: str) -> None:
        if seat == "0":
            node.kill()

    prefix = redis_prefix()
    try:
        async with open_stores(with_query(slow_cluster.url, prefix=prefix)) as stores:
            runner = AgentRunner.from_stores(
                ScriptedProvider(_turns("0", "1")), stores, lease_policy=FAST
            )
            with pytest.raises((StoreUnavailableError, StoreReplyLostError)) as stopped:
                await runner.run(_booking(sent, die), "go", tenant=T, run_id=run_id)
            assert stopped.value.retryable, str(stopped.value)
            assert sent == ["0"]
        node.start()
        async with open_stores(with_query(slow_cluster.url, prefix=prefix)) as stores:
            await _until_lapsed(stores, run_id)
            later = AgentRunner.from_stores(ScriptedProvider(_turns("0", "1")), stores)
            with pytest.raises(IndeterminateToolCallError):
                await later.resume(_booking(sent), run_id, tenant=T)
            assert sent == ["0"]
            [record] = [r for r in await stores.idempotency.records(T, run_id) if r.tool]
            assert record.call_id is not None
            argv = ["--store", with_query(slow_cluster.url, prefix=prefix), "resolve", run_id]
            argv += ["--tenant", T, "--call", record.call_id, "--outcome", '"booked 0"']
            assert await asyncio.to_thread(main, [*argv, "--by", "ops"]) == ExitCode.CARRIED_ON
            run = await AgentRunner.from_stores(ScriptedProvider(_turns("0", "1")), stores).resume(
                _booking(sent), run_id, tenant=T
            )
            assert run.status.value == "completed" and sent == ["0", "1"]
    finally:
        _RESTARTED.append(node)  # stopped with the cluster, which the next test uses
        await delete_prefixed(slow_cluster, prefix)


# --- PostgreSQL behind PgBouncer under faults --------------------------------------------------


def _server_ports(pid: int, server_port: int = 5432) -> list[int]:
    """The local ports of the process ``pid``'s TCP connections to ``server_port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == server_port:
                    ports.append(int(local.rsplit(":", 1)[1], 16))
    return ports


async def _terminate_pooler_servers(bouncer: PgBouncer) -> int:
    """``pg_terminate_backend`` every server connection of ``bouncer`` (only its own: found
    by the ports of its sockets); how many were ended."""
    import psycopg

    ports = _server_ports(bouncer.process.pid)
    if not ports:
        return 0
    conn = await psycopg.AsyncConnection.connect(services.POSTGRES_URL, autocommit=True)
    try:
        cur = await conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE client_port = ANY(%s) AND pid <> pg_backend_pid()",
            (ports,),
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0
    finally:
        await conn.close()


class _Pooler:
    """A PgBouncer of the test's own that can be killed and started again on its port."""

    def __init__(self, bouncer: PgBouncer) -> None:
        self.bouncer = bouncer
        self.process: subprocess.Popen[bytes] = bouncer.process

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def start(self) -> None:
        import pwd

        ini = self.bouncer.log.parent / "pgbouncer.ini"
        account = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        self.process = subprocess.Popen(
            [str(shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"), str(ini)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=None if account is None else account.pw_uid,
            group=None if account is None else account.pw_gid,
            extra_groups=None if account is None else [],
        )

        def listening() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.bouncer.port), timeout=0.5):
                    return True
            except OSError:
                return False

        _wait_for(listening, "pgbouncer listening again", timeout=20)

    def stop(self) -> None:
        if self.process is not self.bouncer.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@contextlib.asynccontextmanager
async def _pooled(bouncer: PgBouncer) -> Any:
    async with services.postgres_schema() as schema:
        url = bouncer.stores_url(schema)
        async with open_stores(url) as stores:
            await stores.create_schema()
        yield url


async def test_the_poolers_server_connections_terminated_while_a_tool_runs_book_once() -> None:
    with pgbouncer() as bouncer:
        async with _pooled(bouncer) as url:
            sent: list[str] = []
            ended: list[int] = []

            def terminate(seat: str) -> None:
                # In the tool's thread: the loop is free meanwhile.
                ended.append(asyncio.run(_terminate_pooler_servers(bouncer)))

            async with open_stores(url) as stores:
                runner = AgentRunner.from_stores(
                    ScriptedProvider(_turns("0", "1", "2")), stores, lease_policy=FAST
                )
                try:
                    run = await runner.run(
                        _booking(sent, terminate), "go", tenant=T, run_id="terminated"
                    )
                except (StoreUnavailableError, StoreReplyLostError) as stopped:
                    assert stopped.retryable, str(stopped)
                    await _until_lapsed(stores, "terminated")
                    later = AgentRunner.from_stores(ScriptedProvider(_turns("0", "1", "2")), stores)
                    run = await later.resume(_booking(sent), "terminated", tenant=T)
                assert any(ended), ended
                assert run.status.value == "completed", run
                assert sent == ["0", "1", "2"]


async def test_the_pooler_restarted_while_a_tool_runs_the_run_books_once() -> None:
    with pgbouncer() as bouncer:
        pooler = _Pooler(bouncer)
        try:
            async with _pooled(bouncer) as url:
                sent: list[str] = []

                def bounce(seat: str) -> None:
                    if seat == "0":
                        pooler.kill()
                        pooler.start()

                async with open_stores(url) as stores:
                    runner = AgentRunner.from_stores(
                        ScriptedProvider(_turns("0", "1")), stores, lease_policy=FAST
                    )
                    try:
                        run = await runner.run(
                            _booking(sent, bounce), "go", tenant=T, run_id="bounced"
                        )
                    except (StoreUnavailableError, StoreReplyLostError) as stopped:
                        assert stopped.retryable, str(stopped)
                        await _until_lapsed(stores, "bounced")
                        later = AgentRunner.from_stores(ScriptedProvider(_turns("0", "1")), stores)
                        run = await later.resume(_booking(sent), "bounced", tenant=T)
                    assert run.status.value == "completed", run
                    assert sent == ["0", "1"]
        finally:
            pooler.stop()


# Slow (redis-py and psycopg wait out a dead server): run with ADK_SLOW=1.
@pytest.mark.slow
def test_the_pooler_down_through_a_tools_outcome_operator_commands_exit_3_and_nothing_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pgbouncer() as bouncer:
        pooler = _Pooler(bouncer)
        schema_cm = services.postgres_schema()
        loop = asyncio.new_event_loop()
        try:
            schema = loop.run_until_complete(schema_cm.__aenter__())
            url = bouncer.stores_url(schema)
            sent: list[str] = []

            def die(seat: str) -> None:
                if seat == "0":
                    pooler.kill()

            async def first() -> BaseException:
                async with open_stores(url) as stores:
                    await stores.create_schema()
                    runner = AgentRunner.from_stores(
                        ScriptedProvider(_turns("0")), stores, lease_policy=FAST
                    )
                    with pytest.raises((StoreUnavailableError, StoreReplyLostError)) as stopped:
                        await runner.run(_booking(sent, die), "go", tenant=T, run_id="down")
                    return stopped.value

            stopped = loop.run_until_complete(first())
            assert stopped.retryable, str(stopped)  # type: ignore[attr-defined]
            assert sent == ["0"]
            sent_file = tmp_path / "sent.txt"
            agent = _agent_file(tmp_path, ("0",), sent_file)
            seen = {}
            for name, argv in _commands(url, "down", "call_0_0", agent).items():
                code, _, err = _main(capsys, *argv)
                seen[name] = (code, err)
            bad = {
                name: (code, err)
                for name, (code, err) in seen.items()
                if code != ExitCode.HELD
                or err.count("\n") != 1
                or not err.startswith("tesserix: ")
                or "Traceback" in err
            }
            assert not bad, bad
            pooler.start()
            time.sleep(1.5)  # the dead attempt's 1 s lease lapses
            code, out, err = _main(capsys, "--store", url, "inspect", "down", "--tenant", T)
            assert code == ExitCode.CARRIED_ON and "indeterminate" in out, (out, err)
            code, out, err = _main(capsys, *_commands(url, "down", "call_0_0", agent)["resolve"])
            assert code == ExitCode.CARRIED_ON, (out, err)
            code, out, err = _main(
                capsys, *_commands(url, "down", "call_0_0", agent)["run --resume"]
            )
            assert code == ExitCode.CARRIED_ON, (out, err)
            assert not sent_file.exists() and sent == ["0"]
        finally:
            pooler.stop()
            loop.run_until_complete(schema_cm.__aexit__(None, None, None))
            loop.close()


# --- lost replies on a cluster --------------------------------------------------------------


@pytest.mark.parametrize("operation", ["claim", "complete"])
async def test_a_lost_reply_on_a_clusters_claim_or_outcome_books_once(
    slow_cluster: ThrowawayCluster, operation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.redis_wire import lose_the_next_reply

    run_id = f"lost-{operation}-{secrets.token_hex(3)}"
    sent: list[str] = []
    prefix = redis_prefix()
    try:
        async with open_stores(with_query(slow_cluster.url, prefix=prefix)) as stores:
            real = getattr(stores.idempotency, operation)
            lost: list[bool] = []

            async def losing(*args: Any, **kwargs: Any) -> Any:
                if lost or (operation == "claim" and kwargs.get("tool") is None):
                    return await real(*args, **kwargs)
                lost.append(True)
                with lose_the_next_reply(monkeypatch):
                    return await real(*args, **kwargs)

            monkeypatch.setattr(stores.idempotency, operation, losing)
            runner = AgentRunner.from_stores(
                ScriptedProvider(_turns("0", "1")), stores, lease_policy=FAST
            )
            try:
                run = await runner.run(_booking(sent), "go", tenant=T, run_id=run_id)
            except (StoreUnavailableError, StoreReplyLostError) as stopped:
                assert stopped.retryable, str(stopped)
                await _until_lapsed(stores, run_id)
                later = AgentRunner.from_stores(ScriptedProvider(_turns("0", "1")), stores)
                run = await later.resume(_booking(sent), run_id, tenant=T)
            assert lost == [True]
            assert run.status.value == "completed", run
            assert sent == ["0", "1"]
    finally:
        await delete_prefixed(slow_cluster, prefix)
