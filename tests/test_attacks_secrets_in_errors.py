"""Attacks on README guarantee 7 where text leaves the kit by roads other than the stored
payloads: error texts of stores (a URL with its password, as a store of your own may say
it), the log lines of the kit's own loggers (``tesserix_adk.*``), the ``tesserix worker``
command's lines on stdout (they are the worker logger's records), its stderr sentence and
``--json`` error, ``Checkpointer.last_error``, the ``repr`` of what an operator prints
(``Stores``, ``IndeterminateToolCallError`` and its calls), and a real Redis refusing a
password.

README 7 names "``last_error``, the runner's log lines"; SPEC says redaction covers "logs
and error texts"; the CLI section says "every error shows a store URL with its password
masked". Events are documented as unmasked (the live run), so they are not attacked here.

Five defects were found here (a lease renewal's or release's failure, a worker's failure
to find work, a refused tombstone and a worker stopping on a store error each logged the
store's text unmasked, and ``repr(Stores)`` showed its URL whole); each is fixed
(``redaction.Masked`` on the kit's log lines, ``Stores.__repr__``), and its test passes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from operator_cli import cli
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    LeasePolicy,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    RunStatus,
    ScriptedProvider,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.errors import IndeterminateToolCallError, StoreUnavailableError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash
from tesserix_adk.worker_parking import Backoff

T = "acme"
PW = "QZERRPWQZ42"  # the needle: a store's password
STORE_SAYS = f"cannot reach postgresql://adk:{PW}@db.internal:5432/adk (timeout)"


# --- helpers ------------------------------------------------------------------------------


class Flaky:
    """A store of your own that fails ``fail[name]`` times on method ``name`` with
    ``StoreUnavailableError`` naming its URL, password and all (as a driver may)."""

    def __init__(self, inner: Any, fail: dict[str, int]) -> None:
        self._inner = inner
        self._fail = dict(fail)
        self.failed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._fail or not callable(attr):
            return attr

        async def failing(*args: Any, **kwargs: Any) -> Any:
            if self._fail[name] > 0:
                self._fail[name] -= 1
                self.failed.append(name)
                raise StoreUnavailableError(STORE_SAYS)
            return await attr(*args, **kwargs)

        return failing


def kit_log(caplog: pytest.LogCaptureFixture) -> str:
    """Every record of the kit's own loggers, as a handler would format it."""
    return "\n".join(
        f"{r.name} {r.levelname} {r.getMessage()} {r.exc_text or ''}"
        for r in caplog.records
        if r.name.startswith("tesserix_adk")
    )


async def _opened(tmp_path: Path) -> Stores:
    stores = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    await stores.create_schema()
    return stores


def _runner(provider: Any, stores: Stores, **parts: Any) -> AgentRunner:
    kwargs: dict[str, Any] = {
        "idempotency": stores.idempotency,
        "checkpoints": Checkpointer.from_stores(stores),
        "leases": stores.leases,
        "ledger": stores.ledger,
        "approvals": stores.approvals,
        "work": stores.work,
        "lease_policy": LeasePolicy(ttl=1, renew_within=0.5),
    }
    kwargs.update(parts)
    return AgentRunner(provider, **kwargs)


@tool(side_effects=False)
def slow_lookup() -> str:
    """A read-only lookup slower than a lease renewal."""
    time.sleep(0.8)
    return "found"


SLOW = Agent("slow", "Look it up.", [slow_lookup])


# --- the kit's own log lines about a store's error -------------------------------------------


@pytest.mark.parametrize("failing", ["renew", "release"])
def test_a_failed_lease_renewal_or_release_is_logged_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, failing: str
) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> tuple[Any, Flaky]:
        stores = await _opened(tmp_path)
        try:
            leases = Flaky(stores.leases, {failing: 1})
            provider = ScriptedProvider([[("slow_lookup", {})], "done"])
            run = await _runner(provider, stores, leases=leases).run(
                SLOW, "go", tenant=T, run_id=f"lease-{failing}"
            )
            return run, leases
        finally:
            await stores.aclose()

    run, leases = asyncio.run(go())
    assert run.status is RunStatus.completed  # one failed renewal or release costs nothing
    assert leases.failed == [failing]
    logged = kit_log(caplog)
    assert "db.internal" in logged, logged  # the failure was logged
    assert PW not in logged, logged


def test_a_worker_failing_to_find_work_logs_the_store_error_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> tuple[Worker, Flaky]:
        stores = await _opened(tmp_path)
        try:
            provider = ScriptedProvider(["done"])
            await AgentRunner.from_stores(provider, stores).submit(
                SLOW, "go", tenant=T, run_id="polled"
            )
            work = Flaky(stores.work, {"due": 1})
            worker = Worker(
                _runner(provider, stores, work=work),
                [SLOW],
                exit_when_idle=True,
                poll_interval=0.05,
                backoff=Backoff(base=0.05, cap=0.1),
            )
            await worker.run()
            return worker, work
        finally:
            await stores.aclose()

    worker, work = asyncio.run(go())
    assert work.failed == ["due"]
    assert [item.run_id for item, _ in worker.carried] == ["polled"]  # found on the retry
    logged = kit_log(caplog)
    assert "finding work failed" in logged, logged
    assert PW not in logged, logged


def _too_large_with_a_failing_store(caplog: pytest.LogCaptureFixture) -> tuple[Any, Checkpointer]:
    caplog.set_level(logging.DEBUG)
    failing = FaultyCheckpointStore(
        MemoryCheckpointStore(), fail_with=StoreUnavailableError(STORE_SAYS)
    )
    checkpoints = Checkpointer(failing, max_bytes=400)
    runner = AgentRunner(
        ScriptedProvider(["done"]), idempotency=MemoryIdempotencyStore(), checkpoints=checkpoints
    )
    run = asyncio.run(runner.run(Agent("a", "i"), "hi " * 300, tenant=T, run_id="big"))
    return run, checkpoints


def test_a_too_large_frontier_over_a_failing_store_keeps_last_error_masked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run, checkpoints = _too_large_with_a_failing_store(caplog)
    assert run.status is RunStatus.completed  # a checkpoint failure never fails the run
    assert checkpoints.last_error is not None
    said = f"{checkpoints.last_error!s} {checkpoints.last_error!r}"
    assert "over max_bytes" in said and PW not in said
    warned = [r.getMessage() for r in caplog.records if r.name == "tesserix_adk.checkpoint"]
    assert any("not written" in w for w in warned), warned
    assert all(PW not in w for w in warned if "tombstone" not in w), warned


def test_a_tombstone_the_store_refuses_is_logged_masked(caplog: pytest.LogCaptureFixture) -> None:
    _too_large_with_a_failing_store(caplog)
    logged = kit_log(caplog)
    assert "tombstone for run big" in logged, logged
    assert PW not in logged, logged


# --- `tesserix worker`: a store's error it stops on ---------------------------------------------

_LEAKY_AGENT = f'''
"""An agent whose model sits behind a cache in another PostgreSQL, which refuses it."""

from tesserix_adk import Agent
from tesserix_adk.errors import StorePermissionError


class PROVIDER:
    async def complete(self, request):
        raise StorePermissionError(
            "permission denied for table llm_cache on "
            "postgresql://cache:{PW}@cache.internal:5432/llm"
        )


agent = Agent("leaky", "Answer.", [])
'''


@pytest.fixture(scope="module")
def worker_stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """A submitted run whose model raises a store's permission error naming its URL, and
    ``tesserix worker --exit-when-idle`` (text, then ``--json``) carrying it."""
    where = tmp_path_factory.mktemp("worker_stopped")
    (where / "leaky_agent.py").write_text(_LEAKY_AGENT)
    url = f"sqlite:///{where / 'adk.sqlite3'}"
    ref = f"{where / 'leaky_agent.py'}:agent"
    assert cli("schema", "apply", "--store", url)[0] == 0
    said: dict[str, tuple[int, str, str]] = {}
    for form in ("text", "json"):
        run_id = f"w-{form}"
        submitted = cli(
            "submit", "--store", url, "--tenant", T, "--agent", ref, "--input", "hi",
            "--run-id", run_id,
        )  # fmt: skip
        assert submitted[0] == 0, submitted
        extra = ["--json"] if form == "json" else []
        said[form] = cli("worker", "--store", url, "--agent", ref, "--exit-when-idle", *extra)
    return said


def test_a_worker_stopping_on_a_store_error_says_it_masked_on_stderr_and_in_json(
    worker_stopped: dict[str, tuple[int, str, str]],
) -> None:
    code, out, err = worker_stopped["text"]
    assert code != 0, (code, out, err)
    assert "permission denied for table llm_cache" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert PW not in err, err
    code, out, err = worker_stopped["json"]
    error = json.loads(out[out.index('{\n  "error"') :])["error"]
    assert "[redacted:url_password]" in error["message"], error
    assert PW not in error["message"] and PW not in err, (error, err)


@pytest.mark.parametrize("form", ["text", "json"])
def test_a_worker_stopping_on_a_store_error_prints_no_password_on_stdout(
    worker_stopped: dict[str, tuple[int, str, str]], form: str
) -> None:
    _code, out, _err = worker_stopped[form]
    assert "the worker stops" in out, out
    assert PW not in out, out


# --- repr of what an operator prints ---------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://adk:{PW}@127.0.0.1:1/test",
        f"redis://:{PW}@127.0.0.1:1/0?allow_volatile=true",
    ],
)
def test_the_repr_of_stores_opened_from_a_url_masks_its_password(url: str) -> None:
    async def shown() -> str:
        async with open_stores(url) as stores:  # opening does no I/O
            return f"{stores!r} {stores!s}"

    text = asyncio.run(shown())
    assert "127.0.0.1" in text, text  # the URL is shown
    assert PW not in text, text


def test_an_indeterminate_call_with_a_secret_in_its_arguments_prints_it_masked(
    tmp_path: Path,
) -> None:
    """What an operator prints of a refused resume (``str``, ``repr``, ``.calls``) comes
    from the frontier, masked; the key is a digest."""
    secret = f"sk-proj-{PW}aaaaaaaaaaaaaaaaaaaa1"
    dying = [True]

    @tool
    def charge(card_token: str, note: str) -> str:
        """Charge a card (side-effecting, keyed)."""
        if dying and dying.pop():
            raise SimulatedCrash("killed inside charge")
        return "charged"

    agent = Agent("payer", "Pay.", [charge])
    args = {"card_token": f"tok-{PW}", "note": f"use {secret}"}
    provider = ScriptedProvider([[("charge", args)], "paid"])

    async def go(resume: bool) -> Any:
        stores = await _opened(tmp_path)
        try:
            runner = _runner(provider, stores, never_ran_margin=0)
            if resume:
                return await runner.resume(agent, "pay-1", tenant=T)
            return await runner.run(agent, "pay", tenant=T, run_id="pay-1")
        finally:
            await stores.aclose()

    with pytest.raises(SimulatedCrash):
        asyncio.run(go(False))
    with pytest.raises(IndeterminateToolCallError) as refused:
        asyncio.run(go(True))
    exc = refused.value
    shown = f"{exc!s} {exc!r} {exc.calls!r} {[c.arguments for c in exc.calls]!r}"
    assert "charge" in shown, shown
    assert PW not in shown, shown
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    said = [cli(view, "pay-1", "--tenant", T, "--store", url, *form)
            for view in ("inspect", "show") for form in ([], ["--json"])]  # fmt: skip
    assert all(code == 0 for code, _, _ in said), said
    assert "charge" in said[0][1], said[0]
    assert PW not in repr(said), said


# --- a real Redis refusing a password ---------------------------------------------------------


@pytest.mark.redis
def test_a_real_redis_refusing_a_user_and_password_is_named_masked() -> None:
    url = f"redis://qz_nobody:{PW}@127.0.0.1:6379/0?allow_volatile=true"

    async def opened() -> str:
        try:
            async with open_stores(url) as stores:
                await stores.create_schema()  # no round trip: the refusal comes next
                await stores.leases.current(T, "any")
        except Exception as exc:
            return f"{type(exc).__name__}: {exc!s} {exc!r} {exc.__cause__!r}"
        return "opened"

    said = asyncio.run(opened())
    code, out, err = cli("runs", "--tenant", T, "--store", url)
    code_j, out_j, err_j = cli("runs", "--tenant", T, "--store", url, "--json")
    assert "refused the credentials" in said, said  # the server's real refusal
    assert code != 0 and code_j != 0, (code, err, code_j, err_j)
    assert "Traceback" not in err, err
    assert PW not in said + out + err + out_j + err_j, (said, err, out_j)
