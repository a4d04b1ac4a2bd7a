"""Two workers starting one run: the resume-or-start race (found by the delayed-reply trials).

A worker resumes, finds no frontier, and starts the run; meanwhile another worker started it
(and here carried it to its end). The late starter is refused, safely (nothing is done
twice), with "run ... already has a frontier; resume it instead of starting it again", but
as a ``ConfigurationError`` whose ``retryable`` is ``False``: a caller following the error
tree's advice gives up on a run it should resume, though nothing is misconfigured.
"""

from __future__ import annotations

import random
import time

import pytest

from reliability.harness import Site
from reliability.history import read_history


@pytest.mark.xfail(
    strict=True,
    reason="AgentRunner.run on a run another worker started meanwhile raises "
    "ConfigurationError (retryable=False) instead of a retryable 'resume it' refusal",
)
def test_a_start_that_lost_the_race_is_told_to_resume_not_that_it_is_misconfigured(
    site: Site,
) -> None:
    run = "start-race"
    release = site.tmp / "start.release"
    late = site.start(run, "--fault=hold:before_start", "--release", str(release))
    deadline = time.monotonic() + 30
    while not any(e.ev == "fault" and e.proc == late.label for e in read_history(site.history)):
        assert late.exitcode is None and time.monotonic() < deadline, late.output()
        time.sleep(0.02)
    site.carry(run, random.Random(run))  # another worker starts the run and completes it
    release.touch()
    late.finish()
    events = read_history(site.history)
    (result,) = [e for e in events if e.ev == "result" and e.proc == late.label]
    # Nothing happened twice either way.
    assert site.verdict().ok, site.verdict().explain()
    assert result["verdict"] == "start_raced", result.fields
    assert result["retryable"] is True, result["error"]
