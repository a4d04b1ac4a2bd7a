"""Attacks on commit 2bc014f (README guarantee 7, redaction): keys glued to a word
(``patterns._mixed``), the standalone AWS secret rule that now wants a digit and no ``.``
or ``:`` glued before it, a list or object under a credential key in free text masked
whole (``free_text._structure_end``), a string prefix opening a quoted value (``b'…'``)
and ``_pwd`` as a password name.

Run-level tests use the real ``AgentRunner`` on a SQLite file with a scripted model; an
approval-gated (keyed, side-effecting) tool is approved through the CLI and the run
resumed, so a masked argument shows as a call answered "not sent" (README item 7: "A
masked call is never sent"), and a masked result as what the resumed model is told.

A strict xfail is a defect (its reason says which); a plain test is a promise that held.

Defects (false positives: ordinary content masked, so an approved call is never sent):

1. (MEDIUM) ``test_a_slug_with_sk_admin_inside_is_sent_after_approval``: the glued-key
   rule takes any word ending in ``sk`` (task, desk, flask, disk, ask) followed by
   ``-admin-``/``-proj-``/``-svcacct-`` and 20 characters with a digit and both cases for
   a key: ``https://github.com/acme/flask-admin-SQLAlchemy2-Examples`` and the branch
   ``task-admin-Dashboard-Redesign-2024`` are masked, the approved call is "not sent".
2. (MEDIUM) ``test_a_url_path_after_a_hyphen_is_sent_after_approval``: README says a URL's
   path "is never taken for" an AWS secret; a path run of 40 characters that starts after a
   ``-`` or ``_`` (``…/user-guide/Chapter2/InstallingOnWindows/Step1.html``) still is.
   The fix only excluded ``.`` and ``:`` before the run.
3. (MEDIUM) ``test_a_helm_template_under_a_password_key_is_sent_after_approval``: a
   template placeholder (``password: {{ .Values.db.password }}``, Helm) or a schema
   (``password: { type: String, required: true }``, Mongoose) is now masked whole as an
   object under a credential key; before the change it stayed (a value starting with
   ``{`` was none), so an agent writing a chart or a model file is never sent.
4. (MEDIUM) ``test_prose_after_a_link_with_an_apostrophe_under_password_reaches_the_model``:
   ``password: [Don't share it](…)`` in a document: the apostrophe opens a "quote" that
   never closes (quotes are skipped across lines), so everything after it, up to 16 KiB,
   is masked: the resumed model is told ``Reset your password: [redacted:password]`` and
   nothing of the rest of the page. Before 2bc014f only nothing was masked there.
5. (LOW, arguable) ``test_a_name_ending_in_pwd_holding_a_directory_is_sent``: ``_pwd``
   as a last word also names directories (``ORIG_PWD``, ``START_PWD``, as ``OLDPWD``
   does); ``ORIG_PWD=/srv/app`` is masked and a shell call passing it is never sent.

Defects (leaks the new rules miss):

6. (MEDIUM, regression) ``test_an_aws_key_pair_joined_by_a_colon_is_masked``: the
   standalone rule now refuses a key glued to a ``:``; ``ACCESS_KEY_ID:SECRET_ACCESS_KEY``
   (s3fs' passwd file, rclone/duck URLs and many CLIs take this form) masks the key id and
   stores the secret. The same line was masked before 2bc014f.
7. (LOW-MEDIUM) ``test_glued_keys_in_other_issued_shapes_are_masked``: only
   ``sk-proj-``/``sk-svcacct-``/``sk-admin-`` and ``sk-ant-api|admin NN-`` are recognised
   glued; ``sk-ant-oat01-``/``sk-ant-ort01-`` (Anthropic OAuth tokens), a legacy
   ``sk-`` + 48 (with ``T3BlbkFJ``), ``sk-None-`` keys, and any of them after a URL
   escape (``Bearer%20sk-…``, the commonest way a key gets "glued") stay raw.
8. (LOW) ``test_a_glued_key_wrapped_across_lines_is_masked``: a glued key wrapped with a
   head shorter than 20 characters, or a head without a digit, is not masked (the
   unglued rule masks both).
9. (LOW) ``test_a_bytearray_repr_under_a_credential_key_is_masked``:
   ``{'password': bytearray(b'…')}`` masks the word ``bytearray`` and keeps the bytes.
10. (LOW) ``test_a_json_escaped_object_with_a_brace_in_a_string_is_masked_whole``: in
    JSON-escaped text every quote is ``\\"``, which ``_structure_end`` skips as an escape,
    so a ``}`` inside a string (a password with a symbol) closes the object early and the
    rest of it is stored.
11. (LOW) ``test_an_object_under_a_credential_key_past_the_cap_is_masked_whole``: past
    16 KiB the look stops and what follows the cap is stored (a large CA bundle then
    ``"pass": "…"``).

Held: glued ``sk-proj-``/``sk-svcacct-``/``sk-admin-`` keys with ``_``/``-`` heavy bodies
and ``sk-ant-api03-``/``sk-ant-admin01-`` are masked in a whole run; ``\\"token\\":
[\\"…\\"]``, multi-line lists and byte prefixes (``b''``, ``rb""``, ``B''``) are masked;
lower-case slugs, ``PWD``/``OLDPWD`` and a URL with no ``-``/``_`` in its path stay; the
new code is linear on hostile inputs (exact output at two sizes).

Fixed (markers removed): 1 (a glued key wants 40 characters and a run of 16 letters and
digits, ``patterns._random``), 2 and 6 (the standalone AWS secret is never glued to
``. : _ ~ % # @ & -``, save the ``:`` after a masked key id), 3 and 4 (only a list or object
as data writes one is masked whole, ``free_text._STRUCTURE_START``), 7 (glued
``sk-ant-<word><NN>-``, ``sk-None-``, legacy ``…T3BlbkFJ…`` and after a URL escape), 9
(``bytearray(b'…')``), 10 (an escaped structure is read through its escapes), 11 (no cap:
a structure that never closes is masked to the end, still reading each character once).
Left, and named in README: 5 (``_pwd`` masks whatever it holds) and 8.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_redaction_hostile import KIB, _fill, hang_guard

from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedTurn, tool
from tesserix_adk.checkpoint.redaction import default_redactor
from test_attacks_secrets import (
    Recording,
    _opened,
    cli,
    cli_views,
    log_text,
    sqlite_everything,
)

T = "acme"
M = "[redacted:"

# Built from parts so no source line looks like a credential to a scanner.
SK = "sk" + "-"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"
AWS_ID = "AKIA" + "IOSFODNN7EXAMPLE"
BODY = "Ab3dEf9hIjKlMnOpQrStUvWxYz0123456789abcdEFGH"


def redact(text: str) -> str:
    return default_redactor().text(text)


# --- rigs ----------------------------------------------------------------------------------


class Approved:
    """What happened to an approval-gated call: what the tool got, what the model was told
    after the resume, and every byte the SQLite file holds."""

    def __init__(self, sent: list[Any], told: list[str], stored: str) -> None:
        self.sent, self.told, self.stored = sent, told, stored


def approved_call(tmp_path: Path, args: dict[str, Any], *, read: str | None = None) -> Approved:
    """The model (optionally after reading ``read`` with a read-only tool) asks for a
    keyed, approval-gated ``act(payload=args)``; a person approves it with the CLI; the run
    resumes and completes."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[Any] = []

    @tool(requires_approval=True)
    def act(payload: dict[str, Any]) -> str:
        """Does something a person approves."""
        sent.append(payload)
        return "done"

    @tool(side_effects=False)
    def fetch_doc() -> str:
        """Reads a document."""
        return read or ""

    turns: list[Any] = []
    if read is not None:
        turns.append([("fetch_doc", {})])
    turns += [[("act", {"payload": args})], "ok"]
    agent = Agent("actor", "Acts.", [act, fetch_doc])
    provider = Recording(turns)

    async def go(resume: bool) -> Any:
        stores = await _opened(url)
        try:
            runner = AgentRunner.from_stores(provider, stores)  # no crash: a lease of 30 s
            if resume:
                return await runner.resume(agent, "r1", tenant=T)
            return await runner.run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(go(False))
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    said = cli("approve", run.pending_approval.id, "--tenant", T, "--by", "al", "--store", url)
    assert said.startswith("exit 0"), said
    before = len(provider.requests)
    assert asyncio.run(go(True)).status is RunStatus.completed
    told = [m.text for r in provider.requests[before:] for m in r.messages if m.role == "tool"]
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    return Approved(sent, told, stored)


def stored_after(tmp_path: Path, caplog: pytest.LogCaptureFixture, body: Callable[[], Any]) -> str:
    """One run whose read-only tool returns or raises ``body()``: the SQLite file's bytes,
    the CLI's views and the log, as one text."""
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def probe() -> Any:
        """Read-only probe."""
        return body()

    agent = Agent("probe", "Probe.", [probe])
    provider = Recording([ScriptedTurn(calls=[("probe", {})]), "done"])

    async def go() -> Any:
        stores = await _opened(url)
        try:
            # The default lease: a loaded machine must not lose a 1 s one mid-run.
            runner = AgentRunner.from_stores(provider, stores)
            return await runner.run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    return "\n".join([stored, cli_views(url, "r1"), log_text(caplog)])


def raises(message: str) -> Callable[[], Any]:
    def body() -> Any:
        raise RuntimeError(message)

    return body


def not_sent(outcome: Approved) -> bool:
    return outcome.sent == [] and any(t.startswith("not sent") for t in outcome.told)


# --- 1. a slug with "sk-admin-" inside is taken for a glued key ----------------------------

SLUGS = {
    "repo_url": "https://github.com/acme/fla" + SK + "admin-SQLAlchemy2-Examples",
    "branch": "feature/ta" + SK + "admin-Dashboard-Redesign-2024",
    "disk": "di" + SK + "proj-Migration2024-FinalReport",
}


def test_slugs_with_sk_admin_inside_stay() -> None:
    """Defect 1 on the redactor alone."""
    for slug in SLUGS.values():
        assert redact(slug) == slug


def test_a_slug_with_sk_admin_inside_is_sent_after_approval(tmp_path: Path) -> None:
    outcome = approved_call(tmp_path, {"repo": SLUGS["repo_url"], "branch": SLUGS["branch"]})
    assert outcome.sent == [{"repo": SLUGS["repo_url"], "branch": SLUGS["branch"]}], outcome.told
    assert "[redacted:openai_key]" not in outcome.stored


# --- 2. a URL path after a hyphen is taken for an AWS secret -------------------------------

HYPHEN_URL = "https://docs.example.com/user-guide/Chapter2/InstallingOnWindows/Step1.html"
UNDERSCORE_URL = "https://example.com/my_files/Users2/JohnSmith/Documents/Reports.pdf"


def test_a_url_path_after_a_hyphen_is_sent_after_approval(tmp_path: Path) -> None:
    outcome = approved_call(tmp_path, {"link": HYPHEN_URL, "mirror": UNDERSCORE_URL})
    assert outcome.sent == [{"link": HYPHEN_URL, "mirror": UNDERSCORE_URL}], outcome.told
    assert "[redacted:aws_secret_key]" not in outcome.stored


def test_a_url_path_with_no_hyphen_or_digit_is_sent_after_approval(tmp_path: Path) -> None:
    """What 2bc014f fixed held: the attack's own URL is sent."""
    link = "https://example.com/Users/JohnSmith/Documents/Reports/AB.txt"
    outcome = approved_call(tmp_path, {"link": link})
    assert outcome.sent == [{"link": link}], outcome.told
    assert not any(t.startswith("not sent") for t in outcome.told)


# --- 3. templates and schemas under a credential key ---------------------------------------

HELM = (
    "apiVersion: v1\nkind: Secret\nstringData:\n"
    "  username: {{ .Values.db.user }}\n"
    "  password: {{ .Values.db.password | quote }}\n"
)
MONGOOSE = (
    "const User = new Schema({\n  email: { type: String, required: true },\n"
    "  password: { type: String, required: true, minlength: 8 },\n});\n"
)


def test_a_helm_template_under_a_password_key_is_sent_after_approval(tmp_path: Path) -> None:
    args = {"files": {"templates/secret.yaml": HELM, "models/user.js": MONGOOSE}}
    outcome = approved_call(tmp_path, args)
    assert outcome.sent == [args], outcome.told


def test_the_same_templates_stay_in_the_redactor() -> None:
    assert redact(HELM) == HELM
    assert redact(MONGOOSE) == MONGOOSE


# --- 4. an apostrophe inside brackets masks the rest of the page --------------------------

DOC = (
    "# Account help\n\nReset your password: [Don't share it](https://example.com/help/reset)"
    "\n\n## Next steps\n"
    + "Open the billing page and download last month's invoice. " * 20
    + "\n\n## Contact\nsupport@example.com\n"
)


def test_prose_after_a_link_with_an_apostrophe_under_password_reaches_the_model(
    tmp_path: Path,
) -> None:
    outcome = approved_call(tmp_path, {"note": "read"}, read=DOC)
    assert outcome.sent == [{"note": "read"}]
    doc_told = [t for t in outcome.told if "Account help" in t]
    assert doc_told, outcome.told
    assert "## Next steps" in doc_told[0] and "## Contact" in doc_told[0], doc_told[0]


def test_a_bracket_of_prose_under_a_credential_key_stays() -> None:
    text = "password: [Don't share it]\n" + "ordinary prose. " * 2000
    assert redact(text) == text


# --- 5. names ending in _pwd that hold a directory ----------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="defect 5 (LOW, arguable): ORIG_PWD/START_PWD name directories like OLDPWD; "
    "'_pwd' as a last word masks them, so a shell call passing one is never sent",
)
def test_a_name_ending_in_pwd_holding_a_directory_is_sent(tmp_path: Path) -> None:
    args = {"command": "cd $ORIG_PWD && make", "env": "ORIG_PWD=/srv/app START_PWD=/srv"}
    outcome = approved_call(tmp_path, args)
    assert outcome.sent == [args], outcome.told


def test_pwd_and_oldpwd_stay_and_mysql_pwd_is_masked() -> None:
    assert redact("PWD=/home/app OLDPWD=/home") == "PWD=/home/app OLDPWD=/home"
    assert redact("MYSQL_PWD=hunter2x") == "MYSQL_PWD=[redacted:password]"


# --- 6. ACCESS_KEY_ID:SECRET is no longer masked -------------------------------------------


def test_an_aws_key_pair_joined_by_a_colon_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    line = f"echo {AWS_ID}:{AWS_SECRET} > ~/.passwd-s3fs failed: permission denied"
    seen = stored_after(tmp_path, caplog, raises(line))
    assert "passwd-s3fs" in seen
    assert AWS_ID not in seen
    assert AWS_SECRET not in seen


def test_a_standalone_aws_secret_with_a_space_before_is_masked() -> None:
    assert redact(f"creds {AWS_SECRET} end") == "creds [redacted:aws_secret_key] end"


# --- 7. glued keys in other issued shapes ---------------------------------------------------

OTHER_SHAPES = {
    "anthropic_oauth": "call_" + SK + "ant-oat01-" + BODY,
    "anthropic_refresh": "call_" + SK + "ant-ort01-" + BODY,
    "openai_legacy": "call_" + SK + BODY[:20] + "T3Blbk" + "FJ" + BODY[20:40],
    "openai_none": "call_" + SK + "None-" + BODY,
    "url_escaped": "https://x.example/cb?auth=Bearer%20" + SK + BODY[:20] + "T3Blbk" + "FJ" + BODY,
}


@pytest.mark.parametrize("shape", sorted(OTHER_SHAPES))
def test_glued_keys_in_other_issued_shapes_are_masked(
    shape: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = OTHER_SHAPES[shape]
    tail = secret[-24:]
    seen = stored_after(tmp_path, caplog, raises(f"upstream said: {secret} rejected"))
    assert "upstream said" in seen
    assert tail not in seen


GLUED_HELD = {
    # A key's random part has a run of 16 letters and digits (a slug of words has none).
    "proj_underscores": "call_" + SK + "proj-" + "a_B-c_1" * 4 + BODY,
    "svcacct": "x" + SK + "svcacct-" + BODY,
    "admin": "id_" + SK + "admin-" + BODY + "_-_" + BODY,
    "ant_api03": "x" + SK + "ant-api03-" + BODY + "-_AA",
    "ant_admin01": "tok_" + SK + "ant-admin01-" + BODY,
    "wrapped_long_head": "call_" + SK + "proj-" + BODY + "\n" + BODY,
}


def test_glued_keys_in_the_documented_shapes_are_masked_in_a_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = "ids: " + " ; ".join(GLUED_HELD.values()) + "\nend"
    seen = stored_after(tmp_path, caplog, raises(text))
    assert "ids: " in seen
    leaked = [name for name, v in GLUED_HELD.items() if v[-20:] in seen]
    assert leaked == []
    assert BODY not in seen


# --- 8. a glued key wrapped across lines ----------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="defect 8: a glued key wrapped with a head under 20 characters, or a head "
    "without a digit, is not masked (the same key unglued is)",
)
@pytest.mark.parametrize("head", ["Ab3dEf9hIjKl", "AbcdefghijKLMNOPqrstu"])
def test_a_glued_key_wrapped_across_lines_is_masked(head: str) -> None:
    tail = "QrStUvWxYz0123456789abcdEFGH"
    unglued = redact(f"key: {SK}proj-{head}\n{tail}\nend")
    assert tail not in unglued  # the unglued rule masks it
    glued = redact(f"id: call_{SK}proj-{head}\n{tail}\nend")
    assert head not in glued and tail not in glued, glued


# --- 9. bytearray(b'…') -------------------------------------------------------------------


def test_a_bytearray_repr_under_a_credential_key_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    message = "connect failed: " + repr({"user": "bob", "password": bytearray(b"QZBYTESQZ")})
    seen = stored_after(tmp_path, caplog, raises(message))
    assert "connect failed" in seen
    assert "QZBYTESQZ" not in seen


def test_byte_prefixes_under_a_credential_key_are_masked() -> None:
    for literal in ("b'QZ1QZx'", 'rb"QZ1QZx"', "B'QZ1QZx'", "Rb'QZ1QZx'"):
        out = redact(f"kwargs: {{'password': {literal}}}")
        assert "QZ1QZx" not in out and M in out, out


# --- 10. JSON-escaped structures ----------------------------------------------------------


def test_a_json_escaped_list_under_a_credential_key_is_masked() -> None:
    text = 'body="{\\"token\\": [\\"QZLISTQZaa\\", \\"QZLIST2QZ\\"], \\"n\\": 1}"'
    out = redact(text)
    assert "QZLIST" not in out, out
    assert '\\"n\\": 1' in out


def test_a_json_escaped_object_with_a_brace_in_a_string_is_masked_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    message = (
        'request body="{\\"credentials\\": {\\"user\\": \\"bob\\", '
        '\\"pass\\": \\"Zq}8QZBRACEQZ\\"}, \\"n\\": 1}"'
    )
    seen = stored_after(tmp_path, caplog, raises(message))
    assert "request body" in seen
    assert "QZBRACEQZ" not in seen


# --- 11. past the cap -----------------------------------------------------------------------


def test_an_object_under_a_credential_key_past_the_cap_is_masked_whole() -> None:
    text = (
        'config error: credentials: {"ca": "'
        + "MIIB" * (16_384 // 4 + 10)  # past the cap 2bc014f had
        + '", "user": "bob", "pass": "QZCAPQZ"} please fix'
    )
    out = redact(text)
    assert "config error" in out and "please fix" in out
    assert "QZCAPQZ" not in out


def test_lists_under_credential_keys_in_free_text_are_masked() -> None:
    out = redact("token: ['QZaQZ', 'QZbQZ'] and PASSWORD: [\n  'QZcQZ'\n] then more")
    assert "QZ" not in out and out.endswith(" then more"), out


def test_lower_case_slugs_stay() -> None:
    text = (
        "desk-proj-tool fla" + SK + "ant-design-pro ta" + SK + "admin-dashboard-redesign-2024 "
        "di" + SK + "svcacct-migration-report-final"
    )
    assert redact(text) == text


# --- linear time ----------------------------------------------------------------------------


def _cap_chunks(text: str, key: str, kind: str) -> str:
    """What masking the first ``key`` followed by a never-closed structure gives: all the
    rest (2bc014f masked 16 KiB a key, then looked again)."""
    found = text.find(key)
    return text if found == -1 else text[: found + len(key)] + f"[redacted:{kind}]"


def _nested_opens(size: int) -> tuple[str, str]:
    text = "token: " + _fill("[{", size)
    return text, _cap_chunks(text, "token: ", "token")


def _escapes_under_keys(size: int) -> tuple[str, str]:
    # ``[`` then a backslash that escapes no quote: no list as data starts so, so it stays.
    text = _fill("secret=[\\\\\\'", size)
    return text, text


def _glued_short_heads(size: int) -> tuple[str, str]:
    text = _fill("x" + SK + "proj-" + "aB1" * 6 + " ", size)
    return text, text


def _glued_anthropic_run(size: int) -> tuple[str, str]:
    text = _fill("_" + SK + "ant-api03-", size)
    return text, text


def _glued_mixed_run(size: int) -> tuple[str, str]:
    # No run of 16 letters and digits: no key's random part, so it stays.
    unit = "_" + SK + "admin-aB1"
    text = _fill(unit, size)
    return text, text


def _aws_after_hyphens(size: int) -> tuple[str, str]:
    text = _fill("-aA1/bB2+", size)
    return text, text


def _prefixes_under_keys(size: int) -> tuple[str, str]:
    unit = "password=rb'x' "
    count = size // len(unit)
    return unit * count, "password=rb'[redacted:password]' " * count


HOSTILE = {
    "nested_opens": _nested_opens,
    "escapes_under_keys": _escapes_under_keys,
    "glued_short_heads": _glued_short_heads,
    "glued_anthropic_run": _glued_anthropic_run,
    "glued_mixed_run": _glued_mixed_run,
    "aws_after_hyphens": _aws_after_hyphens,
    "prefixes_under_keys": _prefixes_under_keys,
}


@pytest.mark.parametrize("size", (64 * KIB, 256 * KIB), ids=lambda s: f"{s // KIB}KiB")
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_new_rules_are_exact_on_hostile_input_at_two_sizes(name: str, size: int) -> None:
    text, expected = HOSTILE[name](size)
    with hang_guard():
        out = redact(text)
    assert out == expected
