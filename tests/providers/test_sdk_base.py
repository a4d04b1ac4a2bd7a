"""What the shared SDK base gives both vendors: client ownership, ``async with``, and the
key of a client passed in kept out of error text."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tesserix_adk.errors import ProviderError
from tesserix_adk.messages import Message
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.base import ModelRequest
from tesserix_adk.providers.openai import OpenAIProvider

from .fake_server import ModelServer
from .vendors import SDKProvider, Vendor

KEY = "sk-passed-in-client-0123456789"
REQUEST = ModelRequest(agent_name="a", instructions="", messages=[Message.user("hi")])


def _with_client(vendor: Vendor, server: ModelServer) -> tuple[SDKProvider, object]:
    if vendor.name == "openai":
        oc = openai.AsyncOpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0)
        return OpenAIProvider(vendor.model, client=oc), oc
    ac = anthropic.AsyncAnthropic(api_key=KEY, base_url=server.url, max_retries=0)
    return AnthropicProvider(vendor.model, client=ac), ac


async def test_a_client_built_is_closed_by_async_with(
    vendor: Vendor, model_server: ModelServer
) -> None:
    async with vendor.provider(model_server) as provider:
        assert isinstance(provider, OpenAIProvider | AnthropicProvider)
        assert repr(provider) == f"{type(provider).__name__}(model={vendor.wire_model!r})"
        client = provider._client
        assert not client.is_closed()
    assert client.is_closed()


async def test_a_client_passed_in_is_left_open_and_its_key_scrubbed(
    vendor: Vendor, model_server: ModelServer
) -> None:
    provider, client = _with_client(vendor, model_server)
    model_server.queue(vendor.error(401, f"Incorrect API key provided: {KEY}"))
    try:
        async with provider:
            with pytest.raises(ProviderError) as caught:
                await provider.complete(REQUEST)
        assert caught.value.status_code == 401
        assert not caught.value.retryable
        assert KEY not in str(caught.value)
        assert "[redacted:api_key]" in str(caught.value)
        assert not provider._client.is_closed()
    finally:
        await provider._client.close()
    assert client is provider._client
