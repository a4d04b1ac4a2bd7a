"""Attacks on the newest commits (197ae33..HEAD): the ``aws_secret_key`` rule for 40 base64
characters right after a masked key id, approval stores masking a decision's note and
decider themselves (``decision_texts``), the masked worker name (``AgentRunner(worker=)``,
``Resumer.resume(worker=)``, ``Worker``), the refusal of a ``ctx`` annotated as another type
(``tool_schema._holds_a_context``) and ``check_cancel_request`` before the run is read.

Found, and fixed (their tests pass now: the pair rule reads quotes, line breaks and a table's bars
between the key id and its secret, and a two-item list whose first item is a key id masks
its second, in data and in JSON text; `ctx` annotations the kit cannot check are accepted):

1. (HIGH) ``test_a_quoted_key_pair_keeps_its_secret_masked`` and
   ``test_a_quoted_credentials_csv_from_a_tool_is_stored_masked``: a key id and its secret
   written quoted (a credentials CSV written with quotes, ``"AKIA…","<secret>"``; a JSON
   array ``["AKIA…", "<secret>"]``; a tuple's repr; ``"AKIA…": "<secret>"``) keep the secret
   raw when it holds no ``/`` or ``+`` (about 28% of keys), or starts with ``/`` or ``+``:
   the new rule allows only ``[ \\t]*[:,;=][ \\t]*`` then a quote, never the key id's own
   closing quote, and the standalone rule needs a ``/`` or ``+`` and an alphanumeric first
   character. The tool's result reaches the SQLite file raw.
2. (MEDIUM) ``test_a_key_pair_on_two_lines_or_in_a_table_keeps_its_secret_masked``: the pair
   on two lines (``AKIA…\\n<secret>``, CRLF), in a table (``| AKIA… | <secret> |``), in a CSV
   with an empty column between (``AKIA…,,<secret>``) keeps the secret raw.
3. (LOW) ``test_a_ctx_annotated_optional_of_a_string_tool_context_is_accepted``: a correct
   tool whose ``ctx: Optional["ToolContext"] = None`` is refused (``ConfigurationError``
   saying it is annotated as another type): ``_holds_a_context`` sees a ``ForwardRef``.
4. (LOW) ``test_a_ctx_annotated_with_a_protocol_tool_context_satisfies_is_accepted``: a
   ``ctx`` annotated with a ``typing.Protocol`` that ``ToolContext`` satisfies makes ``tool``
   raise a bare ``TypeError`` from ``issubclass`` (not even a ``ConfigurationError``).

Held: the shapes README names (``:``, ``,``, a space, a tab, ``;``, ``=``, quotes after the
separator, ASIA ids, an unquoted IAM credentials CSV, an s3 URL's userinfo), env/INI/YAML/
boto-repr shapes, prose and longer runs after a key id left alone, masking twice changes
nothing; the same decision twice with another note keeps the first (memory, SQLite, Redis
with its own prefix, PostgreSQL with its own schema), a note and decider decided through
the store's API are kept masked on the Redis and PostgreSQL servers, a CLI note and
``--by`` masked twice (CLI, then store) are stored as masked once and the run goes on,
a long note that grows past 4,000 characters when masked reaches the run cut, a secret in
the arguments of a call waiting for approval is not stored raw, the kit's own decider name
is kept as is; a ``Worker`` and a crashed run's resume under a worker name holding a key
carry the run to the end with the side-effecting call made once and no key kept; ``ctx``
as ``"ToolContext"``, ``ToolContext | None``, ``typing.Optional``, ``Annotated``, ``Any``,
``object``, unannotated, a bound method and a partial are accepted, an ``int`` refused;
``runner.cancel`` refuses a too-long ``by`` (513) / ``reason`` (50,001) for a run that never
began or ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets as pysecrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Optional, Protocol

import pytest

from operator_cli import cli, sqlite_bytes
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import ToolCall
from tesserix_adk.run.approvals import KIT_DECIDER
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols.approvals import decision_texts
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
KID = "AKIAZ7Q3LMN4PQR5STU6"
# 40 base64 characters, both cases and digits, no ``/`` or ``+`` (about 28% of real keys).
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY1"
# One with ``/`` and ``+`` that starts with ``/`` (about 3% of keys start with ``/`` or ``+``).
SLASHED = "/JalrXUtnFEMIK7MDENG+PxRfiCYzEXAMPLEKEY1"
OPENAI = "sk-proj-" + "Zq9yXw8vUt7sRq6pOn5mLk4jIh3gFe2dCb1aZz9yXw8v"
REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"

assert len(SECRET) == len(SLASHED) == 40


def _masked(text: str) -> str:
    return default_redactor().text(text)


# --- the aws_secret_key rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        f"{KID}:{SECRET}",
        f"{KID},{SECRET}",
        f"{KID} {SECRET}",
        f"{KID}\t{SECRET}",
        f"{KID};{SECRET}",
        f"{KID}={SECRET}",
        f"{KID} , {SECRET}",
        f'{KID}:"{SECRET}"',
        f"{KID} = '{SECRET}'",
        f"{KID}:{SLASHED}",
        f"ASIAZ7Q3LMN4PQR5STU6:{SECRET}",
        f"User name,Password,Access key ID,Secret access key\nalice,,{KID},{SECRET}\n",
        f"s3://{KID}:{SECRET}@bucket/key",
    ],
)
def test_the_shapes_readme_names_mask_the_secret(line: str) -> None:
    out = _masked(line)
    assert SECRET not in out and SLASHED not in out and KID not in out, out
    assert "[redacted:aws_secret_key]" in out, out


@pytest.mark.parametrize(
    "text",
    [
        f"AWS_ACCESS_KEY_ID={KID}\nAWS_SECRET_ACCESS_KEY={SECRET}\n",
        f"[default]\naws_access_key_id = {KID}\naws_secret_access_key = {SECRET}\n",
        f"aws_access_key_id: {KID}\naws_secret_access_key: {SECRET}\n",
        f"Credentials(access_key='{KID}', secret_key='{SECRET}', token=None)",
        f'{{"AccessKeyId": "{KID}", "SecretAccessKey": "{SECRET}"}}',
        f"export AWS_SECRET_ACCESS_KEY={SECRET}",
    ],
)
def test_env_ini_yaml_json_and_repr_shapes_mask_the_secret(text: str) -> None:
    out = _masked(text)
    assert SECRET not in out and KID not in out, out


def test_prose_and_longer_runs_after_a_key_id_are_left_alone() -> None:
    prose = f"{KID} is the access key id the documentation uses as its example"
    assert _masked(prose).endswith(" is the access key id the documentation uses as its example")
    assert SECRET + "x" in _masked(f"{KID} {SECRET}x")
    url = f"{KID} https://example.com/a/b"
    assert _masked(url).endswith(" https://example.com/a/b")
    # Without a key id in front a 40-character run of letters and digits (no / or +) stays.
    assert _masked(f"commit {SECRET} merged") == f"commit {SECRET} merged"


@pytest.mark.parametrize(
    "text",
    [
        f"{KID}:{SECRET}",
        f"{KID} {SECRET} and {KID},{SECRET}",
        f"password=hunter2x9 {KID} {SECRET}",
        f"ops {OPENAI}",
    ],
)
def test_masking_twice_is_masking_once(text: str) -> None:
    once = _masked(text)
    assert _masked(once) == once


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (f'Access key ID,Secret access key\n"{KID}","{SECRET}"\n', SECRET),
        (f'["{KID}", "{SECRET}"]', SECRET),
        (f"('{KID}', '{SECRET}')", SECRET),
        (f'"{KID}": "{SECRET}"', SECRET),
        (f'"{KID}","{SLASHED}"', SLASHED),
    ],
    ids=["quoted-csv", "json-array", "tuple-repr", "json-pair", "quoted-csv-leading-slash"],
)
def test_a_quoted_key_pair_keeps_its_secret_masked(text: str, secret: str) -> None:
    out = _masked(text)
    assert KID not in out
    assert secret not in out, out


@pytest.mark.parametrize(
    "text",
    [
        f"{KID}\n{SECRET}\n",
        f"{KID}\r\n{SECRET}\r\n",
        f"| {KID} | {SECRET} |",
        f"{KID},,{SECRET}",
    ],
    ids=["two-lines", "crlf", "table", "empty-column"],
)
def test_a_key_pair_on_two_lines_or_in_a_table_keeps_its_secret_masked(text: str) -> None:
    out = _masked(text)
    assert KID not in out
    assert SECRET not in out, out


def _sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _runner(provider: Any, stores: Stores, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider, stores, lease_policy=LeasePolicy(ttl=1, renew_within=0.5), **kwargs
    )


async def test_a_quoted_credentials_csv_from_a_tool_is_stored_masked(tmp_path: Path) -> None:
    needle = "QZ61CSV"
    secret = (needle + SECRET)[:40]

    @tool(side_effects=False)
    def creds() -> str:
        """Read the downloaded credentials file."""
        return f'"Access key ID","Secret access key"\n"{KID}","{secret}"\n'

    async with open_stores(_sqlite_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = _runner(ScriptedProvider([[("creds", {})], "ok"]), stores)
        run = await runner.run(Agent("c", "C.", [creds]), "go", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    kept = sqlite_bytes(tmp_path)
    assert b"[redacted:aws_access_key_id]" in kept
    assert needle.encode() not in kept


# --- approval stores: decide masks note and by ---------------------------------------------


CALLS = (ToolCall(id="call_1", name="refund", arguments={"order": "o-1"}),)


@contextlib.asynccontextmanager
async def _stores(backend: str, tmp_path: Path) -> AsyncIterator[tuple[Stores, str]]:
    """Stores of ``backend`` under a prefix / schema of our own, and what it kept (read
    after the block: ``kept[0]``)."""
    name = f"nf6_{pysecrets.token_hex(4)}"
    if backend == "memory":
        url = "memory://"
    elif backend == "sqlite":
        url = _sqlite_url(tmp_path)
    elif backend == "redis":
        url = f"{REDIS_URL}?prefix={name}:&allow_volatile=true"
    else:
        import psycopg

        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'CREATE SCHEMA "{name}"')
        url = f"{POSTGRES_URL}?schema={name}"
    try:
        async with open_stores(url) as stores:
            await stores.create_schema()
            yield stores, name
    finally:
        if backend == "redis":
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=name + ":*", count=1000):
                client.delete(key)
            client.close()
        elif backend == "postgres":
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f'DROP SCHEMA "{name}" CASCADE')


def _server_bytes(backend: str, name: str) -> str:
    if backend == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        out: list[str] = []
        for key in client.scan_iter(match=name + ":*", count=1000):
            out.append(key.decode())
            if client.type(key) == b"hash":
                out.extend(
                    x.decode("utf-8", "replace") for kv in client.hgetall(key).items() for x in kv
                )
            elif client.type(key) == b"string":
                out.append(client.get(key).decode("utf-8", "replace"))
        client.close()
        return "\n".join(out)
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
        tables = [
            r[0]
            for r in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (name,),
            )
        ]
        return "\n".join(
            str(r[0])
            for t in tables
            for r in db.execute(f'SELECT t::text FROM "{name}"."{t}" t').fetchall()
        )


@pytest.mark.parametrize("backend", ["memory", "sqlite", "redis", "postgres"])
async def test_the_same_decision_twice_with_another_note_keeps_the_first(
    backend: str, tmp_path: Path
) -> None:
    async with _stores(backend, tmp_path) as (stores, _):
        assert stores.approvals is not None
        request = await stores.approvals.request(T, "r1", CALLS, iteration=1)
        first = await stores.approvals.decide(
            T, request.id, approved=False, by=f"ops {OPENAI}", note=f"no: {KID} {SECRET}"
        )
        again = await stores.approvals.decide(
            T, request.id, approved=False, by="bob", note="another note"
        )
        kept = await stores.approvals.get(T, request.id)
        assert first.note == again.note == kept.note == _masked(f"no: {KID} {SECRET}")
        assert first.by == again.by == kept.by == _masked(f"ops {OPENAI}")
        with pytest.raises(ValueError):
            await stores.approvals.decide(T, request.id, approved=True, by="eve", note="yes")


@pytest.mark.parametrize("backend", ["redis", "postgres"])
async def test_a_note_and_decider_through_the_store_api_are_kept_masked_on_the_server(
    backend: str, tmp_path: Path
) -> None:
    async with _stores(backend, tmp_path) as (stores, name):
        assert stores.approvals is not None
        request = await stores.approvals.request(T, "r1", CALLS, iteration=1)
        await stores.approvals.decide(
            T, request.id, approved=True, by=f"ops {OPENAI}", note=f"creds {KID}:{SECRET}"
        )
        kept = _server_bytes(backend, name)
    assert "[redacted:aws_secret_key]" in kept and "[redacted:openai_key]" in kept
    for raw in (OPENAI, KID, SECRET):
        assert raw not in kept


def test_the_kits_own_decider_and_plain_names_are_kept_as_is() -> None:
    assert decision_texts(KIT_DECIDER, None) == (KIT_DECIDER, None)
    assert decision_texts("ops@acme", "over budget") == ("ops@acme", "over budget")


async def _waiting(url: str, sent: list[str], provider: Any) -> tuple[Agent, Any]:
    @tool(requires_approval=True)
    def refund(order: str) -> str:
        """Refund an order (needs a person)."""
        sent.append(order)
        return "refunded"

    agent = Agent("refunder", "Refund.", [refund])
    async with open_stores(url) as stores:
        await stores.create_schema()
        run = await _runner(provider, stores).run(agent, "refund", tenant=T, run_id="r1")
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    return agent, run


async def _resume(url: str, provider: Any, agent: Agent) -> Any:
    async with open_stores(url) as stores:
        return await _runner(provider, stores).resume(agent, "r1", tenant=T)


async def test_a_cli_note_and_by_masked_by_the_cli_and_the_store_are_masked_once(
    tmp_path: Path,
) -> None:
    url = _sqlite_url(tmp_path)
    sent: list[str] = []
    provider = ScriptedProvider([[("refund", {"order": "o-1"})], "ok"])
    agent, run = await _waiting(url, sent, provider)
    note = f"creds leaked: {KID} {SECRET}; password=hunter2x9"
    by = f"ops {OPENAI}"
    code, out, err = cli(
        "approve", run.pending_approval.id, "--tenant", T, "--by", by, "--deny",
        "--note", note, "--store", url,
    )  # fmt: skip
    assert code == 0, (out, err)
    async with open_stores(url) as stores:
        kept = await stores.approvals.get(T, run.pending_approval.id)
    assert kept is not None
    assert kept.note == _masked(note) and kept.by == _masked(by)
    done = await _resume(url, provider, agent)
    assert done.status is RunStatus.completed and sent == []
    code, shown, _ = cli("show", "r1", "--tenant", T, "--store", url)
    assert code == 0
    stored = sqlite_bytes(tmp_path)
    for raw in (OPENAI, KID, SECRET, "hunter2x9"):
        assert raw not in shown and raw.encode() not in stored


async def test_a_long_note_that_grows_when_masked_reaches_the_run_cut(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path)
    sent: list[str] = []
    provider = ScriptedProvider([[("refund", {"order": "o-1"})], "ok"])
    agent, run = await _waiting(url, sent, provider)
    note = ("password=x9 " * 333)[:3996]  # 3,996 characters; masked, about 10,000
    async with open_stores(url) as stores:
        decided = await stores.approvals.decide(
            T, run.pending_approval.id, approved=False, by="ops", note=note
        )
    assert decided.note is not None and len(decided.note) > 4000
    assert "x9 " not in decided.note
    done = await _resume(url, provider, agent)
    assert done.status is RunStatus.completed and sent == []
    assert b"password=x9" not in sqlite_bytes(tmp_path)


async def test_a_secret_in_a_waiting_calls_arguments_is_not_stored_raw(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path)
    sent: list[str] = []
    order = f"o-1 {KID}:{SECRET}"
    provider = ScriptedProvider([[("refund", {"order": order})], "ok"])
    _, run = await _waiting(url, sent, provider)
    async with open_stores(url) as stores:
        request = await stores.approvals.get(T, run.pending_approval.id)
    assert request is not None and SECRET not in str(request.calls)
    stored = sqlite_bytes(tmp_path)
    assert SECRET.encode() not in stored and KID.encode() not in stored


# --- a worker name holding a key -------------------------------------------------------------


async def test_a_worker_whose_name_holds_a_key_carries_its_runs(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path)
    sent: list[str] = []

    @tool
    def charge(order: str) -> str:
        """Charge an order (side effects)."""
        sent.append(order)
        return "charged"

    agent = Agent("charger", "Charge.", [charge])
    provider = ScriptedProvider([[("charge", {"order": "o-1"})], "done"])
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = _runner(provider, stores, worker=f"w-1 {OPENAI}")
        assert OPENAI not in runner.worker
        await runner.submit(agent, "go", tenant=T, run_id="r1")
        worker = Worker(runner, [agent], poll_interval=0.01, exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 10)
        latest = await runner.checkpoints.latest(T, "r1")
    assert latest is not None and latest.status.finished
    assert sent == ["o-1"]
    assert OPENAI.encode() not in sqlite_bytes(tmp_path)


async def test_a_crashed_run_resumed_under_the_same_secret_worker_name_goes_on(
    tmp_path: Path,
) -> None:
    url = _sqlite_url(tmp_path)
    sent: list[str] = []
    crashes: list[int] = []

    @tool
    def charge(order: str) -> str:
        """Charge an order (side effects)."""
        sent.append(order)
        return "charged"

    @tool(side_effects=False)
    def look(order: str) -> str:
        """Look an order up."""
        if not crashes:
            crashes.append(1)
            raise SimulatedCrash("the process died")
        return "fine"

    agent = Agent("charger", "Charge.", [charge, look])
    turns: list[Any] = [[("charge", {"order": "o-1"})], [("look", {"order": "o-1"})], "done"]
    name = f"w {KID}:{SECRET}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        with contextlib.suppress(SimulatedCrash):
            await _runner(ScriptedProvider(list(turns)), stores, worker=name).run(
                agent, "go", tenant=T, run_id="r1"
            )
        await asyncio.sleep(1.1)  # the dead attempt's lease lapses
        runner = _runner(ScriptedProvider(list(turns)), stores, worker=name)
        run = await runner.resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert sent == ["o-1"]
    stored = sqlite_bytes(tmp_path)
    assert SECRET.encode() not in stored and KID.encode() not in stored


# --- ctx annotations ---------------------------------------------------------------------------


class HasRunId(Protocol):
    run_id: str


def test_ordinary_ctx_annotations_are_accepted() -> None:
    def a(order: str, ctx: ToolContext) -> str:
        """A."""
        return order

    def b(order: str, ctx: ToolContext | None = None) -> str:
        """B."""
        return order

    def c(order: str, ctx: Optional[ToolContext] = None) -> str:  # noqa: UP045
        """C."""
        return order

    def d(order: str, ctx: Annotated[ToolContext, "the context"]) -> str:
        """D."""
        return order

    def e(order: str, ctx: Any) -> str:
        """E."""
        return order

    def f(order: str, ctx: object) -> str:
        """F."""
        return order

    def g(order, ctx):  # type: ignore[no-untyped-def]
        """G."""
        return order

    def h(order: str, note: str, ctx: ToolContext) -> str:
        """H."""
        return order

    class Shop:
        def charge(self, order: str, ctx: ToolContext) -> str:
            """Charge."""
            return order

    for fn in (a, b, c, d, e, f, g, Shop().charge, functools.partial(h, note="n")):
        made = tool(name="t")(fn)
        assert "ctx" not in str(made.parameters), made.parameters


def test_a_ctx_annotated_as_another_type_is_refused_clearly() -> None:
    def wrong(order: str, ctx: int) -> str:
        """Wrong."""
        return order

    with pytest.raises(ConfigurationError, match="ctx"):
        tool(wrong)


def test_a_ctx_annotated_optional_of_a_string_tool_context_is_accepted() -> None:
    def charge(order: str, ctx: Optional["ToolContext"] = None) -> str:  # noqa: UP045, UP037
        """Charge."""
        return order

    tool(charge)


def test_a_ctx_annotated_with_a_protocol_tool_context_satisfies_is_accepted() -> None:
    def charge(order: str, ctx: HasRunId) -> str:
        """Charge."""
        return order

    tool(charge)


# --- cancel checks before the run is read ---------------------------------------------------


async def test_cancel_refuses_a_too_long_by_or_reason_whatever_the_run(tmp_path: Path) -> None:
    async with open_stores(_sqlite_url(tmp_path)) as stores:
        await stores.create_schema()
        runner = _runner(ScriptedProvider(["ok"]), stores)
        with pytest.raises(ConfigurationError, match="at most"):
            await runner.cancel("never-began", tenant=T, by="x" * 513)
        run = await runner.run(Agent("a", "A."), "hi", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
        with pytest.raises(ConfigurationError, match="at most"):
            await runner.cancel("r1", tenant=T, by="ops", reason="r" * 50_001)
        left = await runner.cancel("r1", tenant=T, by="ops", reason="fine")
        assert left is not None and left.status is RunStatus.completed  # left as it is
