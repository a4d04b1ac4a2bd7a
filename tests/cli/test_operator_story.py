"""What an on-call engineer reads (issue 17): ``show``, ``--json`` everywhere, ``runs`` with
filters, a failed run's reason, and accepting a changed agent revision; the console script
run as a real subprocess against one SQLite store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from processes import AGENT, BACKENDS, TENANT, Site, held_open, store_url
from tesserix_adk import AgentRunner, Checkpointer
from tesserix_adk.stores.urls import open_stores

SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"

NEW_INSTRUCTIONS = textwrap.dedent(
    """
    from tesserix_adk import Agent
    from tesserix_adk.cli.demo_agent import PROVIDER, book_seat, search_flights

    agent = Agent(
        "booking",
        "Find the flight the user asks for and book one seat on it, politely.",
        [search_flights, book_seat],
        max_iterations=6,
    )
    """
)

NEW_FLAGS = textwrap.dedent(
    """
    from tesserix_adk import Agent, ToolContext, tool
    from tesserix_adk.cli.demo_agent import PROVIDER, search_flights


    @tool(idempotent=True)
    def book_seat(flight: str, passenger: str, *, ctx: ToolContext) -> dict:
        '''Book one seat on a flight for a passenger (side-effecting, keyed).'''
        raise AssertionError("never called: the upgrade is refused")


    agent = Agent(
        "booking",
        "Find the flight the user asks for and book one seat on it.",
        [search_flights, book_seat],
        max_iterations=6,
    )
    """
)

FAILING = textwrap.dedent(
    """
    from tesserix_adk import Agent
    from tesserix_adk.errors import ProviderError


    class Refused:
        async def complete(self, request):
            raise ProviderError("the model API refused the key (401 Unauthorized)")


    agent = Agent("failing", "Answer.")
    """
)

APPROVING = textwrap.dedent(
    """
    from tesserix_adk import Agent, ScriptedProvider, tool


    @tool(requires_approval=True)
    def refund(order: str) -> dict:
        '''Refund an order.'''
        return {"refunded": order}


    agent = Agent("refunds", "Refund what is asked.", [refund])
    PROVIDER = ScriptedProvider([[("refund", {"order": "o-42"})], "Refunded o-42."])
    """
)


@pytest.fixture
def site(tmp_path: Path) -> Site:
    site = Site(tmp_path)
    for name, text in (
        ("upgraded_agent", NEW_INSTRUCTIONS),
        ("changed_flags_agent", NEW_FLAGS),
        ("failing_agent", FAILING),
        ("approving_agent", APPROVING),
    ):
        (tmp_path / f"{name}.py").write_text(text)
    site.env = {**site.env, "PYTHONPATH": str(tmp_path)}
    return site


def _json(done: Any) -> Any:
    assert done.stderr == "" or done.returncode != 0, done.stderr
    return json.loads(done.stdout)


def _runner(stores: Any, provider: Any) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=Checkpointer.from_stores(stores),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
    )


def _in_process(site: Site, module: str, run_id: str, provider: Any = None) -> Any:
    sys.path.insert(0, str(site.tmp))
    loaded = __import__(module)

    async def start() -> Any:
        async with open_stores(site.store) as stores:
            chosen = provider or loaded.PROVIDER
            return await _runner(stores, chosen).run(
                loaded.agent, "go", tenant=TENANT, run_id=run_id
            )

    return loaded, asyncio.run(start())


def _carry_on(site: Site, run_id: str, *extra: str) -> Any:
    site.wait_lease_lapsed(run_id)
    return _carry_on_now(site, run_id, *extra)


def _carry_on_now(site: Site, run_id: str, *extra: str) -> Any:
    return site.tesserix("run", "--resume", run_id, "--tenant", TENANT, *extra)


@contextlib.contextmanager
def _held(site: Site, run_id: str) -> Iterator[None]:
    """Another worker holds the run's lease meanwhile."""

    async def acquire() -> Any:
        async with open_stores(site.store) as stores:
            return await stores.leases.acquire(TENANT, run_id, "someone-else", 60)

    lease = asyncio.run(acquire())
    try:
        yield
    finally:

        async def release() -> None:
            async with open_stores(site.store) as stores:
                await stores.leases.release(lease)

        asyncio.run(release())


# --- show ---------------------------------------------------------------------------------


def test_show_tells_a_replayed_call_with_its_key_digest_fences_and_spend(site: Site) -> None:
    site.kill_at("r", "booked")
    assert _carry_on(site, "r", "--agent", AGENT).returncode == 0
    told = _json(site.tesserix("show", "r", "--tenant", TENANT, "--json"))
    calls = {c["tool"]: c for c in told["calls"]}
    assert calls["book_seat"]["disposition"] == "replayed"
    assert calls["search_flights"]["disposition"] == "dispatched"
    raw_key = site_key(site, "r")
    assert calls["book_seat"]["key_digest"].startswith("sha256:")
    assert raw_key not in json.dumps(told)
    assert [f["fence"] for f in told["fences"]] == [1, 2]
    assert told["spent"]["micros"] == 1400 + 1700 + 1800
    assert [s["step"] for s in told["steps"]] == sorted(s["step"] for s in told["steps"])
    assert told["steps"][0]["boundary"] == "after_model_call"
    assert [t["calls"][0]["tool"] for t in told["turns"][:2]] == ["search_flights", "book_seat"]
    assert any("lease store keeps only the live lease" in n for n in told["not_kept"])
    text = site.tesserix("show", "r", "--tenant", TENANT)
    assert text.returncode == 0, text.stderr
    assert "book_seat (call_1_0) key sha256:" in text.stdout and "replayed" in text.stdout
    assert raw_key not in text.stdout
    only = _json(site.tesserix("show", "r", "--tenant", TENANT, "--step", "1", "--json"))
    assert [s["step"] for s in only["steps"]] == [1]
    assert [c["tool"] for c in only["calls"]] == ["search_flights"]
    missing = site.tesserix("show", "r", "--tenant", TENANT, "--step", "99")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr


def site_key(site: Site, run_id: str) -> str:
    async def key() -> str:
        async with open_stores(site.store) as stores:
            records = await stores.idempotency.records(TENANT, run_id)
            return next(r.key for r in records if r.tool == "book_seat")

    return asyncio.run(key())


def test_show_names_who_resolved_a_call_and_who_approved_one(site: Site) -> None:
    site.kill_at("r", "in_flight")
    site.wait_lease_lapsed("r")
    resolved = site.tesserix(
        "resolve", "r", "--tenant", TENANT, "--call", "call_1_0",
        "--outcome", json.dumps({"booking_id": "BK-1", "seen": f"the key {SECRET} works"}),
        "--by", "alice", "--json",
    )  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    assert _json(resolved)["resolved_as"] == "completed" and _json(resolved)["by"] == "alice"
    assert _carry_on(site, "r", "--agent", AGENT).returncode == 0
    told = _json(site.tesserix("show", "r", "--tenant", TENANT, "--json"))
    book = next(c for c in told["calls"] if c["tool"] == "book_seat")
    assert book["disposition"] == "resolved" and book["by"] == "alice"
    assert book["outcome"]["booking_id"] == "BK-1"
    assert SECRET not in json.dumps(told)  # the outcome is shown as stored: redacted
    assert SECRET not in site.tesserix("show", "r", "--tenant", TENANT).stdout

    _, run = _in_process(site, "approving_agent", "rf")
    request = run.pending_approval.id
    approved = site.tesserix(
        "approve", request, "--tenant", TENANT, "--by", "bob", "--note", "ok", "--json"
    )
    assert _json(approved)["status"] == "approved" and _json(approved)["decided_at"].endswith("Z")
    done = _carry_on(site, "rf", "--agent", "approving_agent:agent", "--json")
    assert done.returncode == 0, done.stderr
    assert _json(done)["status"] == "completed" and _json(done)["output"] == "Refunded o-42."
    told = _json(site.tesserix("show", "rf", "--tenant", TENANT, "--json"))
    assert [(a["id"], a["status"], a["by"], a["note"]) for a in told["approvals"]] == [
        (request, "approved", "bob", "ok")
    ]
    (refund,) = told["calls"]
    assert refund["approval"] == {"request": request, "approved": True, "by": "bob"}
    text = site.tesserix("show", "rf", "--tenant", TENANT).stdout
    assert f"approval {request} approved by bob: ok" in text
    assert "refund (call_0_0) key sha256:" in text and "approved by bob" in text


# --- --json -------------------------------------------------------------------------------


def test_json_on_inspect_steps_runs_and_schema_and_an_error_as_json(site: Site) -> None:
    site.kill_at("r", "model_call")
    site.wait_lease_lapsed("r")
    with _held(site, "r"):
        lease = _json(site.tesserix("inspect", "r", "--tenant", TENANT, "--json"))["lease"]
        assert lease["holder"] == "someone-else" and lease["expires_at"].endswith("Z")
        runs_lease = _json(site.tesserix("runs", "--tenant", TENANT, "--json"))["runs"][0]
        assert runs_lease["lease"]["expires_at"] == lease["expires_at"]
    seen = _json(site.tesserix("inspect", "r", "--tenant", TENANT, "--json"))
    for field in ("run_id", "status", "step", "written_at", "lease", "resume_claim", "reason"):
        assert field in seen
    assert seen["written_at"].endswith("Z") and seen["calls"][0]["key_digest"].startswith("sha")
    steps = _json(site.tesserix("steps", "r", "--tenant", TENANT, "--json"))
    assert [s["step"] for s in steps["steps"]] == [1, 2, 3]
    assert steps["steps"][0]["written_at"].endswith("Z") and steps["steps"][0]["fence"] == 1
    assert "CREATE TABLE" in _json(site.tesserix("schema", "show", "--json"))["schema"]
    held = site.tesserix("runs", "--tenant", TENANT, "--json")
    row = _json(held)["runs"][0]
    assert row["run_id"] == "r" and row["updated_at"].endswith("Z")
    for args, code in (
        (("inspect", "nope", "--tenant", TENANT, "--json"), 1),
        (("show", "nope", "--tenant", TENANT, "--json"), 1),
        (("approve", "no-such", "--tenant", TENANT, "--by", "x", "--json"), 1),
    ):
        failed = site.tesserix(*args)
        assert failed.returncode == code
        error = json.loads(failed.stdout)["error"]
        assert error["exit_code"] == code and args[1] in error["message"]
        assert failed.stderr.count("\n") == 1 and "Traceback" not in failed.stderr


# --- runs ---------------------------------------------------------------------------------


def test_runs_says_no_runs_then_filters_limits_and_heads_its_table(site: Site) -> None:
    empty = site.tesserix("runs", "--tenant", TENANT)
    assert empty.returncode == 0 and empty.stdout == "no runs\n"
    site.kill_at("old", "model_call")
    site.kill_at("new", "booked")
    assert _carry_on(site, "new", "--agent", AGENT).returncode == 0
    headed = site.tesserix("runs", "--tenant", TENANT, "--header").stdout.splitlines()
    assert headed[0].split() == ["RUN", "AGENT", "STATUS", "UPDATED", "NOTES"]
    assert [line.split()[0] for line in headed[1:]] == ["new", "old"]  # newest first
    assert headed[1].split()[6].endswith("Z")  # new  booking  completed at step N  TIME
    limited = site.tesserix("runs", "--tenant", TENANT, "--limit", "1").stdout.splitlines()
    assert [line.split()[0] for line in limited] == ["new"]
    done = site.tesserix("runs", "--tenant", TENANT, "--status", "completed").stdout
    assert [line.split()[0] for line in done.splitlines()] == ["new"]
    assert site.tesserix("runs", "--tenant", TENANT, "--agent", "other").stdout == "no runs\n"
    assert (
        len(site.tesserix("runs", "--tenant", TENANT, "--agent", "booking").stdout.split("\n")) == 3
    )
    assert len(site.tesserix("runs", "--tenant", TENANT, "--since", "1h").stdout.splitlines()) == 2
    future = site.tesserix("runs", "--tenant", TENANT, "--since", "2999-01-01T00:00:00Z")
    assert future.stdout == "no runs\n"
    bad = site.tesserix("runs", "--tenant", TENANT, "--since", "yesterday")
    assert bad.returncode == 2 and "ISO 8601" in bad.stderr
    assert site.tesserix("runs", "--tenant", TENANT, "--limit", "0").returncode == 2


# --- a failed run -------------------------------------------------------------------------


def test_a_failed_run_shows_why_in_inspect_show_and_json(site: Site) -> None:
    _, run = _in_process(site, "failing_agent", "f", provider=_refused(site))
    assert str(run.status) == "failed"
    why = "401 Unauthorized"
    seen = site.tesserix("inspect", "f", "--tenant", TENANT)
    assert seen.returncode == 0 and "failed at step" in seen.stdout and why in seen.stdout
    assert why in _json(site.tesserix("inspect", "f", "--tenant", TENANT, "--json"))["reason"]
    assert why in _json(site.tesserix("show", "f", "--tenant", TENANT, "--json"))["reason"]
    assert why in site.tesserix("show", "f", "--tenant", TENANT).stdout
    stuck = site.tesserix("runs", "--tenant", TENANT, "--stuck").stdout
    assert stuck.startswith("f ") and why in stuck


def _refused(site: Site) -> Any:
    sys.path.insert(0, str(site.tmp))
    return __import__("failing_agent").Refused()


# --- accepting a changed revision ---------------------------------------------------------


def test_accept_revision_carries_a_changed_revision_run_on_and_audits_it(site: Site) -> None:
    site.kill_at("r", "model_call")
    site.wait_lease_lapsed("r")
    upgraded = "upgraded_agent:agent"
    refused = _carry_on(site, "r", "--agent", upgraded)
    assert refused.returncode == 4 and "revision" in refused.stderr
    stuck = site.tesserix("runs", "--tenant", TENANT, "--stuck", "--agent", upgraded).stdout
    assert stuck.startswith("r ") and "needs agent revision sha256:" in stuck
    assert "--accept-revision" in stuck
    assert _carry_on(site, "r", "--agent", upgraded, "--accept-revision").returncode == 2
    as_json = _carry_on(site, "r", "--agent", upgraded, "--json")
    assert as_json.returncode == 4 and json.loads(as_json.stdout)["error"]["exit_code"] == 4
    with _held(site, "r"):
        held = _carry_on_now(site, "r", "--agent", upgraded, "--accept-revision", "--by", "x")
        assert held.returncode == 3 and "someone-else" in held.stderr
    done = _carry_on(
        site, "r", "--agent", upgraded, "--accept-revision", "--by", "carol",
        "--note", f"instructions reworded only; {SECRET}", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = _json(done)
    assert said["status"] == "completed" and said["accepted_revision"]["by"] == "carol"
    assert site.bookings("r") == 1
    told = _json(site.tesserix("show", "r", "--tenant", TENANT, "--json"))
    (accepted,) = told["accepted_revisions"]
    assert accepted["by"] == "carol"
    assert accepted["note"].startswith("instructions reworded only;") and SECRET not in json.dumps(
        told
    )
    assert accepted["from_revision"] != accepted["to_revision"] == told["revision"]
    assert "accepted as" in site.tesserix("show", "r", "--tenant", TENANT).stdout
    assert site.tesserix("runs", "--tenant", TENANT, "--stuck", "--agent", upgraded).stdout == (
        "no runs\n"
    )


def test_accept_revision_is_refused_when_a_tool_flag_changed(site: Site) -> None:
    site.kill_at("r", "in_flight")
    site.wait_lease_lapsed("r")
    before = _json(site.tesserix("inspect", "r", "--tenant", TENANT, "--json"))
    done = _carry_on(
        site, "r", "--agent", "changed_flags_agent:agent", "--accept-revision", "--by", "carol"
    )
    assert done.returncode == 4
    assert "book_seat (call_1_0)" in done.stderr and "idempotent was False, now True" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    after = _json(site.tesserix("inspect", "r", "--tenant", TENANT, "--json"))
    assert after["revision"] == before["revision"] and after["step"] == before["step"]
    assert (
        _json(site.tesserix("show", "r", "--tenant", TENANT, "--json"))["accepted_revisions"] == []
    )
    assert site.bookings("r") == 1  # the one the killed holder made; nothing re-sent


def test_a_worker_parks_a_changed_revision_run_and_never_accepts_it_itself(site: Site) -> None:
    site.kill_at("r", "model_call")
    site.wait_lease_lapsed("r")
    worker = site.tesserix(
        "worker", "--agent", "upgraded_agent:agent", "--exit-when-idle", "--lease-ttl", "2"
    )
    assert worker.returncode == 0, worker.stderr
    assert site.bookings("r") == 0
    seen = _json(site.tesserix("inspect", "r", "--tenant", TENANT, "--json"))
    assert "RevisionMismatchError" in seen["parked"] and seen["step"] == 3
    stuck = site.tesserix("runs", "--tenant", TENANT, "--stuck").stdout
    assert stuck.startswith("r ") and f"needs agent revision {seen['revision']}" in stuck
    row = _json(site.tesserix("runs", "--tenant", TENANT, "--stuck", "--json"))["runs"][0]
    assert row["blocked"].startswith(f"needs agent revision {seen['revision']}")
    assert (
        _json(site.tesserix("show", "r", "--tenant", TENANT, "--json"))["accepted_revisions"] == []
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_show_and_accept_revision_on_every_backend(tmp_path: Path, backend: str) -> None:
    with held_open(store_url(backend, tmp_path)) as url:
        site = Site(tmp_path, store=url)
        (tmp_path / "upgraded_agent.py").write_text(NEW_INSTRUCTIONS)
        site.env = {**site.env, "PYTHONPATH": str(tmp_path)}
        site.kill_at("r", "model_call")
        done = _carry_on(
            site, "r", "--agent", "upgraded_agent:agent", "--accept-revision", "--by", "dan"
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("revision sha256:") and "by dan" in done.stdout
        assert site.bookings("r") == 1
        told = _json(site.tesserix("show", "r", "--tenant", TENANT, "--json"))
        assert told["status"] == "completed" and told["accepted_revisions"][0]["by"] == "dan"
        assert {c["tool"]: c["disposition"] for c in told["calls"]} == {
            "search_flights": "dispatched",
            "book_seat": "dispatched",
        }
        assert told["spent"]["micros"] == 1400 + 1700 + 1800
        assert [f["fence"] for f in told["fences"]][-1] >= 2
