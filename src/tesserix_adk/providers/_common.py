"""What the SDK-backed providers share: model names, tool arguments, secret scrubbing."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, quote_plus

from tesserix_adk.errors import ConfigurationError, ProviderError
from tesserix_adk.messages import MALFORMED_ARGUMENTS, REFUSED_ARGUMENTS, ToolCall

__all__ = [
    "MALFORMED_ARGUMENTS",
    "arguments_from_text",
    "arguments_to_text",
    "credentials",
    "cut_off",
    "is_transient_status",
    "scrub",
    "strip_vendor",
    "token_count",
    "uncharged",
]


def strip_vendor(model: str, vendor: str) -> str:
    """``"openai:gpt-4o"`` → ``"gpt-4o"``; only this vendor's prefix is taken off, because
    local model names have colons of their own (Ollama's ``"llama3.1:8b"``)."""
    prefix = vendor + ":"
    name = model[len(prefix) :] if model.startswith(prefix) else model
    if not name:
        raise ConfigurationError(f"no model name in {model!r}")
    return name


def arguments_from_text(raw: object) -> dict[str, Any]:
    """A tool call's JSON arguments; not a JSON object → ``{MALFORMED_ARGUMENTS: raw}``.

    Empty text is no arguments (some OpenAI-compatible servers send ``""`` for a call
    without parameters). Arguments sent as an object, not as its text (other such servers
    do), are that object, written as JSON text and read again so they are what the text
    would have been; anything else that is not text is malformed, answered to the model.
    """
    if raw is None:
        return {}
    if not isinstance(raw, str):
        try:
            raw = json.dumps(raw, ensure_ascii=False)
        except (TypeError, ValueError):
            return {MALFORMED_ARGUMENTS: repr(raw)}
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {MALFORMED_ARGUMENTS: raw}
    if not isinstance(value, dict):
        return {MALFORMED_ARGUMENTS: raw}
    return value


def arguments_to_text(arguments: Mapping[str, Any]) -> str:
    """The JSON text of a call's arguments; a malformed call's raw text goes back verbatim."""
    if set(arguments) == {MALFORMED_ARGUMENTS} and isinstance(arguments[MALFORMED_ARGUMENTS], str):
        return str(arguments[MALFORMED_ARGUMENTS])
    return json.dumps(dict(arguments), ensure_ascii=False)


def is_transient_status(status: int) -> bool:
    """Whether an HTTP status may pass if asked again later: the statuses the SDKs retry
    themselves (408 timeout, 409 lock, 429 rate limit, 5xx), so they agree with them."""
    return status in (408, 409, 429) or status >= 500


# A credential shorter than this is a placeholder (``api_key="unused"`` for a local
# server), not a secret: replacing it everywhere would garble the vendor's words.
_SHORTEST_CREDENTIAL = 8


def credentials(values: Iterable[object]) -> tuple[str, ...]:
    """The credentials among ``values`` worth masking: text of a credential's length, each
    once, longest first (so one inside another is masked whole)."""
    found = {v for v in values if isinstance(v, str) and len(v) >= _SHORTEST_CREDENTIAL}
    return tuple(sorted(found, key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every secret replaced, so an error message that echoes the API key
    (some servers do) cannot carry it into a frontier's failure reason or a log: as it
    is, percent-encoded (a URL) or base64 (a Basic header, a token's echo)."""
    for secret in credentials(secrets):
        for form in dict.fromkeys(_echoes(secret)):
            text = text.replace(form, "[redacted:api_key]")
    return text


def _echoes(secret: str) -> Iterator[str]:
    raw = secret.encode("utf-8", "surrogatepass")
    yield secret
    yield quote(secret, safe="")
    yield quote_plus(secret, safe="")
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        text = encoded.decode("ascii")
        yield text
        yield text.rstrip("=")


def translate_sdk_error(
    exc: Exception, *, sdk: Any, base: type[Exception], where: str, scrub: Callable[[str], str]
) -> ProviderError | None:
    """An SDK's error as a ``ProviderError``; ``None`` for what is not the SDK's.

    The ``openai`` and ``anthropic`` SDKs share their error classes' names and meaning, so
    one translation serves both: transient failures (timeouts, connection loss, 408/409/429/
    5xx, a malformed body) are retryable, anything else the SDK raises is not.
    """
    if isinstance(exc, sdk.APITimeoutError):
        return ProviderError(f"{where}: timed out after retries", retryable=True)
    if isinstance(exc, sdk.APIConnectionError):
        return ProviderError(
            f"{where}: connection failed after retries: {scrub(str(exc))}", retryable=True
        )
    if isinstance(exc, sdk.APIStatusError):
        return ProviderError(
            f"{where}: {scrub(str(exc))}",
            retryable=is_transient_status(exc.status_code),
            status_code=exc.status_code,
        )
    if isinstance(exc, sdk.APIResponseValidationError):
        return ProviderError(
            f"{where}: malformed response: {scrub(str(exc))}",
            retryable=True,
            status_code=exc.status_code,
        )
    if isinstance(exc, json.JSONDecodeError):
        return ProviderError(f"{where}: the response body is not JSON: {exc}", retryable=True)
    if isinstance(exc, base):
        return ProviderError(f"{where}: {scrub(str(exc))}", retryable=False)
    return None


def uncharged(what: str) -> ProviderError:
    """The error of an answer whose cost the ledger cannot charge as given: not retryable,
    since asking again pays again."""
    return ProviderError(
        f"the provider answered {what}, which the ledger cannot charge; the call's cost "
        "is not counted, and the run stops rather than ask again",
        retryable=False,
    )


def token_count(value: object, name: str) -> int:
    """A reply's token count as the vendor gave it: absent is 0, a whole number is itself,
    anything else is ``uncharged`` (never rounded into a count: ``10.9`` or ``true`` would
    charge less than was paid, and ``NaN`` or ``1e999`` cannot be charged at all)."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise uncharged(f"{name}={shown}")


def cut_off(calls: list[ToolCall], why: str) -> list[ToolCall]:
    """A reply's tool calls when the vendor cut the reply off (out of tokens): each is
    refused, never sent, whatever its arguments read as. A call cut off mid-argument may
    still parse (Anthropic hands out the input it had, ``{"amount": 10}`` of ``1000``), and
    sending it would be a guess at what the model meant."""
    refusal = {REFUSED_ARGUMENTS: f"not sent: {why}"}
    return [ToolCall(id=c.id, name=c.name, arguments=refusal) for c in calls]
