"""``SDKProvider``: what the OpenAI and Anthropic providers share, written once.

Both wrap a vendor SDK's async client the same way: they own the client only when they
built it (``aclose`` and ``async with`` close only that one), they collect the API keys that
must never reach an error text, they translate the SDK's errors into ``ProviderError`` at
this boundary, and they read a reply that lacks its fields as "ask again". A vendor module
supplies only the wire: the request body, the call, and reading the reply (and, to stream,
one streamed call that assembles the whole message).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from tesserix_adk.errors import ConfigurationError, ProviderError
from tesserix_adk.messages import Message, Usage
from tesserix_adk.providers._common import (
    credentials,
    scrub,
    strip_vendor,
    translate_sdk_error,
)
from tesserix_adk.providers.base import ModelRequest, ModelResponse, TextSink
from tesserix_adk.providers.pricing import Prices, cost_micros, price_for

__all__ = ["Reply", "SDKClient", "SDKProvider", "StreamCut"]

# What a malformed reply raises while we read it; read as "ask again", never as a bug in
# the caller's request.
MALFORMED_REPLY = (AttributeError, IndexError, KeyError, TypeError, ValueError)


class StreamCut(Exception):
    """A stream that ended before the vendor said the message was complete; ``usage``,
    when the vendor had already said what the call used (it is billed all the same)."""

    def __init__(self, message: str, *, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """A reply once it is whole (streamed or not): the message, its usage, the model that
    answered and why the vendor ended it."""

    message: Message
    usage: Usage = field(default_factory=Usage)
    model: str | None = None
    finish_reason: str | None = None


class SDKClient(Protocol):
    """The part of a vendor's async client the base relies on."""

    async def close(self) -> None:
        """Close the HTTP connections."""
        ...


ClientT = TypeVar("ClientT", bound=SDKClient)


class SDKProvider(Generic[ClientT]):
    """A ``Provider`` over a vendor SDK's async client; subclass per vendor.

    A subclass names its vendor (``vendor``, the prefix a model name may carry, and
    ``title``, as a person writes it), the SDK module and its base error class (``sdk``,
    ``sdk_error``), and what a reply is called (``reply_noun``); it implements
    ``request_body``, ``_build_client``, ``_create`` (one call) and ``_read`` (the reply as
    our message, raising one of ``MALFORMED_REPLY`` for a reply that lacks its fields).
    """

    vendor: ClassVar[str]
    title: ClassVar[str]
    reply_noun: ClassVar[str]
    client_hint: ClassVar[str] = ""  # said after "cannot build the client" (how to fix it)
    sdk: ClassVar[Any]  # the SDK module, whose error classes translate_sdk_error reads
    sdk_error: ClassVar[type[Exception]]  # the base class of everything the SDK raises

    def __init__(
        self,
        model: str,
        *,
        client: ClientT | None,
        base_url: str | None,
        api_key: str | None,
        prices: Prices,
        max_retries: int,
        timeout: float,
    ) -> None:
        self.model = strip_vendor(model, self.vendor)
        self.prices = prices
        if client is not None and (base_url is not None or api_key is not None):
            raise ConfigurationError("pass either client= or base_url=/api_key=, not both")
        self._owns_client = client is None
        if client is None:
            options: dict[str, Any] = {"max_retries": max_retries, "timeout": timeout}
            if base_url is not None:
                options["base_url"] = base_url
            if api_key is not None:
                options["api_key"] = api_key
            try:
                client = self._build_client(options)
            except self.sdk_error as exc:
                raise ConfigurationError(
                    f"cannot build the {self.title} client: {scrub(str(exc), [api_key])}"
                    + self.client_hint
                ) from exc
        self._client: ClientT = client
        # Every credential the client sends (an API key; Anthropic's bearer auth_token,
        # given or read from the environment), so an error that echoes one masks it.
        held = (api_key, getattr(client, "api_key", None), getattr(client, "auth_token", None))
        self._secrets = credentials(held)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r})"

    async def aclose(self) -> None:
        """Close the HTTP client, if this provider built it."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One model call (the SDK retries transient failures), as our message."""
        body = self.request_body(request)
        try:
            wire = await self._create(body)
        except Exception as exc:
            error = self._translate(exc)
            if error is None:
                raise
            raise error from exc
        try:
            reply = self._read(wire)
        except MALFORMED_REPLY as exc:
            raise ProviderError(
                f"{self.vendor} {self.model}: malformed {self.reply_noun}: {self._scrub(str(exc))}",
                retryable=True,
                paid=self._billed(self._usage_of(wire)),
            ) from exc
        return self._priced(reply)

    async def complete_streaming(self, request: ModelRequest, on_text: TextSink) -> ModelResponse:
        """One streamed model call: ``on_text`` hears the text as it arrives, and the whole
        message (calls and their arguments, usage from the last event) is assembled before
        this returns. The SDK retries only until the stream begins; a stream that breaks
        or ends early after that is a retryable ``ProviderError``, never a partial message."""
        body = self.request_body(request)
        try:
            streamed = await self._stream(body, on_text)
        except Exception as exc:
            error = self._stream_error(exc)
            if error is None:
                raise
            raise error from exc
        return self._priced(streamed)

    def _billed(self, usage: Usage | None) -> tuple[int, Usage] | None:
        """What a call whose answer cannot be taken cost, by the usage the vendor told."""
        if usage is None:
            return None
        return cost_micros(usage, price_for(self.prices, self.model, None)), usage

    def _usage_of(self, wire: object) -> Usage | None:
        """The usage a reply that cannot be read still tells, or ``None``."""
        return None

    def _priced(self, reply: Reply) -> ModelResponse:
        price = price_for(self.prices, self.model, reply.model)
        return ModelResponse(
            message=reply.message,
            usage=reply.usage,
            cost_micros=cost_micros(reply.usage, price),
            finish_reason=reply.finish_reason,
        )

    def request_body(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of the SDK's create call (the wire body)."""
        raise NotImplementedError

    # --- what a vendor supplies -------------------------------------------------------------

    def _build_client(self, options: dict[str, Any]) -> ClientT:
        """A client from ``max_retries``, ``timeout`` and maybe ``base_url``/``api_key``."""
        raise NotImplementedError

    async def _create(self, body: dict[str, Any]) -> object:
        """One call to the vendor with ``body``; the SDK's errors propagate."""
        raise NotImplementedError

    def _read(self, wire: object) -> Reply:
        """The reply as our message, its usage, the model and its finish reason."""
        raise NotImplementedError

    async def _stream(self, body: dict[str, Any], on_text: TextSink) -> Reply:
        """One streamed call with ``body``, its text told to ``on_text``; ``StreamCut`` if
        the stream ends before the vendor's last event."""
        raise NotImplementedError

    # --- shared ----------------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    def _stream_error(self, exc: Exception) -> ProviderError | None:
        """Why a streamed call failed, as a ``ProviderError``; ``None`` for what is not
        the SDK's, the transport's or a broken stream's."""
        where = f"{self.vendor} {self.model}"
        if self._reported_mid_stream(exc):
            # The request was taken (200) and the vendor broke off with an error event
            # (overloaded, a server error): asking again is what it asks for.
            return ProviderError(
                f"{where}: the stream broke off with an error: {self._scrub(str(exc))}",
                retryable=True,
            )
        error = self._translate(exc)
        if error is not None:
            return error
        if isinstance(exc, StreamCut):
            return ProviderError(
                f"{where}: the stream ended early: {self._scrub(str(exc))}",
                retryable=True,
                paid=self._billed(exc.usage),
            )
        if _is_transport_error(exc):
            return ProviderError(
                f"{where}: the stream broke: {type(exc).__name__}: {self._scrub(str(exc))}",
                retryable=True,
            )
        if isinstance(exc, MALFORMED_REPLY):
            return ProviderError(
                f"{where}: malformed stream event: {self._scrub(str(exc))}", retryable=True
            )
        return None

    def _reported_mid_stream(self, exc: Exception) -> bool:
        """An error event in a stream that began with 200: the Anthropic SDK raises a
        status error with the stream's 200, the OpenAI SDK its base ``APIError``."""
        if isinstance(exc, self.sdk.APIStatusError):
            return 200 <= int(exc.status_code) < 300
        return type(exc) is self.sdk.APIError

    def _translate(self, exc: Exception) -> ProviderError | None:
        """The SDK's error as a ``ProviderError``; ``None`` for what is not the SDK's."""
        return translate_sdk_error(
            exc,
            sdk=self.sdk,
            base=self.sdk_error,
            where=f"{self.vendor} {self.model}",
            scrub=self._scrub,
        )


def _is_transport_error(exc: Exception) -> bool:
    """An HTTP transport failure raised while a stream is read: some SDKs pass those on
    unwrapped once the response has begun. Known by name, so the kit does not import the
    HTTP library (``httpx`` or ``httpx2``, whichever the SDK uses) itself."""
    return any(
        c.__name__ == "TransportError" and c.__module__.split(".")[0].startswith("httpx")
        for c in type(exc).__mro__
    )
