"""Attack on 87410df, 679b04b and d4a593b: ``run/model_sight.py`` ``ModelSight.near`` (an
exception read level by level, nearest first, for ``MOST_READ_NEAR`` = 500,000 values
before the Tarjan look of 100,000), dicts read lazily in ``_parts``, ``run/error_text.py``,
``result_data._key_name`` (an ``Enum`` key written as its value without a look) and
``result_kinds._serialized_inside``; then ``adapters/postgres/opening.py`` ``_split_url``
(a quoted piece of the user/password masked in libpq's error), ``tesserix ui`` masking its
error, and ``console/app.py`` ``create_app`` refusing off loopback without a token. End to
end through ``AgentRunner`` on SQLite with a keyed tool where it matters: the call's record,
the SQLite file's bytes and what the model was told, searched for a secret that only a
model's ``field_serializer(when_used="json")`` masks.

Found, and fixed (``near`` asks each value as it is read; ``error_text`` never writes an
exception's ``repr``, and a look that raises takes the error to show a model; containers
are read lazily, a ValidationError of more than 1,000 errors is not looked into and is
written as a count; an enum key is asked through its value; ``_libpq_said`` says no
quoted piece but an option's name or a mark of punctuation, and none where the user,
password or query holds a quote; a loopback-only console refuses a peer of another
machine whatever its Host; ``tesserix ui`` says a refused token in one sentence; a
serializer behind a type alias is found):

HIGH
- ``test_a_model_beside_half_a_million_values_never_shows_what_it_masks``: ``near`` asks
  whether a part is a model only when it takes it off its queue, not when it reads it: a
  model read second, beside a list of 500,001 ids (or a bulk error's 500,001 rows), waits
  behind the list, whose reading spends the budget first; ``near`` answers no, the Tarjan
  look is past its 100,000, and ``error_text`` writes ``str(exc)``, the model's repr.
  README: "read level by level, nearest first, for 500,000 values": the model is the 2nd
  value read. End to end the secret is raw in the SQLite file and told to the model.
- ``test_an_error_whose_text_raises_never_shows_what_it_masks``: ``error_text``'s fallback,
  when ``_said`` raises, writes ``(its text cannot be read) {exc!r}`` with no look at all:
  ``ValueError("save failed", card, row)`` where ``str(row)`` raises (an ORM row detached
  from its session) writes ``ValueError('save failed', _Card(memo='<secret>'), ...)``; end
  to end raw in the SQLite file.
- ``test_a_dict_grown_while_looked_through_never_shows_what_it_masks``: the same fallback,
  reached by the lazy dict reading this commit made: a dict of results another thread is
  still filling grows while ``shows`` reads it, ``dictionary changed size during
  iteration`` escapes ``_said``, and the ``repr`` written holds the model just added.
- ``test_an_enum_key_holding_a_model_never_shows_what_it_masks``: ``_key_name`` skips the
  look for an ``Enum`` key ("written as its value"), but pydantic writes an enum key whose
  value is a (frozen) model, or a tuple holding one, as that value's ``str``:
  ``{Plan.GOLD: 3}`` is recorded as ``{"memo='<secret>'": 3}`` (the look, before 87410df,
  found the model in ``_value_``). End to end raw in the SQLite file.
- ``test_no_command_prints_a_postgres_password_libpq_quotes``: ``_split_url`` masks a quoted
  piece only when it lies in the URL's userinfo: a password given as ``?password=`` (libpq
  reads it, README's URLs allow it) holding ``%00`` is printed in clear by every command
  (``runs``, ``ui``); a password holding a ``"`` and a stray ``%`` has libpq's quote cut at
  the ``"`` by ``_QUOTED``, so only its head is masked and its tail printed.

MEDIUM
- ``test_a_validation_error_of_many_rows_is_read_within_the_budget``: ``_parts`` builds
  every error of a ``ValidationError`` (``errors()``: a dict each) before one is counted,
  once in ``near`` and again in ``shows``: a tool refusing an import of 1,000,000 rows held
  the event loop about 5 s in the look alone (``str`` took 1 s); README: "a few hundredths
  of a second at most". Sets, deques and a ``Counter`` are still listed whole (the comment
  "read lazily, a dict's subclass too (a Counter)" is not what the code does: ``list(items)``;
  a ``Counter`` of 5,000,000 ids took 0.5 s); the earlier test counting a dict subclass's
  ``items()`` passes only because ``dict.items(value)`` no longer calls it.
- ``test_a_serializer_behind_a_type_alias_is_not_counted``: ``_serialized_inside`` looks
  through ``get_args`` only: ``Embedding = TypeAliasType("Embedding", Annotated[list[float],
  PlainSerializer(...)])`` (Python 3.12's ``type Embedding = ...``, as pydantic's docs name
  types) is counted in full, so 10,000 search hits of 768 floats, written as 10,000 short
  texts, are refused as past ``MOST_WALKED`` and the completed call's result is lost.
- ``test_a_loopback_only_console_refuses_a_peer_off_loopback``: ``create_app(url)`` (no
  token, ``loopback_only`` left on) trusts the ``Host`` header alone: served on 0.0.0.0 by
  an embedder (a container must bind it), a peer on the network naming ``Host: 127.0.0.1``
  reads every page and approves a waiting call; ``request.client`` is never asked.

LOW
- ``test_libpq_errors_keep_what_is_not_the_password``: every quoted piece found anywhere in
  the userinfo is masked: the ``"="`` of "extra key/value separator "=" in URI query
  parameter" when a base64 password ends in ``=`` (``?options=-csearch_path=app``), and an
  option name that is part of the user name (``sslmod`` for user ``sslmode_ro``): the
  operator is told ``"***"`` where the mistake is named.
- ``test_tesserix_ui_with_a_blank_token_off_loopback_is_one_sentence``: ``tesserix ui
  --host 0.0.0.0 --token " "`` (or ``$TESSERIX_UI_TOKEN`` set to blanks) passes ``run_ui``'s
  check, binds the port, then ``create_app`` raises ``ConfigurationError`` out of ``main``
  (a traceback, not exit 2 with a sentence as for no token).

Held:
- ``test_a_model_within_the_budgets_never_shows_what_it_masks``: a model beside 400,000
  ids, inside a dict beside 400,000 ids, or an attribute beside 200,000 rows, is found.
- ``test_an_enum_key_of_plain_values_is_written_as_its_value``: enum keys whose value is
  text, a number or a tuple of them, or whose attribute (not value) holds a model.
- ``test_a_serializer_inside_a_field_type_is_found``: ``dict[str, Embedding]``, a string
  annotation ``"Embedding | None"``, ``Optional[Later]`` resolved by ``model_rebuild``.
- ``test_other_libpq_errors_print_no_password``: ``?password=`` with ``%zz``, a space, a
  ``#`` fragment, a bad port, a user holding ``%``, ``schema=`` beside a bad password.
- ``test_create_app_refuses_a_blank_token_off_loopback``: blanks, tabs and newlines refused.
- ``test_a_loopback_peer_is_served``: the counterpart of the console finding.

Not attacked within the time box: ``create_app``'s lifespan error (a bad URL raised at the
server's start-up, not a page) and a token padded with blanks compared to a stripped Bearer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import io
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Optional

import pydantic
import pytest
import typing_extensions
from starlette.testclient import TestClient

from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, tool
from tesserix_adk.cli import ui
from tesserix_adk.cli.main import main
from tesserix_adk.console import create_app
from tesserix_adk.run import model_sight, result_data
from tesserix_adk.run.error_text import MOST_READ_NEAR, error_text
from tesserix_adk.run.model_sight import MOST_LOOKED_AT_IN_AN_ERROR
from tesserix_adk.run.result_data import result_content
from tesserix_adk.stores.protocols import ApprovalStatus
from tesserix_adk.stores.urls import open_stores

from .masked_model import (
    SECRET,
    assert_never_shown,
    raising,
    run_on_sqlite,
)
from .masked_model import (
    Card as _Card,
)
from .masked_model import (
    card as _card,
)

T = "nearurl"


async def _run_on_sqlite(tmp_path: Path, act: Any) -> tuple[Any, bytes, str, int]:
    return await run_on_sqlite(tmp_path, act, tenant=T, resumed=False)


async def _assert_never_shown(tmp_path: Path, act: Any) -> Any:
    return await assert_never_shown(tmp_path, act, tenant=T, resumed=False)


# --- near: a model read beside a large value ----------------------------------------------


class _BulkError(Exception):
    """A bulk write that failed at one row: the batch, then the row that broke it."""

    def __init__(self, rows: list[Any], bad: Any) -> None:
        super().__init__("bulk insert failed")
        self.rows = rows
        self.bad = bad

    def __str__(self) -> str:
        return f"bulk insert failed at {self.bad!r}"


def _ids_then_model(n: int) -> BaseException:
    return ValueError(list(range(n)), _card())


def _bulk(n: int) -> BaseException:
    return _BulkError([(i, "ok") for i in range(n)], _card())


def _dict_then_model(n: int) -> BaseException:
    return ValueError({"ids": list(range(n)), "card": _card()})


_PAST = MOST_READ_NEAR + 1


@pytest.mark.parametrize("make", [_ids_then_model, _bulk], ids=["ids-then-model", "bulk-error"])
def test_a_model_beside_half_a_million_values_never_shows_what_it_masks(make: Any) -> None:
    assert MOST_READ_NEAR == 500_000
    said = error_text(make(_PAST))
    assert SECRET not in said, said[-200:]


async def test_a_bulk_error_beside_half_a_million_rows_end_to_end(tmp_path: Path) -> None:
    outcome = await _assert_never_shown(tmp_path, raising(lambda: _bulk(_PAST)))
    assert "bulk insert failed" in str(outcome.content)


@pytest.mark.parametrize(
    ("make", "n"),
    [(_ids_then_model, 400_000), (_dict_then_model, 400_000), (_bulk, 200_000)],
    ids=["ids-then-model", "dict", "bulk-error"],
)
def test_a_model_within_the_budgets_never_shows_what_it_masks(make: Any, n: int) -> None:
    """Held: within 500,000 values read nearest first, the model is found past the Tarjan
    look's 100,000."""
    assert n > MOST_LOOKED_AT_IN_AN_ERROR
    said = error_text(make(n))
    assert SECRET not in said, said[-200:]


# --- error_text's fallback writes the repr unexamined --------------------------------------


class _DetachedRow:
    """An ORM row whose ``__str__`` reads a column its closed session can no longer load."""

    def __str__(self) -> str:
        raise RuntimeError("Instance <Row> is not bound to a Session")


def _detached() -> BaseException:
    return ValueError("save failed", _card(), _DetachedRow())


def test_an_error_whose_text_raises_never_shows_what_it_masks() -> None:
    said = error_text(_detached())
    assert said.startswith("ValueError: ")
    assert SECRET not in said, said


async def test_an_error_whose_text_raises_end_to_end(tmp_path: Path) -> None:
    await _assert_never_shown(tmp_path, raising(_detached))


class _Pending(Mapping[Any, Any]):
    """A result not in yet: reading it (the second time) lets the worker thread finish,
    which adds its result to the shared dict (a GIL switch, made sure of)."""

    def __init__(self, worker: threading.Thread, go: threading.Event) -> None:
        self.worker = worker
        self.go = go
        self.asked = 0

    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def items(self) -> Any:
        self.asked += 1
        if self.asked == 2:
            self.go.set()
            self.worker.join(5)
        return []

    def __repr__(self) -> str:
        return "<pending>"


class _PartialFailure(Exception):
    def __init__(self, results: dict[str, Any]) -> None:
        super().__init__("2 of 3 sends failed", results)


def test_a_dict_grown_while_looked_through_never_shows_what_it_masks() -> None:
    go = threading.Event()
    results: dict[str, Any] = {}

    def finish() -> None:  # a worker thread still filling the results in
        go.wait(5)
        results["c3"] = _card()

    worker = threading.Thread(target=finish)
    results["c1"] = _Pending(worker, go)
    worker.start()
    try:
        said = error_text(_PartialFailure(results))
    finally:
        go.set()
        worker.join(5)
    assert SECRET not in said, said


# --- enum keys ----------------------------------------------------------------------------


class _Plan(enum.Enum):
    GOLD = _Card(memo=SECRET)


class _Tier(enum.Enum):
    GOLD = ("gold", _Card(memo=SECRET))


@pytest.mark.parametrize("key", [_Plan.GOLD, _Tier.GOLD], ids=["model-value", "tuple-value"])
def test_an_enum_key_holding_a_model_never_shows_what_it_masks(key: Any) -> None:
    for result in ({key: 3}, {key: 3, 7: 1}, [{key: 3}]):
        written = result_content(result)
        assert SECRET not in str(written), written


async def test_an_enum_key_holding_a_model_end_to_end(tmp_path: Path) -> None:
    await _assert_never_shown(tmp_path, lambda: {_Plan.GOLD: 3, "total": 3})


class _Colour(enum.Enum):
    RED = "red"
    BLUE = ("blue", 2)


class _Flagged(enum.Enum):
    ON = 1

    def __init__(self, value: int) -> None:
        self.card = _Card(memo=SECRET)

    def __str__(self) -> str:
        return f"ON {self.card!r}"


def test_an_enum_key_of_plain_values_is_written_as_its_value() -> None:
    """Held."""
    assert result_content({_Colour.RED: 1}) == {"red": 1}
    assert SECRET not in str(result_content({_Colour.BLUE: 1, 2: 3}))
    assert result_content({_Flagged.ON: 1}) == {"1": 1}
    assert SECRET not in str(result_content({_Flagged.ON: 1, 1: 2}))


# --- what is read on the event loop -------------------------------------------------------


def _counting_parts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each ``_parts`` answer built whole (a list), by its length: read before counted."""
    built: list[int] = []
    parts = model_sight._parts

    def counted(value: Any, kind_holds: Any) -> Any:
        got = parts(value, kind_holds)
        if isinstance(got, list) and not (type(value) is list and got is value):
            built.append(len(got))
        return got

    monkeypatch.setattr(model_sight, "_parts", counted)
    return built


def _rows_refused(n: int) -> BaseException:
    try:
        pydantic.TypeAdapter(list[int]).validate_python(["n/a"] * n)
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("validated")


_BOUND = MOST_READ_NEAR + MOST_LOOKED_AT_IN_AN_ERROR


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: _rows_refused(700_000),
            id="validation-error",
        ),
        pytest.param(
            lambda: ValueError("failed", collections.Counter(range(700_000))),
            id="counter",
        ),
        pytest.param(
            lambda: ValueError("failed", set(range(700_000))),
            id="set",
        ),
    ],
)
def test_a_validation_error_of_many_rows_is_read_within_the_budget(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    exc = make()
    built = _counting_parts(monkeypatch)
    said = error_text(exc)
    assert said.startswith(type(exc).__name__)
    assert sum(built) <= _BOUND, f"{sum(built)} values read before being counted"


# --- serializers inside a field's type ----------------------------------------------------


def _summary(v: list[float]) -> str:
    return f"<{len(v)} floats>"


Embedding = Annotated[list[float], pydantic.PlainSerializer(_summary)]
NamedEmbedding = typing_extensions.TypeAliasType(
    "NamedEmbedding", Annotated[list[float], pydantic.PlainSerializer(_summary)]
)


class _InDict(pydantic.BaseModel):
    e: dict[str, Embedding]


class _Forward(pydantic.BaseModel):
    e: Embedding | None = None


class _Later(pydantic.BaseModel):
    e: Optional[LaterEmbedding] = None  # noqa: UP045 - the spelling under attack


LaterEmbedding = Embedding
_Later.model_rebuild()


class _Aliased(pydantic.BaseModel):
    e: NamedEmbedding


class _OptionalAliased(pydantic.BaseModel):
    e: NamedEmbedding | None = None


def _refused(value: Any, budget: int) -> bool:
    try:
        result_data._walked(value, result_data._Walk(values=budget))
    except result_data._TooMany:
        return True
    return False


@pytest.mark.parametrize(
    ("kind", "given"),
    [
        (_InDict, {"e": {"q": [0.5] * 100}}),
        (_Forward, {"e": [0.5] * 100}),
        (_Later, {"e": [0.5] * 100}),
    ],
    ids=["dict-value", "string-annotation", "rebuilt-forward-ref"],
)
def test_a_serializer_inside_a_field_type_is_found(kind: Any, given: Any) -> None:
    """Held."""
    hits = [kind.model_validate(given) for _ in range(100)]
    assert "<100 floats>" in str(hits[0].model_dump(mode="json"))
    assert not _refused(hits, 10 * len(hits))


@pytest.mark.parametrize("kind", [_Aliased, _OptionalAliased], ids=["alias", "optional-alias"])
def test_a_serializer_behind_a_type_alias_is_not_counted(kind: Any) -> None:
    hits = [kind(e=[0.5] * 100) for _ in range(100)]
    assert pydantic.TypeAdapter(Any).dump_python(hits[0], mode="json") == {"e": "<100 floats>"}
    assert not _refused(hits, 10 * len(hits))


# --- PostgreSQL URLs: what libpq quotes ----------------------------------------------------

PW = "cretPw9Zq"  # the tail of every password below: never printed


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


_COMMANDS = (("runs", "--tenant", "t"), ("ui", "--port", "0"))


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app@db.internal.invalid/prod?password=Se%00{PW}",
        f"postgresql://app@db.internal.invalid/prod?sslmode=require&password=Se%00{PW}",
        f'postgresql://app:Se"{PW}%zz@db.internal.invalid/prod',
        f'postgresql://app:Se%2"{PW}@db.internal.invalid/prod',
    ],
    ids=["query-password-nul", "query-password-second", "quote-then-percent", "percent-quote"],
)
def test_no_command_prints_a_postgres_password_libpq_quotes(url: str) -> None:
    for command in _COMMANDS:
        code, said = _cli("--store", url, *command)
        assert code == 2, said
        assert PW not in said, (command, said)


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app@db.internal.invalid/prod?password=Se%zz{PW}",
        f"postgresql://app:Se {PW}%zz@db.internal.invalid/prod",
        f"postgresql://app:Se%zz{PW}@db.internal.invalid/prod#part",
        f"postgresql://app:Se{PW}@db.internal.invalid:54x32/prod",
        f"postgresql://us%er:Se{PW}@db.internal.invalid/prod",
        f"postgresql://app:Se%zz{PW}@db.internal.invalid/prod?schema=tenant_a",
        f"postgresql://app:Se{PW}@db.internal.invalid/prod?application_name=a%zz",
        f"postgresql://app:Se{PW}@[::1/prod",
    ],
    ids=["query-pw-%zz", "space", "fragment", "port", "user-%", "schema", "app-name", "ipv6"],
)
def test_other_libpq_errors_print_no_password(url: str) -> None:
    """Held: one sentence, exit 2, no password."""
    for command in _COMMANDS:
        code, said = _cli("--store", url, *command)
        assert code == 2, said
        assert PW not in said, (command, said)
        assert "Traceback" not in said


@pytest.mark.parametrize(
    ("url", "named"),
    [
        (
            "postgresql://app:c2VjcmV0cHc=@db.internal.invalid/prod?options=-csearch_path=app",
            '"="',
        ),
        ("postgresql://sslmode_ro:pw@db.internal.invalid/prod?sslmod=require", '"sslmod"'),
    ],
    ids=["equals-sign", "option-in-user-name"],
)
def test_libpq_errors_keep_what_is_not_the_password(url: str, named: str) -> None:
    code, said = _cli("--store", url, "ui", "--port", "0")
    assert code == 2, said
    assert named in said, said


# --- the console off loopback -------------------------------------------------------------


@pytest.mark.parametrize("blank", [" ", "\t", "\n", "  \r\n"])
def test_create_app_refuses_a_blank_token_off_loopback(blank: str, tmp_path: Path) -> None:
    """Held."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    with pytest.raises(Exception, match="token"):
        create_app(url, token=blank, loopback_only=False)


@pytest.mark.parametrize("where", ["flag", "environment"])
def test_tesserix_ui_with_a_blank_token_off_loopback_is_one_sentence(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    argv = ["--store", url, "ui", "--host", "0.0.0.0", "--port", "0"]
    if where == "flag":
        argv += ["--token", " "]
    else:
        monkeypatch.setenv("TESSERIX_UI_TOKEN", " \n")
    bound: list[Any] = []
    listen = ui._listen

    def tracked(host: str, port: int) -> Any:
        bound.append(listen(host, port))
        return bound[-1]

    monkeypatch.setattr(ui, "_listen", tracked)
    try:
        code, said = _cli(*argv)
    finally:
        for sock in bound:  # left open when create_app raises past it
            sock.close()
    assert code == 2, said
    assert "token" in said


async def _waiting(url: str) -> str:
    @tool(requires_approval=True)
    def book_seat(flight: str) -> dict[str, str]:
        """Book a seat (needs a person's approval)."""
        return {"booking": "B1"}

    async with open_stores(url) as stores:
        await stores.create_schema()
        result = await AgentRunner.from_stores(
            ScriptedProvider([[("book_seat", {"flight": "LH123"})], "Booked."]), stores
        ).run(Agent("approver", "Book.", [book_seat]), "book", tenant=T, run_id="r-wait")
        assert result.status is RunStatus.waiting_approval
        assert result.pending_approval is not None
        return str(result.pending_approval.id)


async def _approval_status(url: str, request_id: str) -> ApprovalStatus:
    async with open_stores(url) as stores:
        got = await stores.approvals.get(T, request_id)
        assert got is not None
        return got.status


def test_a_loopback_only_console_refuses_a_peer_off_loopback(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    request_id = asyncio.run(_waiting(url))
    base = "http://127.0.0.1:8765"
    app = create_app(url)  # no token, loopback_only left on: the embedder's defaults
    with TestClient(app, base_url=base, client=("203.0.113.9", 40411)) as stranger:
        listing = stranger.get(f"/t/{T}/runs", follow_redirects=False)
        csrf = stranger.cookies.get("tesserix_csrf") or ""
        stranger.post(
            f"/t/{T}/approvals/{request_id}",
            data={"csrf": csrf, "by": "stranger", "decision": "approve"},
            headers={"origin": base},
            follow_redirects=False,
        )
    decided = asyncio.run(_approval_status(url, request_id))
    assert decided is ApprovalStatus.pending, decided
    assert listing.status_code >= 400, listing.status_code


def test_a_loopback_peer_is_served(tmp_path: Path) -> None:
    """Held (the counterpart): a loopback peer on a loopback console is served."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    asyncio.run(_waiting(url))
    with TestClient(create_app(url), base_url="http://127.0.0.1:8765") as local:
        page = local.get(f"/t/{T}/runs")
    assert page.status_code == 200
    assert "r-wait" in page.text
