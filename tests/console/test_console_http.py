"""The console over HTTP (httpx against the real app served by uvicorn on loopback): what
the pages show, that reads stay in the tenant of the address, that no secret reaches a
page, that a change needs the CSRF token and this console's Origin, and that off loopback
every request needs the token."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from console_world import ODD_RUN, OTHER, SECRET, TENANT, World, runner, seed, served

from tesserix_adk import open_stores
from tesserix_adk.console import create_app
from tesserix_adk.stores.protocols import ApprovalStatus, RecordStatus


def _csrf(client: httpx.Client, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', page.text)
    assert found is not None, "the page has no CSRF field"
    return found.group(1)


async def _approval_of(url: str, tenant: str, run_id: str) -> str:
    async with open_stores(url) as stores:
        cp = await stores.checkpoints.latest(tenant, run_id)
        assert cp is not None
        from tesserix_adk import Checkpointer

        frontier = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        assert frontier is not None and frontier.pending_approval is not None
        return frontier.pending_approval.id


def test_the_runs_list_shows_status_waiting_and_parked_and_filters(console: str) -> None:
    with httpx.Client(base_url=console) as client:
        page = client.get(f"/t/{TENANT}/runs")
        assert page.status_code == 200
        assert "r-wait" in page.text and "r-park" in page.text
        assert "waiting_approval" in page.text
        assert "charge_card" in page.text  # the parked reason names the call in doubt
        stuck = client.get(f"/t/{TENANT}/runs", params={"stuck": "1"}).text
        assert "r-park" in stuck and "r-wait" not in stuck
        by_agent = client.get(f"/t/{TENANT}/runs", params={"agent": "approver"}).text
        assert "r-wait" in by_agent and "r-park" not in by_agent
        waiting = client.get(f"/t/{TENANT}/runs", params={"status": "waiting_approval"}).text
        assert "r-wait" in waiting and "r-park" not in waiting
        none = client.get(f"/t/{TENANT}/runs", params={"status": "completed"}).text
        assert "no runs" in none


def test_a_run_page_shows_its_frontier_steps_calls_and_what_it_waits_on(console: str) -> None:
    with httpx.Client(base_url=console) as client:
        wait = client.get(f"/t/{TENANT}/runs/r-wait").text
        assert 'id="approval"' in wait and "Approve" in wait and "book_seat" in wait
        assert 'id="steps"' in wait and "waiting_approval" in wait
        park = client.get(f"/t/{TENANT}/runs/r-park").text
        assert 'id="parked"' in park and "charge_card" in park
        assert "indeterminate" in park  # the call's disposition in the plan
        assert "in_flight" in park  # the call's record
        assert 'class="resolve"' in park  # and a form to record what it did
        conversation = park.split('id="messages"', 1)[1]
        assert "<b>user</b> charge" in conversation and "charge_card" in conversation
        assert client.get(f"/t/{TENANT}/runs/nope").status_code == 404


def test_reads_and_decisions_stay_in_the_tenant_of_the_address(
    console: str, store_url: str
) -> None:
    request_id = asyncio.run(_approval_of(store_url, TENANT, "r-wait"))
    with httpx.Client(base_url=console) as client:
        other = client.get(f"/t/{OTHER}/runs").text
        assert "r-other" in other and "r-wait" not in other and "r-park" not in other
        assert client.get(f"/t/{OTHER}/runs/r-wait").status_code == 404
        csrf = _csrf(client, f"/t/{OTHER}/runs/r-other")
        answer = client.post(
            f"/t/{OTHER}/approvals/{request_id}",
            data={"csrf": csrf, "by": "mallory", "decision": "approve"},
            headers={"origin": console},
        )
        assert answer.status_code == 409 and "no approval request" in answer.text

    async def still_pending() -> None:
        async with open_stores(store_url) as stores:
            got = await stores.approvals.get(TENANT, request_id)
            assert got is not None and got.status is ApprovalStatus.pending

    asyncio.run(still_pending())


def test_no_page_shows_a_secret_unmasked(console: str) -> None:
    with httpx.Client(base_url=console) as client:
        pages = [client.get(p) for p in ("/", f"/t/{TENANT}/runs", f"/t/{OTHER}/runs")]
        for tenant, run in ((TENANT, "r-wait"), (TENANT, "r-park"), (OTHER, "r-other")):
            pages.append(client.get(f"/t/{tenant}/runs/{run}"))
        for page in pages:
            assert page.status_code == 200, page.url
            assert SECRET not in page.text and "PLANTED" not in page.text, page.url
        # The arguments are shown, masked: the pages are not just silent about them.
        assert "api_key" in pages[5].text and "LH123" in pages[5].text
        assert "password" in pages[4].text and "12" in pages[4].text


def test_a_change_needs_the_csrf_token_and_this_consoles_origin(
    console: str, store_url: str
) -> None:
    request_id = asyncio.run(_approval_of(store_url, TENANT, "r-wait"))
    path = f"/t/{TENANT}/approvals/{request_id}"
    form = {"by": "mallory", "decision": "approve"}
    with httpx.Client(base_url=console) as client:
        csrf = _csrf(client, f"/t/{TENANT}/runs/r-wait")
        refused = [
            client.post(path, data=form, headers={"origin": console}),  # no token in the form
            client.post(path, data={**form, "csrf": "0" * 64}, headers={"origin": console}),
            client.post(path, data={**form, "csrf": csrf}),  # no Origin, no Referer
            client.post(path, data={**form, "csrf": csrf}, headers={"origin": "http://evil.test"}),
        ]
        assert [r.status_code for r in refused] == [403, 403, 403, 403]
    with httpx.Client(base_url=console) as stranger:  # another browser: no cookie
        answer = stranger.post(path, data={**form, "csrf": csrf}, headers={"origin": console})
        assert answer.status_code == 403
        # A page of another site that names the console by a name of its own.
        rebound = stranger.get(f"/t/{TENANT}/runs", headers={"host": "evil.test"})
        assert rebound.status_code == 421

    async def still_pending() -> None:
        async with open_stores(store_url) as stores:
            got = await stores.approvals.get(TENANT, request_id)
            assert got is not None and got.status is ApprovalStatus.pending

    asyncio.run(still_pending())


def test_resolve_deny_and_cancel_in_the_page_are_audited_as_the_cli_does(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    asyncio.run(seed(url, World()))
    request_id = asyncio.run(_approval_of(url, TENANT, "r-wait"))
    with served(create_app(url)) as base, httpx.Client(base_url=base) as client:
        csrf = _csrf(client, f"/t/{TENANT}/runs/r-park")
        call = re.search(
            r'name="call" value="([^"]+)"', client.get(f"/t/{TENANT}/runs/r-park").text
        )
        assert call is not None
        resolved = client.post(
            f"/t/{TENANT}/runs/r-park/resolve",
            data={
                "csrf": csrf,
                "call": call.group(1),
                "by": "carol",
                "what": "outcome",
                "outcome": '{"charged": "12"}',
            },
            headers={"origin": base},
        )
        assert resolved.status_code == 200, resolved.text
        assert "by carol" in resolved.text and "a worker carries the run on" in resolved.text
        assert "recorded by carol" in client.get(f"/t/{TENANT}/runs/r-park").text
        denied = client.post(
            f"/t/{TENANT}/approvals/{request_id}",
            data={"csrf": csrf, "by": "dave", "decision": "deny", "note": f"token={SECRET}"},
            headers={"origin": base},
        )
        assert denied.status_code == 200 and "denied by dave" in denied.text
        cancelled = client.post(
            f"/t/{OTHER}/runs/r-other/cancel",
            data={"csrf": csrf, "by": "erin", "reason": "customer gave up"},
            headers={"origin": base},
        )
        assert cancelled.status_code == 200 and "cancelled, by erin" in cancelled.text
        bad_name = client.post(
            f"/t/{OTHER}/runs/r-other/cancel",
            data={"csrf": csrf, "by": ""},
            headers={"origin": base},
        )
        assert bad_name.status_code == 409

    async def audited() -> None:
        async with open_stores(url) as stores:
            got = await stores.approvals.get(TENANT, request_id)
            assert got is not None and got.status is ApprovalStatus.denied and got.by == "dave"
            assert got.note is not None and SECRET not in got.note
            records = await stores.idempotency.records(TENANT, "r-park")
            (charge,) = [r for r in records if r.tool == "charge_card"]
            assert charge.status is RecordStatus.completed and charge.by == "carol"

    asyncio.run(audited())


def test_an_id_with_markup_is_escaped_and_its_page_reachable(console: str) -> None:
    with httpx.Client(base_url=console) as client:
        listing = client.get(f"/t/{OTHER}/runs").text
        assert ODD_RUN not in listing and "<i>" not in listing
        assert "&lt;i&gt;odd&lt;/i&gt;&quot;/run" in listing
        link = re.search(r'href="(/t/globex/runs/[^"]*odd[^"]*)"', listing)
        assert link is not None
        page = client.get(link.group(1))
        assert page.status_code == 200 and 'id="approval"' in page.text
        assert "<i>" not in page.text


@pytest.mark.parametrize("how", ["header", "login"])
def test_off_loopback_every_request_needs_the_token(store_url: str, how: str) -> None:
    token = "t0ken-for-the-console"
    app = create_app(store_url, token=token, loopback_only=False)
    with served(app) as base, httpx.Client(base_url=base) as client:
        assert client.get(f"/t/{TENANT}/runs").status_code == 303  # to the login form
        wrong = client.get(f"/t/{TENANT}/runs", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 303
        if how == "header":
            client.headers["authorization"] = f"Bearer {token}"
        else:
            csrf = _csrf(client, "/login")
            bad = client.post(
                "/login", data={"csrf": csrf, "token": "nope"}, headers={"origin": base}
            )
            assert bad.status_code == 401
            good = client.post(
                "/login", data={"csrf": csrf, "token": token}, headers={"origin": base}
            )
            assert good.status_code == 303
        page = client.get(f"/t/{TENANT}/runs")
        assert page.status_code == 200 and "r-wait" in page.text
        # The token alone is not enough for a change: the CSRF check still applies.
        refused = client.post(
            f"/t/{TENANT}/runs/r-wait/cancel", data={"by": "x"}, headers={"origin": base}
        )
        assert refused.status_code == 403


def test_a_submitted_run_is_listed_with_its_page_and_can_be_cancelled_before_it_starts(
    tmp_path: Path,
) -> None:
    """A run submitted and not yet started has no frontier: the console lists it as
    submitted, its page says so with the cancel form, and once cancelled it stays listed as
    cancelled before it started, as `tesserix runs` shows it."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    world = World()
    asyncio.run(seed(url, world))

    async def submitted() -> None:
        async with open_stores(url) as stores:
            await runner(stores, []).submit(
                world.approver(), "book", tenant=TENANT, run_id="r-queued"
            )

    asyncio.run(submitted())
    with served(create_app(url)) as base, httpx.Client(base_url=base) as client:
        listing = client.get(f"/t/{TENANT}/runs").text
        row = re.search(r"<tr[^>]*>.*r-queued.*</tr>", listing)
        assert row is not None, listing
        assert "<td>submitted</td><td>-</td>" in row.group(0)
        assert "r-queued" not in client.get(f"/t/{TENANT}/runs", params={"stuck": "1"}).text
        page = client.get(f"/t/{TENANT}/runs/r-queued")
        assert page.status_code == 200, page.text
        assert "no worker has started it yet" in page.text and "Cancel the run" in page.text
        csrf = _csrf(client, f"/t/{TENANT}/runs/r-queued")
        cancelled = client.post(
            f"/t/{TENANT}/runs/r-queued/cancel",
            data={"csrf": csrf, "by": "erin", "reason": "customer gave up"},
            headers={"origin": base},
        )
        assert cancelled.status_code == 200, cancelled.text
        assert "cancelled before it started" in cancelled.text
        after = client.get(f"/t/{TENANT}/runs", params={"status": "cancelled"}).text
        assert "r-queued" in after
        assert "cancelled before it started, by erin: customer gave up" in after
        page = client.get(f"/t/{TENANT}/runs/r-queued").text
        assert "cancelled before it started, by erin" in page and "Cancel the run" not in page
        assert client.get(f"/t/{TENANT}/runs/r-nobody").status_code == 404
