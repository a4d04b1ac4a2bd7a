"""Two workers starting one run: the resume-or-start race (found by the delayed-reply trials).

A worker resumes, finds no frontier, and starts the run; meanwhile another worker started it
(and here carried it to its end). The late starter must be refused safely (nothing done
twice) and as "not now, resume it": retryable. The trials found it refused as a
``ConfigurationError`` with ``retryable`` ``False``; the kit now raises ``RunStartedError``
(a ``ResumeConflictError``), and this test holds it there.
"""

from __future__ import annotations

import random
import time

from reliability.harness import Site
from reliability.history import read_history


def test_a_start_that_lost_the_race_is_told_to_resume_not_that_it_is_misconfigured(
    site: Site,
) -> None:
    run = "start-race"
    release = site.tmp / "start.release"
    late = site.start(run, "--fault=hold:before_start", "--release", str(release))
    deadline = time.monotonic() + 30
    while not any(
        e.ev == "fault" and e.proc == late.label for e in read_history(site.history, live=True)
    ):
        assert late.exitcode is None and time.monotonic() < deadline, late.output()
        time.sleep(0.02)
    site.carry(run, random.Random(run))  # another worker starts the run and completes it
    release.touch()
    late.restart_clock()
    late.finish()
    events = read_history(site.history)
    (result,) = [e for e in events if e.ev == "result" and e.proc == late.label]
    # Nothing happened twice either way.
    assert site.verdict().ok, site.verdict().explain()
    assert result["verdict"] == "held", result.fields
    assert result["error"].startswith("RunStartedError"), result["error"]
