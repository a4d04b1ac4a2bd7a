"""Attacks on the console's promises (README, "The console"): one tenant at a time, the
tenant of the address in every read and decision; nothing secret shown, idempotency keys
only as a short digest; loopback Host only (or the token on every request); every change
needs the page's CSRF token and this console's Origin; decisions run the CLI's commands,
checked; bad input gets a clear 4xx and loses nothing.

Tests marked ``xfail(strict=True)`` show a defect found by these attacks: they fail now and
pass once it is fixed. The others are promises that held, kept as regression tests."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_world import OTHER, SECRET, TENANT, WAIT_TURNS, World, runner, served
from starlette.testclient import TestClient

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.messages import Message, ToolCall
from tesserix_adk.providers.base import ModelResponse
from tesserix_adk.stores.protocols import ApprovalStatus, RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash

BASE = "http://127.0.0.1:8765"
ORIGIN = {"origin": BASE}
MARKUP = "<script>alert(1)</script>"
RAW_KEY = re.compile(r"k1:[0-9a-f]{64}")


# --- helpers ------------------------------------------------------------------------------


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _client(app: Any, **kwargs: Any) -> TestClient:
    return TestClient(app, base_url=BASE, raise_server_exceptions=False, **kwargs)


def _csrf(client: Any, path: str = "/") -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    cookie = client.cookies.get("tesserix_csrf")
    assert cookie is not None and len(cookie) == 64
    return str(cookie)


def _said(response: Any) -> str:
    found = re.search(r'<p (?:id="said"|class="refused")[^>]*>(.*?)</p>', response.text, re.S)
    return "" if found is None else found.group(1)


async def _waiting(url: str, tenant: str = TENANT, run_id: str = "r-wait") -> str:
    """A run of ``tenant`` waiting on approval (no secret in it); its request id."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        run = await runner(stores, WAIT_TURNS).run(
            World().approver(), "book", tenant=tenant, run_id=run_id
        )
        assert run.status is RunStatus.waiting_approval
        cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        assert cp is not None and cp.pending_approval is not None
        return cp.pending_approval.id


async def _approval(url: str, tenant: str, request_id: str) -> ApprovalStatus:
    async with open_stores(url) as stores:
        got = await stores.approvals.get(tenant, request_id)
        assert got is not None
        return got.status


async def _status(url: str, tenant: str, run_id: str) -> str:
    async with open_stores(url) as stores:
        cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        assert cp is not None
        return str(cp.status)


async def _in_flight_call(url: str, run_id: str, call_id: str) -> str:
    """A call in flight under ``run_id`` of acme whose holder is gone, and no lease ever
    held on the run (so ``--never-ran`` needs no margin); its idempotency key."""
    key = f"k1:{run_id}-{call_id}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        await stores.idempotency.claim(
            key,
            holder="worker-dead",
            tenant=TENANT,
            run_id=run_id,
            iteration=0,
            tool="charge",
            call_id=call_id,
            flags=None,
        )
    return key


async def _record(url: str, run_id: str) -> Any:
    async with open_stores(url) as stores:
        (rec,) = [r for r in await stores.idempotency.records(TENANT, run_id) if r.tool]
        return rec


class _FixedIds(ScriptedProvider):
    """A model that gives every tool call the same id (``""``: none at all), as some
    providers and adapters do."""

    def __init__(self, turns: list[Any], call_id: str) -> None:
        super().__init__(turns)
        self.call_id = call_id

    async def complete(self, request: Any) -> ModelResponse:
        said = await super().complete(request)
        calls = [
            ToolCall(id=self.call_id, name=c.name, arguments=c.arguments)
            for c in said.message.tool_calls
        ]
        return ModelResponse(
            message=Message.assistant(said.message.text, calls),
            usage=said.usage,
            cost_micros=said.cost_micros,
        )


def _payer(crash_at: int) -> Agent:
    done = {"n": 0}

    @tool
    def charge(amount: int, ctx: Any, password: str | None = None) -> dict[str, int]:
        """Charge (dies on the ``crash_at``-th call, leaving it in flight)."""
        done["n"] += 1
        if done["n"] == crash_at:
            raise SimulatedCrash("died while charging")
        return {"charged": amount}

    return Agent("payer", "Pay.", [charge])


_SHORT_LEASE = LeasePolicy(ttl=0.5, renew_within=0.2)


async def _crashed(url: str, call_id: str, turns: list[Any], crash_at: int) -> None:
    """Run r-dup of acme with every call id ``call_id``, dying in its ``crash_at``-th call."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        pay = AgentRunner.from_stores(
            _FixedIds(turns, call_id), stores, lease_policy=_SHORT_LEASE, never_ran_margin=0.05
        )
        with contextlib.suppress(SimulatedCrash):
            await pay.run(_payer(crash_at), "pay", tenant=TENANT, run_id="r-dup")


# --- one tenant at a time ---------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        "ACME",
        "Acme",
        "acme ",
        " acme",
        "acme\x00",
        "\uff41\uff43\uff4d\uff45",
        "acme\u200b",
        "acme/",
    ],
)
def test_a_tenant_spelt_another_way_sees_and_decides_nothing_of_acme(
    store_url: str, variant: str
) -> None:
    request_id = asyncio.run(_approval_of_wait(store_url))
    with _client(create_app(store_url)) as client:
        # 400: an address holding NUL, which no tenant does, is refused as bad input.
        listing = client.get(tenant_path(variant, "runs"))
        assert listing.status_code in (200, 404, 400)
        assert "r-wait" not in listing.text and "r-park" not in listing.text
        page = client.get(tenant_path(variant, "runs", "r-wait"))
        assert page.status_code in (404, 400) and (page.status_code == 400) == ("\x00" in variant)
        csrf = _csrf(client)
        answer = client.post(
            tenant_path(variant, "approvals", request_id),
            data={"csrf": csrf, "by": "mallory", "decision": "approve"},
            headers=ORIGIN,
        )
        assert 400 <= answer.status_code < 500
    assert asyncio.run(_approval(store_url, TENANT, request_id)) is ApprovalStatus.pending


async def _approval_of_wait(url: str) -> str:
    async with open_stores(url) as stores:
        cp = await Checkpointer.from_stores(stores).latest(TENANT, "r-wait")
        assert cp is not None and cp.pending_approval is not None
        return cp.pending_approval.id


def test_dot_segments_and_encoded_slashes_in_a_run_id_stay_in_the_tenant(store_url: str) -> None:
    with _client(create_app(store_url)) as client:
        for path in (
            f"/t/{TENANT}/runs/..%2F..%2F{OTHER}%2Fruns%2Fr-other",
            f"/t/{TENANT}/runs/%2E%2E/%2E%2E/{OTHER}/runs/r-other",
            f"/t/{TENANT}/runs/%2e%2e%2f%2e%2e%2f{OTHER}%2fruns%2fr-other",
        ):
            page = client.get(path)
            assert page.status_code == 404, path
            assert "api_key" not in page.text and "Waiting on approval" not in page.text


async def _slashed(url: str) -> None:
    """Tenant ``acme/eu`` has run ``r1``; tenant ``acme/runs/eu`` has run ``r1``; tenant
    ``acme`` has run ``eu/runs/r1``: the address of the second, decoded, reads as the third."""
    await _waiting(url, tenant="acme/eu", run_id="r1")
    await _waiting(url, tenant="acme/runs/eu", run_id="r1")
    await _waiting(url, tenant=TENANT, run_id="eu/runs/r1")


def test_a_tenant_with_a_slash_is_shown_under_its_own_name(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_slashed(url))
    with _client(create_app(url)) as client:
        listing = client.get(tenant_path("acme/eu", "runs"))
        assert listing.status_code == 200 and ">r1</a>" in listing.text
        page = client.get(tenant_path("acme/eu", "runs", "r1"))
        assert page.status_code == 200
        assert "<dt>tenant</dt><dd>acme/eu</dd>" in page.text


def test_a_read_for_a_slashed_tenant_never_shows_another_tenant(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_slashed(url))
    with _client(create_app(url)) as client:
        page = client.get(tenant_path("acme/runs/eu", "runs", "r1"))
        assert "<dt>tenant</dt><dd>acme</dd>" not in page.text
        assert page.status_code == 200
        assert "<dt>tenant</dt><dd>acme/runs/eu</dd>" in page.text


def test_a_decision_for_a_slashed_tenant_never_lands_in_another_tenant(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_slashed(url))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        client.post(
            tenant_path("acme/runs/eu", "runs", "r1") + "/cancel",
            data={"csrf": csrf, "by": "mallory"},
            headers=ORIGIN,
        )
    assert asyncio.run(_status(url, TENANT, "eu/runs/r1")) == "waiting_approval"


def test_run_ids_ending_like_an_action_reach_their_own_run(tmp_path: Path) -> None:
    url = _url(tmp_path)
    for run_id in ("x", "x/cancel", "x/resolve"):
        asyncio.run(_waiting(url, run_id=run_id))
    with _client(create_app(url)) as client:
        for run_id in ("x", "x/cancel", "x/resolve"):
            page = client.get(tenant_path(TENANT, "runs", run_id))
            assert page.status_code == 200
            assert f"<h1>Run <code>{run_id}</code></h1>" in page.text
        csrf = _csrf(client)
        done = client.post(
            tenant_path(TENANT, "runs", "x/resolve") + "/cancel",
            data={"csrf": csrf, "by": "erin"},
            headers=ORIGIN,
        )
        assert done.status_code == 200, done.text
    assert asyncio.run(_status(url, TENANT, "x/resolve")) == "cancelled"
    assert asyncio.run(_status(url, TENANT, "x")) == "waiting_approval"
    assert asyncio.run(_status(url, TENANT, "x/cancel")) == "waiting_approval"


def test_reads_with_odd_ids_are_never_a_server_error(store_url: str) -> None:
    with _client(create_app(store_url)) as client:
        for path in (
            "/t/acme%00/runs",
            "/t/acme/runs/x%00y",
            "/t/acme/runs/x%0D%0Ay",
            "/t/" + "a" * 4000 + "/runs",
            "/t/acme/runs/" + "b" * 4000,
            "/t/acme/runs?status=%00&agent=%FF&stuck=%FF",
            "/t/acme/runs/%F0%9F%98%80",
            "/t/%ED%A0%80/runs",  # a lone surrogate: not UTF-8
            "/t/acme/runs/%FF",
            "/tenant?tenant=%FF",
        ):
            answer = client.get(path, follow_redirects=False)
            assert answer.status_code < 500, (path, answer.status_code)


# --- loopback Host, token ---------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "localhost.evil.test",
        "127.0.0.1.nip.io",
        "evil.test",
        "evil.test:8765",
        "localhost.",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0.0.0.0",
        "[::]",
        "[::ffff:127.0.0.1]",
        "127.0.0.1:80@evil.test",
        "evil.test#@127.0.0.1",
        "evil.test?@127.0.0.1",
        "127.0.0.1 evil.test",
        "",
    ],
)
def test_a_host_that_only_looks_local_is_refused(store_url: str, host: str) -> None:
    with _client(create_app(store_url)) as client:
        answer = client.get(f"/t/{TENANT}/runs", headers={"host": host})
        assert answer.status_code == 421
        assert "r-wait" not in answer.text


@pytest.mark.parametrize("host", ["localhost:8765", "127.0.0.2", "[::1]:8765", "LOCALHOST"])
def test_loopback_names_are_served(store_url: str, host: str) -> None:
    with _client(create_app(store_url)) as client:
        assert client.get(f"/t/{TENANT}/runs", headers={"host": host}).status_code == 200


def test_a_malformed_host_with_a_loopback_tail_is_refused(store_url: str) -> None:
    with _client(create_app(store_url)) as client:
        answer = client.get(f"/t/{TENANT}/runs", headers={"host": "evil.test\\@localhost"})
        assert answer.status_code in (400, 421)


TOKEN = "s3cret-console-token-0123456789"


def test_the_token_is_needed_and_never_shown(store_url: str) -> None:
    app = create_app(store_url, token=TOKEN, loopback_only=False)
    with _client(app) as client:
        for given in (
            {},
            {"authorization": "Bearer " + TOKEN[:-1]},
            {"authorization": "Bearer " + TOKEN + "x"},
            {"authorization": "Bearer " + TOKEN.upper()},
            {"authorization": "Basic " + TOKEN},
            {"authorization": TOKEN},
            {"cookie": "tesserix_token=" + TOKEN[:-1]},
        ):
            answer = client.get(f"/t/{TENANT}/runs", headers=given, follow_redirects=False)
            assert answer.status_code == 303 and answer.headers["location"] == "/login"
        sneaky = client.get(f"/t/{TENANT}/runs?token={TOKEN}", follow_redirects=False)
        assert sneaky.status_code == 303
        static = client.get("/static/console.css", follow_redirects=False)
        assert static.status_code == 303
        # Refused changes get no redirect and no page: 401/403, nothing done.
        refused = client.post(f"/t/{TENANT}/runs/r-wait/cancel", data={"by": "x"}, headers=ORIGIN)
        assert refused.status_code in (401, 403)
        # With it, no page, header or redirect carries it back.
        csrf = _csrf(client, "/login")
        bad = client.post("/login", data={"csrf": csrf, "token": "nope"}, headers=ORIGIN)
        assert bad.status_code == 401 and "nope" not in bad.text
        good = client.post(
            "/login",
            data={"csrf": csrf, "token": TOKEN, "next": "https://evil.test/"},
            headers=ORIGIN,
            follow_redirects=False,
        )
        assert good.status_code == 303 and good.headers["location"] == "/"
        cookie = good.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        for path in ("/", "/login", f"/t/{TENANT}/runs", f"/t/{TENANT}/runs/r-wait"):
            page = client.get(path)
            assert page.status_code == 200
            assert TOKEN not in page.text
            assert all(TOKEN not in v for k, v in page.headers.items() if k != "set-cookie")


def test_the_login_form_cannot_be_posted_from_another_site(store_url: str) -> None:
    app = create_app(store_url, token=TOKEN, loopback_only=False)
    with _client(app) as client:
        csrf = _csrf(client, "/login")
        for headers in ({"origin": "http://evil.test"}, {"origin": "null"}, {}):
            answer = client.post("/login", data={"csrf": csrf, "token": TOKEN}, headers=headers)
            assert answer.status_code == 403
            assert (
                "set-cookie" not in answer.headers
                or "tesserix_token" not in (answer.headers["set-cookie"])
            )


# --- CSRF and Origin ----------------------------------------------------------------------


def test_no_change_without_this_pages_token_and_origin(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    approve = f"/t/{TENANT}/approvals/{request_id}"
    cancel = f"/t/{TENANT}/runs/r-wait/cancel"
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        form = {"csrf": csrf, "by": "mallory", "decision": "approve"}
        refused = [
            client.post(approve, data=form, headers={"origin": "null"}),
            client.post(approve, data=form, headers={"origin": "http://127.0.0.1:8766"}),
            client.post(approve, data=form, headers={"origin": "http://127.0.0.1:8765.evil.test"}),
            client.post(approve, data=form, headers={"origin": "http://evil.test@127.0.0.1:8765"}),
            client.post(approve, data=form, headers={"referer": "http://evil.test/x"}),
            client.post(
                approve,
                data=form,
                headers={"origin": "http://evil.test", "referer": BASE + "/"},
            ),
            client.post(approve + f"?csrf={csrf}", data={**form, "csrf": ""}, headers=ORIGIN),
            client.post(approve, data={**form, "csrf": csrf.upper()}, headers=ORIGIN),
            client.post(
                approve,
                data=form,
                headers={**ORIGIN, "cookie": "tesserix_csrf=" + "0" * 64},
            ),
            client.post(
                approve, files={"csrf": (None, csrf), "by": (None, "mallory")}, headers=ORIGIN
            ),
            client.post(approve, json=form, headers=ORIGIN),
        ]
        assert [r.status_code for r in refused] == [403] * 9 + [415, 415]
        # GET (or a method override) never changes anything.
        gets = [
            client.get(cancel, params={"csrf": csrf, "by": "mallory"}),
            client.get(approve, params=form),
            client.get(approve, params=form, headers={"x-http-method-override": "POST"}),
            client.post(f"/t/{TENANT}/runs/r-wait?_method=POST", data=form, headers=ORIGIN),
            client.put(cancel, data=form, headers=ORIGIN),
            client.delete(f"/t/{TENANT}/runs/r-wait"),
        ]
        assert [r.status_code for r in gets] == [404, 405, 405, 405, 405, 405]
        # Referer alone, of this very console, is taken (a browser that sends no Origin).
        taken = client.post(cancel, data={"csrf": csrf, "by": "erin"}, headers={"referer": BASE})
        assert taken.status_code == 200
    assert asyncio.run(_approval(url, TENANT, request_id)) is ApprovalStatus.pending


# --- decisions: checked, typed, once ------------------------------------------------------


@pytest.mark.parametrize("decision", [None, "Deny", "reject"])
def test_an_unknown_decision_word_is_refused_not_taken_as_approve(
    tmp_path: Path, decision: str | None
) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        form = {"csrf": csrf, "by": "op"}
        if decision is not None:
            form["decision"] = decision
        answer = client.post(f"/t/{TENANT}/approvals/{request_id}", data=form, headers=ORIGIN)
        assert 400 <= answer.status_code < 500
    assert asyncio.run(_approval(url, TENANT, request_id)) is ApprovalStatus.pending


def test_a_resolution_that_does_not_say_what_happened_is_refused(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight_call(url, "r-ghost", "c9"))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        answer = client.post(
            f"/t/{TENANT}/runs/r-ghost/resolve",
            data={"csrf": csrf, "by": "op", "call": "c9"},
            headers=ORIGIN,
        )
        assert 400 <= answer.status_code < 500
    assert asyncio.run(_record(url, "r-ghost")).status is RecordStatus.in_flight


@pytest.mark.parametrize("outcome", ["{bad", "", "[1,", '{"a": 1} trailing'])
def test_an_outcome_that_is_not_json_is_refused_and_the_call_stays_in_doubt(
    tmp_path: Path, outcome: str
) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight_call(url, "r-ghost", "c9"))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        answer = client.post(
            f"/t/{TENANT}/runs/r-ghost/resolve",
            data={"csrf": csrf, "by": "op", "call": "c9", "what": "outcome", "outcome": outcome},
            headers=ORIGIN,
        )
        assert answer.status_code == 409 and "not valid JSON" in answer.text
    assert asyncio.run(_record(url, "r-ghost")).status is RecordStatus.in_flight


@pytest.mark.parametrize("outcome", ["NaN", '{"charged": Infinity}'])
def test_an_outcome_with_non_json_numbers_is_refused(tmp_path: Path, outcome: str) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight_call(url, "r-ghost", "c9"))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        answer = client.post(
            f"/t/{TENANT}/runs/r-ghost/resolve",
            data={"csrf": csrf, "by": "op", "call": "c9", "what": "outcome", "outcome": outcome},
            headers=ORIGIN,
        )
        assert 400 <= answer.status_code < 500
    assert asyncio.run(_record(url, "r-ghost")).status is RecordStatus.in_flight


def test_an_outcome_with_a_secret_is_recorded_and_shown_masked(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight_call(url, "r-ghost", "c9"))
    outcome = f'{{"password": "{SECRET}", "said": "key {SECRET} {MARKUP}"}}'
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        answer = client.post(
            f"/t/{TENANT}/runs/r-ghost/resolve",
            data={"csrf": csrf, "by": "op", "call": "c9", "what": "outcome", "outcome": outcome},
            headers=ORIGIN,
        )
        assert answer.status_code == 200, answer.text
        assert SECRET not in answer.text and "PLANTED" not in answer.text
        again = client.post(
            f"/t/{TENANT}/runs/r-ghost/resolve",
            data={"csrf": csrf, "by": "op2", "call": "c9", "what": "never_ran"},
            headers=ORIGIN,
        )
        assert again.status_code == 409 and "not in flight" in again.text
    rec = asyncio.run(_record(url, "r-ghost"))
    assert rec.status is RecordStatus.completed and rec.by == "op"
    assert rec.outcome is not None and b"PLANTED" not in bytes(rec.outcome)


def test_two_resolutions_racing_record_exactly_one(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight_call(url, "r-ghost", "c9"))
    start = threading.Barrier(2)

    def resolve(base: str, who: str) -> httpx.Response:
        with httpx.Client(base_url=base) as client:
            client.get("/")
            csrf = client.cookies["tesserix_csrf"]
            start.wait(10)
            return client.post(
                f"/t/{TENANT}/runs/r-ghost/resolve",
                data={
                    "csrf": csrf,
                    "by": who,
                    "call": "c9",
                    "what": "outcome",
                    "outcome": f'{{"by": "{who}"}}',
                },
                headers={"origin": base},
            )

    with served(create_app(url)) as base, ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda who: resolve(base, who), ["carol", "dave"]))
    codes = sorted(a.status_code for a in answers)
    # The loser meets the decision made (409), or the winner still holding the run while
    # it records it: the CLI's exit 3, "retry later" (503).
    assert codes in ([200, 409], [200, 503]), [a.text[-600:] for a in answers]
    winner = ["carol", "dave"][[a.status_code for a in answers].index(200)]
    rec = asyncio.run(_record(url, "r-ghost"))
    assert rec.status is RecordStatus.completed and rec.by == winner
    assert rec.outcome is not None and f'"by":"{winner}"' in bytes(rec.outcome).decode()


def test_approve_and_deny_racing_decide_once(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    start = threading.Barrier(2)

    def decide(base: str, decision: str) -> httpx.Response:
        with httpx.Client(base_url=base) as client:
            client.get("/")
            csrf = client.cookies["tesserix_csrf"]
            start.wait(10)
            return client.post(
                f"/t/{TENANT}/approvals/{request_id}",
                data={"csrf": csrf, "by": decision + "-er", "decision": decision},
                headers={"origin": base},
            )

    with served(create_app(url)) as base, ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda d: decide(base, d), ["approve", "deny"]))
    codes = [a.status_code for a in answers]
    assert sorted(codes) == [200, 409], [a.text for a in answers]
    won = ["approve", "deny"][codes.index(200)]
    final = asyncio.run(_approval(url, TENANT, request_id))
    assert final is (ApprovalStatus.approved if won == "approve" else ApprovalStatus.denied)
    assert "already decided the other way" in answers[codes.index(409)].text


def test_approving_the_request_of_a_cancelled_run_is_refused(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        cancelled = client.post(
            f"/t/{TENANT}/runs/r-wait/cancel", data={"csrf": csrf, "by": "erin"}, headers=ORIGIN
        )
        assert cancelled.status_code == 200
        # Another operator, on the page as it was before the cancel.
        late = client.post(
            f"/t/{TENANT}/approvals/{request_id}",
            data={"csrf": csrf, "by": "frank", "decision": "approve"},
            headers=ORIGIN,
        )
        assert late.status_code == 409
    assert asyncio.run(_approval(url, TENANT, request_id)) is ApprovalStatus.pending


def test_a_second_cancel_keeps_the_first_request_on_record(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        for who in ("erin", "mallory"):
            answer = client.post(
                f"/t/{TENANT}/runs/r-wait/cancel",
                data={"csrf": csrf, "by": who, "reason": f"by {who}"},
                headers=ORIGIN,
            )
            assert answer.status_code == 200
        page = client.get(f"/t/{TENANT}/runs/r-wait").text
        assert "cancelled by erin: by erin" in page and "by mallory" not in page
        assert 'class="cancel"' not in page  # a finished run offers no cancel form
        nothing = client.post(
            f"/t/{TENANT}/runs/never-was/cancel", data={"csrf": csrf, "by": "x"}, headers=ORIGIN
        )
        assert nothing.status_code == 409


# --- nothing secret shown; keys only as a digest -----------------------------------------


async def _planted(url: str) -> None:
    """Secrets and markup in a run id, agent name, input, tool args, tool result, a tool's
    error and the final output."""

    @tool
    def lookup(q: str) -> dict[str, str]:
        """Look up."""
        return {"token": SECRET, "html": MARKUP, "text": f"your key is {SECRET} {MARKUP}"}

    @tool
    def explode(q: str) -> dict[str, str]:
        """Fail, saying too much."""
        raise RuntimeError(f"upstream said api_key={SECRET} {MARKUP}")

    async with open_stores(url) as stores:
        await stores.create_schema()
        first = AgentRunner.from_stores(
            ScriptedProvider(
                [[("lookup", {"q": MARKUP, "secret": SECRET})], f"done {MARKUP} {SECRET}"]
            ),
            stores,
        )
        await first.run(
            Agent(f"agent{MARKUP}", "Look.", [lookup]),
            f"hi {MARKUP} {SECRET}",
            tenant=TENANT,
            run_id=f"r{MARKUP}",
        )
        second = AgentRunner.from_stores(
            ScriptedProvider([[("explode", {"q": "x"})], "ok"]), stores
        )
        await second.run(Agent("boom", "B.", [explode]), "go", tenant=TENANT, run_id="r-boom")


def test_planted_secrets_and_markup_never_reach_a_page(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_planted(url))
    with _client(create_app(url)) as client:
        listing = client.get(f"/t/{TENANT}/runs")
        links = re.findall(r'href="(/t/acme/runs/[^"]+)"', listing.text)
        assert len(links) == 2
        pages = [listing, client.get(f"/t/{TENANT}/runs", params={"agent": MARKUP})]
        pages += [client.get(link) for link in links]
        for page in pages:
            assert page.status_code == 200, page.url
            assert SECRET not in page.text and "PLANTED" not in page.text, page.url
            assert "<script" not in page.text.lower(), page.url
        assert "[redacted:" in pages[2].text + pages[3].text


def test_a_call_in_doubt_shows_its_key_only_as_a_digest(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_crashed(url, "c1", [[("charge", {"amount": 1})], "done"], crash_at=1))
    with _client(create_app(url)) as client:
        page = client.get(f"/t/{TENANT}/runs/r-dup").text
        assert 'class="resolve"' in page
        assert RAW_KEY.search(page) is None


def test_a_call_without_a_call_id_shows_its_key_only_as_a_digest(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_crashed(url, "", [[("charge", {"amount": 1})], "done"], crash_at=1))
    with _client(create_app(url)) as client:
        page = client.get(f"/t/{TENANT}/runs/r-dup").text
        assert 'class="resolve"' in page
        assert RAW_KEY.search(page) is None


async def _parked_without_call_id(url: str) -> None:
    await _crashed(url, "", [[("charge", {"amount": 1, "password": SECRET})], "done"], crash_at=1)
    await asyncio.sleep(_SHORT_LEASE.ttl + 0.2)  # the dead holder's lease lapses
    async with open_stores(url) as stores:
        pay = AgentRunner.from_stores(
            _FixedIds([[("charge", {"amount": 1})], "done"], ""),
            stores,
            lease_policy=_SHORT_LEASE,
            never_ran_margin=0.05,
        )
        worker = Worker(pay, [_payer(0)], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        assert stores.work is not None
        parked = await stores.work.items(TENANT, state=WorkState.parked)
        assert [i.run_id for i in parked] == ["r-dup"]


def test_a_parked_reason_shows_keys_only_as_a_digest(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_parked_without_call_id(url))
    with _client(create_app(url)) as client:
        listing = client.get(f"/t/{TENANT}/runs")
        page = client.get(f"/t/{TENANT}/runs/r-dup")
        assert listing.status_code == 200 and page.status_code == 200
        assert "r-dup" in listing.text and 'id="parked"' in page.text
        assert SECRET not in listing.text + page.text
        assert RAW_KEY.search(listing.text) is None
        assert RAW_KEY.search(page.text) is None


def test_resolving_a_reused_call_id_from_the_page_shows_no_key(tmp_path: Path) -> None:
    url = _url(tmp_path)
    turns: list[Any] = [[("charge", {"amount": 1})], [("charge", {"amount": 2})], "done"]
    asyncio.run(_crashed(url, "c1", turns, crash_at=2))
    with _client(create_app(url)) as client:
        page = client.get(f"/t/{TENANT}/runs/r-dup").text
        call = re.search(r'name="call" value="([^"]*)"', page)
        assert call is not None
        answer = client.post(
            f"/t/{TENANT}/runs/r-dup/resolve",
            data={
                "csrf": _csrf(client),
                "by": "op",
                "call": call.group(1),
                "what": "outcome",
                "outcome": '{"charged": 2}',
            },
            headers=ORIGIN,
        )
        assert RAW_KEY.search(answer.text) is None
        # The form names the one record in doubt by its key's digest, so it is resolved.
        assert call.group(1).startswith("sha256:")
        assert answer.status_code == 200 and "Resolution recorded" in answer.text


def test_a_note_and_reason_with_secrets_and_markup_are_masked(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        denied = client.post(
            f"/t/{TENANT}/approvals/{request_id}",
            data={
                "csrf": csrf,
                "by": f"dave{MARKUP}",
                "decision": "deny",
                "note": f"password={SECRET} {MARKUP}",
            },
            headers=ORIGIN,
        )
        assert denied.status_code == 200
        assert "<script" not in denied.text and SECRET not in denied.text
        page = client.get(f"/t/{TENANT}/runs/r-wait")
        assert SECRET not in page.text and "<script" not in page.text

    async def stored() -> None:
        async with open_stores(url) as stores:
            got = await stores.approvals.get(TENANT, request_id)
            assert got is not None and got.note is not None and SECRET not in got.note

    asyncio.run(stored())


# --- bad bodies: a clear 4xx, nothing lost ------------------------------------------------


def test_oversized_or_odd_bodies_get_a_clear_4xx_and_change_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    approve = f"/t/{TENANT}/approvals/{request_id}"
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        big = {"csrf": csrf, "by": "op", "decision": "approve", "note": "x" * 70_000}

        def chunks() -> Any:
            yield f"csrf={csrf}&by=op&decision=approve&note=".encode()
            for _ in range(100):
                yield b"y" * 1024

        form = {"content-type": "application/x-www-form-urlencoded", **ORIGIN}
        answers = [
            client.post(approve, data=big, headers=ORIGIN),
            client.post(approve, content=chunks(), headers=form),
            client.post(approve, content=b"\x00\xff" * 10, headers=ORIGIN),
            client.post(approve, content=f"csrf={csrf}&by=op", headers=ORIGIN),
            client.post(
                approve,
                content=f"csrf={csrf}&by={'z' * 600}&decision=approve",
                headers=form,
            ),
        ]
        assert [a.status_code for a in answers] == [413, 413, 415, 415, 409]
        assert all("Traceback" not in a.text for a in answers)
    assert asyncio.run(_approval(url, TENANT, request_id)) is ApprovalStatus.pending


def test_a_form_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight_call(url, "r-ghost", "c9"))
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        answer = client.post(
            f"/t/{TENANT}/runs/r-ghost/resolve",
            content=f"csrf={csrf}&by=%FF%FE&call=c9&what=never_ran".encode(),
            headers={"content-type": "application/x-www-form-urlencoded", **ORIGIN},
        )
        assert answer.status_code == 400
    assert asyncio.run(_record(url, "r-ghost")).status is RecordStatus.in_flight


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_cookies_are_secure_when_the_console_is_served_over_https(
    store_url: str, scheme: str
) -> None:
    """Behind TLS the token and CSRF cookies say ``Secure`` (a browser never sends them over
    plain http, where anyone on the path reads them); on plain loopback http they cannot
    (a browser would drop them)."""
    base = f"{scheme}://127.0.0.1:8765"
    app = create_app(store_url, token=TOKEN, loopback_only=False)
    with TestClient(app, base_url=base, raise_server_exceptions=False) as client:
        first = client.get("/login")
        csrf = first.cookies.get("tesserix_csrf")
        assert csrf is not None
        login = client.post(
            "/login",
            data={"csrf": csrf, "token": TOKEN},
            headers={"origin": base},
            follow_redirects=False,
        )
    assert login.status_code == 303, login.text
    for cookie in (first.headers["set-cookie"], login.headers["set-cookie"]):
        assert ("secure" in cookie.lower().split("; ")) is (scheme == "https"), cookie
