"""A process killed (SIGKILL) before its run's first frontier: the run started with
``run()`` kept its input as a submission, so a worker process starts it and it books once;
nothing is parked for an operator."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import BACKENDS, TENANT, Site, held_open, store_url

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")


@pytest.fixture(params=BACKENDS)
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    with held_open(store_url(request.param, tmp_path)) as url:
        yield Site(tmp_path, url)


def test_killed_in_its_first_model_call_a_worker_starts_it_and_it_books_once(
    site: Site,
) -> None:
    site.kill_at("first", "first_model_call")
    assert site.bookings("first") == 0
    site.wait_lease_lapsed("first")
    worker = site.tesserix(
        "worker",
        "--agent",
        "tesserix_adk.cli.demo_agent:agent",
        "--lease-ttl",
        "2",
        "--exit-when-idle",
        env={**site.env, "ADK_STORE": site.store},
    )
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert "starting it" in worker.stderr + worker.stdout, worker.stderr[-2000:]
    assert site.bookings("first") == 1
    shown = site.tesserix("show", "first", "--tenant", TENANT, "--json")
    assert json.loads(shown.stdout)["status"] == "completed", shown.stdout
    stuck = site.tesserix("runs", "--stuck", "--tenant", TENANT, "--json")
    assert stuck.returncode == 0, stuck.stderr
    assert "first" not in stuck.stdout, stuck.stdout
