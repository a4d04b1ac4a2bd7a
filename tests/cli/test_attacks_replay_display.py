"""An attacker's and a careful user's look at ``tesserix replay`` and the display commands
(``steps``, ``show``, ``inspect``, ``runs``), on SQLite and, for one case, PostgreSQL.

The promises under attack: replay sends no side-effecting call unless asked (a stub, or
``--live``), never writes into the original run, and never guesses which step it starts
from; displays print redacted data only, and hostile content (terminal control codes,
odd Unicode) never reaches the operator's terminal raw; every bad input is one sentence
on stderr with the documented exit code, never a Python internal, and changes nothing.

Defects found (each an ``xfail(strict=True)`` test asserting the right behaviour until
fixed; fixed so far: 2, 6, 7, 8, 11):

1. ``replay --from-step 99999999999999999999`` on SQLite is exit 4 with ``OverflowError:
   Python int too large to convert to SQLite INTEGER`` (a Python internal, and "must not be
   carried on"); on PostgreSQL it is exit 3, "retry later", for a step that can never
   exist. Redis and ``show --step`` say "no step N" (exit 1), as they should.
2. A step row holding another step's (intact, checksummed) payload is believed:
   ``replay --from-step 3`` silently replays step 5 (exit 0, ``replay of r@5``), and
   ``steps`` lists step 5's contents as step 3. The reader never checks the step it asked
   for against the step the payload names (SQLite and Redis alike).
3. ``show --step N`` of a snapshot that cannot be read says "run has no step N on record"
   (exit 1, "check the id") instead of naming the damage (exit 4).
4. One damaged call record (an unknown status) hides every run of the tenant from
   ``runs``: exit 4 and nothing listed, where a damaged frontier is listed as
   ``unreadable`` beside the healthy runs.
5. ``tesserix replay`` prints the model's final answer as the live run returned it,
   un-redacted (API keys, bearer tokens), in text and ``--json``; ``show`` of the same run
   prints it masked.
6. ``--json`` output (``show``, ``inspect``, ``runs``, ``replay``) writes C1 control
   characters (U+009B is CSI, U+009D OSC, U+009C ST), DEL, U+202E (bidi override) and
   U+2028 raw: ``ensure_ascii=False`` escapes only U+0000-U+001F. The text output escapes
   them all.
7. A tool result holding a float NaN is stored as is, and ``show --json`` prints a bare
   ``NaN``: not JSON (strict parsers, ``jq``, refuse the whole document).
8. A replay stub (or any tool) returning a string with a lone surrogate crashes the run:
   ``tesserix: UnicodeEncodeError: 'utf-8' codec can't encode ...`` (a Python internal,
   exit 4); the outcome encoder cannot encode what the tool returned.
9. A replay that ends ``failed`` (the model rejected the request) exits 0; ``run
   --resume`` exits 4 for the same ending, as the README's exit-code table says.
10. ``inspect`` of a run whose worker is alive and inside a side-effecting call says the
    call is ``indeterminate - ... that holder no longer carries the run (its lease lapsed
    or was taken)`` while printing, on the next line, that very holder's live lease.
11. (Fixed: such a call is now refused, "not sent", its key never built or stored.) An
    idempotency key function built from an argument (``key=lambda ...:
    f"charge-{card}"``) puts a secret in that argument into every step snapshot
    unredacted, and ``inspect --json`` prints it (the arguments themselves are masked).
12. Replaying a run whose id is near the 512-byte limit without ``--new-run-id`` says
    "the run id is 526 bytes long" of an id the operator never typed (the generated one),
    without naming ``--new-run-id``.

What held (plain tests below): a replay, even of a run a live worker holds mid-call, or
from a step waiting on an approval, writes nothing under the original run (frontier,
steps, records, lease, approvals, ledger, transcript) and sends nothing but the stub; the
text displays escape every control character of hostile model and tool content (call ids,
tool names, arguments, results, answers); a missing, negative or other tenant's step is
exit 1 and a damaged step or transcript exit 4, with nothing written; a replay under a
changed agent records the revision it used. Also checked and held, without a test of their
own here: unstubbed side-effecting tools are refused before anything runs; deep, wide and
2 MiB stub results neither hang nor crash the displays; a tombstone step in the middle of a
run is shown as such; Redis answers a huge step with exit 1.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import booking
from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    Message,
    ModelRequest,
    ModelResponse,
    ProviderError,
    Role,
    ScriptedProvider,
    ToolCall,
    tool,
)
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main

HERE = "cli.test_attacks_replay_display"
STUB = "book_seat=booking:fake_booking"
SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"
BEARER = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N"
# Control codes a hostile model or tool may return: OSC window title, clear screen, carriage
# return, backspace, bidi override, 8-bit CSI, DEL, line separator, 8-bit OSC 52 (write the
# operator's clipboard) ended by an 8-bit ST.
EVIL = "\x1b]0;pwned\x07\x1b[2J\r\x08\u202e\x9b31m\x7f\u2028\x9d52;c;aGk=\x9c"

# --- what the CLI loads by reference (``--agent/--provider/--stub cli.<this module>:X``) ---

AIRLINE = Airline()
AGENT = booking_agent(AIRLINE)
APPROVAL_AGENT = booking_agent(AIRLINE, approval=True)
CHANGED_AGENT = booking_agent(AIRLINE, max_iterations=7, model="scripted:v2")


def leaky_provider() -> ScriptedProvider:
    """The booking conversation, whose last answer repeats secrets a tool showed it."""
    return ScriptedProvider([*BOOK_TURNS[:2], f"Booked; key {SECRET}, Bearer {BEARER}"])


def hostile_answer_provider() -> ScriptedProvider:
    return ScriptedProvider([*BOOK_TURNS[:2], "Booked" + EVIL])


class _Rejects:
    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise ProviderError("400 bad request: the model refused the input", retryable=False)


def rejecting() -> _Rejects:
    return _Rejects()


class _Hostile:
    """A model whose call ids, tool names, arguments and text all carry control codes."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked == 0:
            calls = [
                ToolCall(
                    id="s" + EVIL, name="search_flights", arguments={"origin": EVIL, "dest": "x"}
                ),
                ToolCall(id="u" + EVIL, name="no_such" + EVIL, arguments={}),
            ]
            return ModelResponse(
                message=Message(role="assistant", content="t" + EVIL, tool_calls=calls)
            )
        if asked == 1:
            call = ToolCall(id="b" + EVIL, name="book_seat", arguments={"flight": EVIL})
            return ModelResponse(message=Message(role="assistant", content="", tool_calls=[call]))
        return ModelResponse(message=Message(role="assistant", content="done" + EVIL))


def hostile() -> _Hostile:
    return _Hostile()


def surrogate_booking(flight: str) -> dict[str, str]:
    """A stub whose answer holds a lone surrogate (what surrogateescape makes of a bad byte)."""
    return {"booking": "BK-\ud800", "flight": flight}


@tool(side_effects=False)
def quote_price(flight: str) -> float:
    """A price feed that answers NaN when it has no price."""
    return float("nan")


PRICER = Agent("pricer", "Quote prices.", [quote_price])


@tool(requires_approval=True, key=lambda **kw: f"charge-{kw['arguments']['card']}")
def charge(card: str) -> str:
    """Charge a card; keyed by the card, so the payment service can deduplicate."""
    return "charged"


PAYER = Agent("payer", "Charge the card.", [charge])


def _this() -> Any:
    """This module as the CLI imports it (``cli.<name>``), whose globals the CLI uses."""
    return importlib.import_module(HERE)


# --- helpers ------------------------------------------------------------------------------


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _plain(err: str) -> bool:
    """One sentence in the kit's words: no traceback, no Python exception's name."""
    internals = ("Error:", "Exception:", "Traceback")
    return (
        err.startswith("tesserix: ")
        and err.count("\n") == 1
        and not any(name in err for name in internals)
    )


def _rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _execute(path: Path, sql: str, *params: Any) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _run_rows(path: Path, run_id: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table that names ``run_id``: what "untouched" compares."""
    conn = sqlite3.connect(path)
    try:
        tables = [
            name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        found = {}
        for table in tables:
            columns = [c[1] for c in conn.execute(f"PRAGMA table_info({table})")]
            if "run_id" in columns:
                found[table] = sorted(
                    conn.execute(f"SELECT * FROM {table} WHERE run_id = ?", (run_id,)).fetchall(),
                    key=repr,
                )
        return found
    finally:
        conn.close()


def _flip(payload: bytes) -> bytes:
    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 1
    return bytes(flipped)


def _build(url: str, run_id: str, *, agent: Agent | None = None, turns: Any = BOOK_TURNS,
           tenant: str = "t", provider: Any = None) -> Any:  # fmt: skip
    from tesserix_adk.stores.urls import open_stores

    async def go() -> Any:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(provider or ScriptedProvider(turns), stores)
            return await runner.run(
                agent or _this().AGENT, "book LH123", tenant=tenant, run_id=run_id
            )

    return asyncio.run(go())


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, str]:
    """A SQLite store holding run ``r`` of tenant ``t``, finished in five steps (step 3 is
    ``after_model_call`` with ``book_seat`` outstanding)."""
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    _build(url, "r")
    return path, url


def _replay(capsys: pytest.CaptureFixture[str], url: str, *extra: str,
            run: str = "r", step: str = "3", agent: str = f"{HERE}:AGENT",
            provider: str = "booking:provider") -> tuple[int, str, str]:  # fmt: skip
    return _main(capsys, "--store", url, "replay", run, "--tenant", "t", "--from-step", step,
                 "--agent", agent, "--provider", provider, *extra)  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """No stub calls left from another test; no traceback added under ``ADK_DEBUG``."""
    booking.STUB_CALLS.clear()
    monkeypatch.delenv("ADK_DEBUG", raising=False)


# ==========================================================================================
# Defects
# ==========================================================================================


def test_replay_from_a_huge_step_is_no_such_step(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = store
    before = _dump(path)
    code, _, err = _replay(capsys, url, "--stub", STUB, step="99999999999999999999")
    assert _dump(path) == before
    assert (code, _plain(err)) == (ExitCode.NOTHING_CHECKPOINTED, True), err


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL store URL in a schema of this test's own (dropped after), with the
    kit's schema applied; skips when the server cannot be reached."""
    import secrets

    import psycopg

    name = f"adktest_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(services.POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL} cannot be reached: {exc}")
    try:
        admin.execute(f'CREATE SCHEMA "{name}"')
        try:
            url = services.schema_url(name)
            assert main(["--store", url, "schema", "apply"]) == ExitCode.CARRIED_ON
            yield url
        finally:
            admin.execute(f'DROP SCHEMA "{name}" CASCADE')
    finally:
        admin.close()


@pytest.mark.postgres
def test_replay_from_a_huge_step_on_postgres_is_no_such_step(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    code, _, err = _replay(capsys, pg_url, "--stub", STUB, step="99999999999999999999")
    assert (code, _plain(err)) == (ExitCode.NOTHING_CHECKPOINTED, True), err


def test_replay_from_a_step_whose_row_holds_another_steps_payload_is_refused(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = store
    [(five,)] = _rows(path, "SELECT payload FROM adk_checkpoint_steps WHERE step = 5")
    _execute(path, "UPDATE adk_checkpoint_steps SET payload = ? WHERE step = 3", five)
    before = _dump(path)
    code, out, err = _replay(capsys, url, "--stub", STUB)
    assert "r@5" not in out, out  # today: "replay r-replay-… (replay of r@5) now completed"
    assert (code, _plain(err)) == (ExitCode.MUST_NOT_CARRY_ON, True), (code, out, err)
    assert _dump(path) == before and booking.STUB_CALLS == []


def test_show_step_of_a_damaged_snapshot_names_the_damage(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = store
    [(three,)] = _rows(path, "SELECT payload FROM adk_checkpoint_steps WHERE step = 3")
    _execute(path, "UPDATE adk_checkpoint_steps SET payload = ? WHERE step = 3", _flip(three))
    code, _, err = _main(capsys, "--store", url, "show", "r", "--tenant", "t", "--step", "3")
    assert "no step 3" not in err, err
    assert (code, _plain(err)) == (ExitCode.MUST_NOT_CARRY_ON, True), err


def test_runs_lists_healthy_runs_beside_a_damaged_call_record(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = store
    _build(url, "damaged")
    _execute(
        path,
        "UPDATE adk_idempotency SET status = 'bogus' WHERE run_id = 'damaged' "
        "AND tool = 'book_seat'",
    )
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", "t", "--no-header")
    assert code == ExitCode.CARRIED_ON, err
    assert "r  booking  completed" in out and "damaged" in out, out


def test_replay_prints_the_models_answer_redacted(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = store
    leaky = f"{HERE}:leaky_provider"
    text = _replay(capsys, url, "--stub", STUB, "--new-run-id", "x1", provider=leaky)
    as_json = _replay(capsys, url, "--stub", STUB, "--new-run-id", "x2", "--json", provider=leaky)
    assert text[0] == as_json[0] == ExitCode.CARRIED_ON, (text, as_json)
    shown = _main(capsys, "--store", url, "show", "x1", "--tenant", "t")[1]
    assert SECRET not in shown and "[redacted" in shown  # held: what is stored is masked
    for out in (text[1], as_json[1]):
        assert SECRET not in out and BEARER not in out, out


def test_run_resume_prints_the_models_answer_redacted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ask.sqlite3'}"
    assert _build(url, "r", agent=_this().APPROVAL_AGENT).status.value == "waiting_approval"
    [(request,)] = _rows(tmp_path / "ask.sqlite3", "SELECT id FROM adk_approvals")
    code, _, err = _main(capsys, "--store", url, "approve", request, "--tenant", "t",
                         "--by", "alice")  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    code, out, err = _main(capsys, "--store", url, "run", "--resume", "r", "--tenant", "t",
                           "--agent", f"{HERE}:APPROVAL_AGENT",
                           "--provider", f"{HERE}:leaky_provider")  # fmt: skip
    assert code == ExitCode.CARRIED_ON and "now completed" in out, (out, err)
    assert SECRET not in out and BEARER not in out and "[redacted" in out, out


def test_json_output_escapes_every_control_character(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = store
    code, out, err = _replay(
        capsys, url, "--stub", STUB, "--new-run-id", "h", "--json",
        provider=f"{HERE}:hostile_answer_provider",
    )  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    outputs = {"replay": out}
    for command in (("show", "h"), ("inspect", "h"), ("runs",)):
        code, out, err = _main(capsys, "--store", url, *command, "--tenant", "t", "--json")
        assert code == ExitCode.CARRIED_ON, err
        outputs[command[0]] = out
    raw = {
        name: sorted({repr(c) for c in out if not c.isprintable() and c != "\n"})
        for name, out in outputs.items()
    }
    for out in outputs.values():
        json.loads(out)  # held: every one is JSON
    assert raw == {name: [] for name in outputs}, raw


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_show_json_is_json_when_a_tool_answered_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'nan.sqlite3'}"
    turns = [[("quote_price", {"flight": "LH123"})], "no price"]
    _build(url, "p", agent=_this().PRICER, turns=turns)
    code, out, err = _main(capsys, "--store", url, "show", "p", "--tenant", "t", "--json")
    assert code == ExitCode.CARRIED_ON, err
    _strict(out)


def test_a_stub_answer_with_a_lone_surrogate_is_recorded_not_a_crash(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = store
    code, out, err = _replay(capsys, url, "--stub", f"book_seat={HERE}:surrogate_booking")
    assert "UnicodeEncodeError" not in err, err
    assert code == ExitCode.CARRIED_ON, (out, err)


def test_a_replay_that_ends_failed_exits_4(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = store
    code, out, err = _replay(capsys, url, "--stub", STUB, provider=f"{HERE}:rejecting")
    assert "now failed" in out, (out, err)  # held: it says so
    assert code == ExitCode.MUST_NOT_CARRY_ON, (code, out)


def test_inspect_does_not_say_a_live_holder_no_longer_carries_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'live.sqlite3'}"
    airline = _this().AIRLINE
    inside, go_on = threading.Event(), threading.Event()

    def hold(stage: str) -> None:
        if stage == "before":
            inside.set()
            go_on.wait(30)

    airline.hook = hold
    worker = threading.Thread(target=_build, args=(url, "live"))
    worker.start()
    try:
        assert inside.wait(30), "the worker never reached book_seat"
        code, out, err = _main(capsys, "--store", url, "inspect", "live", "--tenant", "t", "--json")
    finally:
        go_on.set()
        worker.join(30)
        airline.hook = None
    assert code == ExitCode.CARRIED_ON, err
    found = json.loads(out)
    [call] = found["calls"]
    assert found["lease"] is not None and found["lease"]["holder"] in call["reason"]  # held
    assert "no longer carries the run" not in call["reason"], call


def test_inspect_json_never_prints_a_secret_a_key_was_built_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'pay.sqlite3'}"
    _build(url, "pay", agent=_this().PAYER, turns=[[("charge", {"card": SECRET})], "done"])
    code, out, err = _main(capsys, "--store", url, "inspect", "pay", "--tenant", "t", "--json")
    assert code == ExitCode.CARRIED_ON, err
    # The call is refused ("not sent": its key would hold the secret), so nobody is asked.
    assert json.loads(out)["status"] == "completed"
    assert SECRET not in out, [line for line in out.splitlines() if SECRET in line]


def test_a_secret_a_key_was_built_from_never_reaches_a_step_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "pay.sqlite3"
    _build(f"sqlite:///{path}", "pay", agent=_this().PAYER,
           turns=[[("charge", {"card": SECRET})], "done"])  # fmt: skip
    stored = [bytes(p) for (p,) in _rows(path, "SELECT payload FROM adk_checkpoint_steps")]
    # The call is refused ("not sent"): its key would hold the secret.
    assert stored and any(b"would hold a secret" in p for p in stored)
    assert not any(SECRET.encode() in p for p in stored)


def test_a_replay_id_too_long_says_to_pass_new_run_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "long.sqlite3"
    url = f"sqlite:///{path}"
    long_id = "r" * 510
    _build(url, long_id)
    before = _dump(path)
    code, _, err = _replay(capsys, url, "--stub", STUB, run=long_id)
    assert _dump(path) == before  # held: nothing written
    assert (code, _plain(err)) == (ExitCode.USAGE, True), err  # held
    assert "--new-run-id" in err, err


# ==========================================================================================
# What held
# ==========================================================================================


def test_replay_of_a_run_a_live_worker_holds_mid_call_leaves_it_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "held.sqlite3"
    url = f"sqlite:///{path}"
    airline = _this().AIRLINE
    bookings_before = list(airline.bookings)
    inside, go_on = threading.Event(), threading.Event()
    finished: list[Any] = []

    def hold(stage: str) -> None:
        if stage == "before":
            inside.set()
            go_on.wait(30)

    airline.hook = hold
    worker = threading.Thread(target=lambda: finished.append(_build(url, "r")))
    worker.start()
    try:
        assert inside.wait(30), "the worker never reached book_seat"
        original = _run_rows(path, "r")
        assert original["adk_run_leases"], original  # the worker holds it now
        code, out, err = _replay(capsys, url, "--stub", STUB, "--new-run-id", "dbg")
        untouched = _run_rows(path, "r") == original
    finally:
        go_on.set()
        worker.join(30)
        airline.hook = None
    assert (code, err) == (ExitCode.CARRIED_ON, ""), err
    assert "replay dbg (replay of r@3) now completed" in out
    assert untouched
    assert booking.STUB_CALLS == [{"flight": "LH123"}]
    assert airline.bookings == [*bookings_before, "LH123"]  # the worker's one booking
    [run] = finished
    assert (run.status.value, run.fence) == ("completed", 1)  # never fenced out


def test_replay_from_a_step_waiting_on_approval_asks_under_its_own_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ask.sqlite3"
    url = f"sqlite:///{path}"
    run = _build(url, "r", agent=_this().APPROVAL_AGENT)
    assert run.status.value == "waiting_approval"
    original = _run_rows(path, "r")
    code, out, err = _replay(capsys, url, "--stub", STUB, "--new-run-id", "dbg",
                             agent=f"{HERE}:APPROVAL_AGENT", step="4")  # fmt: skip
    assert code == ExitCode.CARRIED_ON and "now waiting_approval" in out, err
    assert _run_rows(path, "r") == original
    asked = _rows(path, "SELECT run_id, status FROM adk_approvals ORDER BY run_id")
    assert asked == [("dbg", "pending"), ("r", "pending")]
    assert booking.STUB_CALLS == []
    # Nobody may approve the replay's request into a run that would go out for real.
    [(request,)] = _rows(path, "SELECT id FROM adk_approvals WHERE run_id = 'dbg'")
    code, _, err = _main(capsys, "--store", url, "approve", request, "--tenant", "t",
                         "--by", "alice")  # fmt: skip
    assert code == ExitCode.MUST_NOT_CARRY_ON and _plain(err), err


def test_text_displays_escape_hostile_model_and_tool_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'evil.sqlite3'}"
    assert _build(url, "r", provider=hostile()).status.value == "completed"
    seen = {}
    for command in (
        ("show", "r"),
        ("show", "r", "--step", "3"),
        ("inspect", "r"),
        ("steps", "r"),
        ("runs", "--no-header"),
    ):
        code, out, err = _main(capsys, "--store", url, *command, "--tenant", "t")
        assert code == ExitCode.CARRIED_ON, (command, err)
        seen[command] = out + err
    code, out, err = _replay(capsys, url, "--stub", STUB, step="1", provider=f"{HERE}:hostile")
    assert code == ExitCode.CARRIED_ON, err
    seen[("replay",)] = out + err
    assert "\\x1b" in seen[("show", "r")]  # the codes are there, escaped
    raw = {
        " ".join(command): sorted({repr(c) for c in text if not c.isprintable() and c != "\n"})
        for command, text in seen.items()
    }
    assert raw == {name: [] for name in raw}, raw


@pytest.mark.parametrize(
    ("damage", "argv", "code"),
    [
        (None, ("--from-step", "9"), ExitCode.NOTHING_CHECKPOINTED),
        (None, ("--from-step", "0"), ExitCode.NOTHING_CHECKPOINTED),
        (None, ("--from-step", "-3"), ExitCode.NOTHING_CHECKPOINTED),
        (None, ("--from-step", "3", "--tenant", "other"), ExitCode.NOTHING_CHECKPOINTED),
        (None, ("--from-step", "3e0"), ExitCode.USAGE),
        ("step", ("--from-step", "3"), ExitCode.MUST_NOT_CARRY_ON),
        ("history", ("--from-step", "3"), ExitCode.MUST_NOT_CARRY_ON),
    ],
    ids=[
        "absent",
        "zero",
        "negative",
        "other-tenant",
        "not-an-int",
        "flipped-step",
        "flipped-transcript",
    ],
)
def test_a_step_replay_cannot_use_is_refused_and_nothing_is_written(
    store: tuple[Path, str],
    capsys: pytest.CaptureFixture[str],
    damage: str | None,
    argv: tuple[str, ...],
    code: ExitCode,
) -> None:
    path, url = store
    if damage == "step":
        [(three,)] = _rows(path, "SELECT payload FROM adk_checkpoint_steps WHERE step = 3")
        _execute(path, "UPDATE adk_checkpoint_steps SET payload = ? WHERE step = 3", _flip(three))
    elif damage == "history":
        [(item,)] = _rows(path, "SELECT item FROM adk_history WHERE position = 2")
        _execute(path, "UPDATE adk_history SET item = ? WHERE position = 2", _flip(item))
    before = _dump(path)
    tenant = () if "--tenant" in argv else ("--tenant", "t")
    got, out, err = _main(capsys, "--store", url, "replay", "r", *tenant, *argv,
                          "--agent", f"{HERE}:AGENT", "--provider", "booking:provider",
                          "--stub", STUB, "--json")  # fmt: skip
    assert (got, _plain(err)) == (code, True), err
    assert json.loads(out)["error"]["exit_code"] == code
    assert _dump(path) == before and booking.STUB_CALLS == []


def test_replay_under_a_changed_agent_records_the_revision_it_used(
    store: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = store
    changed = _this().CHANGED_AGENT
    assert changed.revision != _this().AGENT.revision
    code, _, err = _replay(
        capsys, url, "--stub", STUB, "--new-run-id", "v2", agent=f"{HERE}:CHANGED_AGENT"
    )
    assert code == ExitCode.CARRIED_ON, err
    shown = json.loads(_main(capsys, "--store", url, "show", "v2", "--tenant", "t", "--json")[1])
    assert {s["revision"] for s in shown["steps"]} == {changed.revision}
    inspected = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t", "--json")
    original = json.loads(inspected[1])
    assert original["revision"] == _this().AGENT.revision
