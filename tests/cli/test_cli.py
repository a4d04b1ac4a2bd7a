"""The operator CLI, run as the real console script in subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from processes import AGENT, TENANT, Site
from tesserix_adk import Checkpoint, Checkpointer, CheckpointStatus, PendingApproval, Usage
from tesserix_adk.cli import describe
from tesserix_adk.stores.urls import open_stores


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def test_describe_matches_the_seed_example() -> None:
    cp = Checkpoint(
        tenant="acme",
        run_id="run_1",
        agent_name="booking",
        step=7,
        status=CheckpointStatus.waiting_approval,
        iteration=3,
        messages=(),
        usage=Usage(input_tokens=1200, output_tokens=300),
        micros=4100,
        pending_approval=PendingApproval(id="req-9", calls=("call_3_0",)),
    )
    assert describe(cp) == (
        "run run_1  tenant acme  agent booking\n"
        "iteration 3  1200 in, 300 out  4100 micros\n"
        "waiting on approval req-9"
    )


def test_exit_0_inspect_prints_the_frontier_and_plan(site: Site) -> None:
    site.kill_at("r", "model_call")
    done = site.tesserix("inspect", "r", "--tenant", TENANT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"run r  tenant {TENANT}  agent booking"
    assert lines[2] == "running: step 3 after_model_call, 1 call(s) outstanding"
    assert lines[3].startswith("book_seat (call_1_0): never_ran - ")
    as_json = json.loads(site.tesserix("inspect", "r", "--tenant", TENANT, "--json").stdout)
    assert as_json["safe"] is True and as_json["calls"][0]["tool"] == "book_seat"


def test_exit_1_nothing_checkpointed_and_wrong_tenant_sees_nothing(site: Site) -> None:
    site.kill_at("r", "model_call")
    for args in (("inspect", "nope", "--tenant", TENANT), ("inspect", "r", "--tenant", "other")):
        done = site.tesserix(*args)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    site.wait_lease_lapsed("r")
    done = site.tesserix("run", "--resume", "r", "--tenant", "other", "--agent", AGENT)
    assert done.returncode == 1
    assert site.bookings("r") == 0


def test_exit_1_when_the_store_file_does_not_exist_names_schema_apply(tmp_path: Path) -> None:
    site = Site(tmp_path)
    env = {**site.env, "ADK_STORE": f"sqlite:///{tmp_path / 'absent' / 'x.sqlite3'}"}
    done = site.tesserix("inspect", "r", "--tenant", TENANT, env=env)
    assert done.returncode == 1
    assert "tesserix schema apply" in done.stderr
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "r"),  # no --tenant
        ("run", "--tenant", TENANT, "--agent", AGENT),  # run without --resume
        ("run", "--resume", "r", "--tenant", TENANT, "--agent", "no_such_module:agent"),
        ("run", "--resume", "r", "--tenant", TENANT, "--agent", "notaref"),
        ("frobnicate",),
        (),
        ("--store", "ftp://nowhere", "inspect", "r", "--tenant", TENANT),
        ("inspect", "r", "--tenant", TENANT, "--store"),
    ],
    ids=[
        "missing-tenant",
        "run-without-resume",
        "unknown-agent-module",
        "bad-agent-ref",
        "unknown-command",
        "no-command",
        "unknown-store-scheme",
        "store-without-url",
    ],
)
def test_exit_2_for_a_command_line_it_cannot_read(site: Site, args: tuple[str, ...]) -> None:
    done = site.tesserix(*args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("tesserix")
    assert "Traceback" not in done.stderr


def test_exit_3_when_another_worker_holds_the_run(site: Site) -> None:
    site.kill_at("r", "model_call")
    site.wait_lease_lapsed("r")

    async def hold() -> None:
        async with open_stores(site.store) as stores:
            await stores.leases.acquire(TENANT, "r", "someone-else", 60)

    asyncio.run(hold())
    done = site.tesserix("run", "--resume", "r", "--tenant", TENANT, "--agent", AGENT)
    assert done.returncode == 3
    assert "someone-else" in done.stderr
    assert site.bookings("r") == 0


def test_exit_4_names_the_indeterminate_call(site: Site) -> None:
    site.kill_at("r", "in_flight")
    site.wait_lease_lapsed("r")
    done = site.tesserix("run", "--resume", "r", "--tenant", TENANT, "--agent", AGENT)
    assert done.returncode == 4
    assert "book_seat" in done.stderr and "tesserix resolve" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert site.bookings("r") == 1
    # inspect still prints (exit 0) and says what resume would refuse.
    seen = site.tesserix("inspect", "r", "--tenant", TENANT)
    assert seen.returncode == 0 and "book_seat (call_1_0): indeterminate" in seen.stdout


def test_exit_4_for_a_corrupt_frontier(site: Site) -> None:
    site.kill_at("r", "model_call")

    async def corrupt() -> None:
        async with open_stores(site.store) as stores:
            latest = await stores.checkpoints.latest(TENANT, "r")
            assert latest is not None
            await stores.checkpoints.put(
                TENANT, "r", latest.payload[:40], step=latest.step + 1, fence=latest.fence
            )

    asyncio.run(corrupt())
    done = site.tesserix("inspect", "r", "--tenant", TENANT)
    assert done.returncode == 4 and "Traceback" not in done.stderr


def test_inspect_takes_no_lease(site: Site) -> None:
    site.kill_at("r", "model_call")
    site.wait_lease_lapsed("r")

    async def hold() -> tuple[str, int]:
        async with open_stores(site.store) as stores:
            lease = await stores.leases.acquire(TENANT, "r", "holder-x", 60)
            return lease.holder, lease.fence

    async def current() -> tuple[str, int] | None:
        async with open_stores(site.store) as stores:
            lease = await stores.leases.current(TENANT, "r")
            return None if lease is None else (lease.holder, lease.fence)

    held = asyncio.run(hold())
    done = site.tesserix("inspect", "r", "--tenant", TENANT)
    assert done.returncode == 0
    assert f"held by holder-x (fence {held[1]})" in done.stdout
    assert asyncio.run(current()) == held


def test_run_resume_prints_summary_then_fence_then_status(site: Site) -> None:
    site.kill_at("r", "booked")
    site.wait_lease_lapsed("r")
    done = site.tesserix(
        "run", "--resume", "r", "--tenant", TENANT, "--agent", AGENT, "--worker", "oncall"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"run r  tenant {TENANT}  agent booking"
    assert lines[3].startswith("book_seat (call_1_0): completed")
    assert lines[4].startswith("holding the run as oncall-") and lines[4].endswith("(fence 2)")
    assert lines[5].startswith("now completed")
    assert site.bookings("r") == 1
    again = site.tesserix("run", "--resume", "r", "--tenant", TENANT, "--agent", AGENT)
    assert again.returncode == 0 and "completed at step" in again.stdout


APPROVAL_AGENT = textwrap.dedent(
    """
    from tesserix_adk import Agent, ScriptedProvider, tool
    from tesserix_adk.cli.demo_agent import book_seat as _book


    @tool(requires_approval=True)
    def refund(order: str) -> dict:
        '''Refund an order.'''
        import os
        with open(os.environ["REFUNDS_FILE"], "a") as f:
            f.write(order + "\\n")
        return {"refunded": order}


    agent = Agent("refunds", "Refund what is asked.", [refund])
    PROVIDER = ScriptedProvider([[("refund", {"order": "o-42"})], "Refunded o-42."])
    """
)


def test_approval_from_another_process_then_resume_finishes_the_run(
    site: Site, tmp_path: Path
) -> None:
    (tmp_path / "refund_agent.py").write_text(APPROVAL_AGENT)
    refunds = tmp_path / "refunds.txt"
    env = {**site.env, "REFUNDS_FILE": str(refunds), "PYTHONPATH": str(tmp_path)}

    async def start() -> str:
        import sys

        sys.path.insert(0, str(tmp_path))
        import refund_agent  # type: ignore[import-not-found]

        from tesserix_adk import AgentRunner

        async with open_stores(site.store) as stores:
            runner = AgentRunner(
                refund_agent.PROVIDER,
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                leases=stores.leases,
                ledger=stores.ledger,
                approvals=stores.approvals,
            )
            run = await runner.run(refund_agent.agent, "refund o-42", tenant=TENANT, run_id="rf")
            assert run.pending_approval is not None
            return run.pending_approval.id

    request = asyncio.run(start())
    seen = site.tesserix("inspect", "rf", "--tenant", TENANT, env=env)
    assert f"waiting on approval {request}" in seen.stdout
    waiting = site.tesserix(
        "run", "--resume", "rf", "--tenant", TENANT, "--agent", "refund_agent:agent", env=env
    )
    assert waiting.returncode == 0 and "now waiting_approval" in waiting.stdout
    assert not refunds.exists()

    assert (
        site.tesserix("approve", request, "--tenant", "other", "--by", "x", env=env).returncode == 1
    )
    ok = site.tesserix("approve", request, "--tenant", TENANT, "--by", "alice", env=env)
    assert ok.returncode == 0, ok.stderr
    assert (
        site.tesserix("approve", request, "--tenant", TENANT, "--by", "alice", env=env).returncode
        == 0
    )
    assert (
        site.tesserix(
            "approve", request, "--tenant", TENANT, "--by", "bob", "--deny", env=env
        ).returncode
        == 4
    )

    done = site.tesserix(
        "run", "--resume", "rf", "--tenant", TENANT, "--agent", "refund_agent:agent", env=env
    )
    assert done.returncode == 0, done.stderr
    assert "now completed" in done.stdout
    assert refunds.read_text() == "o-42\n"


def test_approve_prints_a_resume_command_that_works_when_pasted(site: Site, tmp_path: Path) -> None:
    (tmp_path / "refund_agent.py").write_text(APPROVAL_AGENT)
    refunds = tmp_path / "refunds.txt"

    async def start() -> str:
        sys.path.insert(0, str(tmp_path))
        import refund_agent  # type: ignore[import-not-found]

        from tesserix_adk import AgentRunner

        async with open_stores(site.store) as stores:
            runner = AgentRunner.from_stores(refund_agent.PROVIDER, stores)
            run = await runner.run(refund_agent.agent, "refund o-42", tenant=TENANT, run_id="rp")
            assert run.pending_approval is not None
            return run.pending_approval.id

    request = asyncio.run(start())
    # As an operator types it: no ADK_STORE, the store on the command line.
    env = {k: v for k, v in site.env.items() if k != "ADK_STORE"}
    env["REFUNDS_FILE"] = str(refunds)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    approve = ["approve", request, "--tenant", TENANT, "--by", "alice", "--store", site.store]
    vague = site.tesserix(*approve, env=env)
    assert vague.returncode == 0, vague.stderr
    assert "--agent MODULE:ATTR" in vague.stdout and "'refunds'" in vague.stdout
    exact = site.tesserix(*approve, "--agent", "refund_agent:agent", env=env)
    assert exact.returncode == 0, exact.stderr
    pasted = next(w for w in exact.stdout.split("`") if w.startswith("tesserix run "))
    assert "--agent refund_agent:agent" in pasted
    done = subprocess.run(
        ["bash", "-c", pasted], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"approval {request} approved by alice; a resume carries it on" in done.stdout
    assert "now completed" in done.stdout
    assert refunds.read_text() == "o-42\n"


def test_resolve_records_the_operator_and_finishes_the_run(site: Site) -> None:
    site.kill_at("r", "in_flight")
    site.wait_lease_lapsed("r")
    assert (
        site.tesserix(
            "resolve", "r", "--tenant", TENANT, "--call", "nope", "--never-ran", "--by", "me"
        ).returncode
        == 1
    )
    assert (
        site.tesserix(
            "resolve",
            "r",
            "--tenant",
            TENANT,
            "--call",
            "call_1_0",
            "--outcome",
            "{not json",
            "--by",
            "me",
        ).returncode
        == 2
    )
    ok = site.tesserix(
        "resolve",
        "r",
        "--tenant",
        TENANT,
        "--call",
        "call_1_0",
        "--outcome",
        '{"booking_id": "BK-1"}',
        "--by",
        "on-call",
    )
    assert ok.returncode == 0, ok.stderr
    again = site.tesserix(
        "resolve", "r", "--tenant", TENANT, "--call", "call_1_0", "--never-ran", "--by", "me"
    )
    assert again.returncode == 4
    done = site.tesserix("run", "--resume", "r", "--tenant", TENANT, "--agent", AGENT)
    assert done.returncode == 0, done.stderr
    assert site.bookings("r") == 1

    async def record_by() -> list[str | None]:
        async with open_stores(site.store) as stores:
            return [r.by for r in await stores.idempotency.records(TENANT, "r") if r.tool]

    assert "on-call" in asyncio.run(record_by())


def test_runs_lists_and_stuck_finds_the_dead_run(site: Site) -> None:
    site.kill_at("dead", "in_flight")
    site.kill_at("fine", "booked")
    site.wait_lease_lapsed("fine")
    assert (
        site.tesserix("run", "--resume", "fine", "--tenant", TENANT, "--agent", AGENT).returncode
        == 0
    )
    site.wait_lease_lapsed("dead")
    listed = site.tesserix("runs", "--tenant", TENANT)
    assert listed.returncode == 0
    assert {line.split()[0] for line in listed.stdout.splitlines()} == {"dead", "fine"}
    stuck = site.tesserix("runs", "--tenant", TENANT, "--stuck")
    assert [line.split()[0] for line in stuck.stdout.splitlines()] == ["dead"]


def test_steps_lists_the_step_history(site: Site) -> None:
    site.kill_at("r", "booked")
    done = site.tesserix("steps", "r", "--tenant", TENANT)
    assert done.returncode == 0
    rows = done.stdout.splitlines()[1:]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 3]
    assert rows[2].split()[1] == "after_model_call"


def test_schema_show_prints_the_ddl(site: Site) -> None:
    done = site.tesserix("schema", "show")
    assert done.returncode == 0 and "CREATE TABLE" in done.stdout


def test_demo_exits_0_with_one_booking_per_act_and_keep_prints_commands_that_work(
    tmp_path: Path,
) -> None:
    """``demo --keep DIR``: the store and the airline stay, and every command it prints to
    explore them runs as printed (a shell, the console script on PATH, from another
    directory)."""
    kept = tmp_path / "kept"
    env = {k: v for k, v in os.environ.items() if k not in ("ADK_STORE", "ADK_DEMO_AIRLINE")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [sys.executable, "-m", "tesserix_adk", "demo", "--keep", str(kept)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "airline holds 1 booking(s) for run-1" in done.stdout
    assert "airline holds 1 booking(s) for run-2" in done.stdout
    assert "(exit 4)" in done.stdout
    assert (kept / "adk.sqlite3").is_file() and (kept / "airline.sqlite3").is_file()
    told = done.stdout.split("Explore them:\n", 1)[1].splitlines()
    commands = [line.strip() for line in told if line.startswith("  ")]
    assert sum(c.startswith("tesserix ") for c in commands) >= 4
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outputs = []
    for command in commands:
        ran = subprocess.run(
            ["bash", "-c", command],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, f"{command}: {ran.stdout}{ran.stderr}"
        outputs.append(ran.stdout)
    assert any("run-1" in o and "run-2" in o for o in outputs)  # runs
    assert any("nothing was done" in o for o in outputs)  # run --resume of a finished run
    assert sum(o.count("LH400") for o in outputs if "Ada Lovelace" in o) >= 2  # the airline
    again = subprocess.run(
        [sys.executable, "-m", "tesserix_adk", "demo", "--keep", str(kept)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and again.stderr.count("\n") == 1
