"""The console in a real headless Chromium (Debian's ``chromium``, driven by Playwright
with ``executable_path``; no browser is downloaded): on a store with a run waiting on
approval and a parked run, an operator approves in the page; a worker then carries the run
on, and the approval names the operator. Screenshots go to ``$ADK_TEST_ARTIFACTS/console``
when that is set, else to ``screenshots/`` under the test's pytest tmp path.

Without /usr/bin/chromium the test skips with a reason, except under ``CI=true``, where a
missing browser is a failure.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from console_world import SECRET, TENANT, WAIT_TURNS, World, runner, seed, served

from tesserix_adk import Carried, Checkpointer, RunStatus, Worker, open_stores
from tesserix_adk.console import create_app
from tesserix_adk.stores.protocols import ApprovalStatus

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _artefacts(tmp_path: Path) -> Path:
    root = os.environ.get("ADK_TEST_ARTIFACTS")
    where = Path(root) / "console" if root else tmp_path / "screenshots"
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def chromium() -> Path:
    if not CHROMIUM.exists():
        reason = "Debian's chromium is absent (make chromium installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return CHROMIUM


async def test_an_operator_approves_in_the_browser_and_the_run_carries_on(
    tmp_path: Path, chromium: Path
) -> None:
    from playwright.async_api import async_playwright

    world = World()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    await seed(url, world)
    async with open_stores(url) as stores:
        frontier = await Checkpointer.from_stores(stores).latest(TENANT, "r-wait")
        assert frontier is not None and frontier.pending_approval is not None
        request_id = frontier.pending_approval.id
    shots = _artefacts(tmp_path)
    with served(create_app(url)) as base:
        async with async_playwright() as p:
            context = await p.chromium.launch_persistent_context(
                str(tmp_path / "profile"),
                executable_path=str(chromium),
                headless=True,
                args=ARGS,
            )
            try:
                page = await context.new_page()
                await page.goto(base + "/")
                await page.fill("input[name=tenant]", TENANT)
                await page.click("button[type=submit]")
                await page.wait_for_selector("#runs")
                runs = await page.inner_text("#runs")
                assert "r-wait" in runs and "r-park" in runs and "charge_card" in runs
                await page.screenshot(path=str(shots / "1-runs.png"), full_page=True)
                await page.click("text=r-wait")
                await page.wait_for_selector("#approval")
                assert SECRET not in await page.content()
                await page.screenshot(path=str(shots / "2-waiting-run.png"), full_page=True)
                await page.fill("#approval input[name=by]", "alice")
                await page.fill("#approval input[name=note]", "checked with the customer")
                await page.click("#approval button[value=approve]")
                said = await page.inner_text("#said")
                assert "approved by alice" in said and "a worker carries it on" in said
                await page.screenshot(path=str(shots / "3-approved.png"), full_page=True)
                await page.click("text=Back to run")
                shown = await page.inner_text("#approval")
                assert "approved by alice" in shown and "checked with the customer" in shown

                async with open_stores(url) as stores:
                    worker = Worker(
                        runner(stores, WAIT_TURNS),
                        [world.approver()],
                        exit_when_idle=True,
                        poll_interval=0.01,
                    )
                    await asyncio.wait_for(worker.run(), 30)
                    assert [how for _, how in worker.carried] == [Carried.finished]
                    cp = await Checkpointer.from_stores(stores).latest(TENANT, "r-wait")
                    assert cp is not None and cp.status.value == RunStatus.completed.value
                    assert cp.pending_approval is None
                    decided = await stores.approvals.get(TENANT, request_id)
                    assert decided is not None and decided.status is ApprovalStatus.approved
                    assert (decided.by, decided.note) == ("alice", "checked with the customer")
                assert len(world.bookings) == 1

                await page.reload()
                await page.wait_for_selector("#status")
                assert await page.inner_text("#status") == "completed"
                await page.screenshot(path=str(shots / "4-completed.png"), full_page=True)
                await page.goto(f"{base}/t/{TENANT}/runs/r-park")
                assert "charge_card" in await page.inner_text("#parked")
                await page.screenshot(path=str(shots / "5-parked-run.png"), full_page=True)
            finally:
                await context.close()
    assert sorted(p.name for p in shots.glob("*.png")) == [
        "1-runs.png",
        "2-waiting-run.png",
        "3-approved.png",
        "4-completed.png",
        "5-parked-run.png",
    ]
