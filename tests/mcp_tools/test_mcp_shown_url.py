"""An MCP server's URL as the kit shows it in error texts a model is told, in ``repr`` and
in logs (``mcp.replies.shown_url``): never what may hold a credential. User info, query and
fragment were dropped before; a token some services put in the path (``/s/<token>/mcp``)
is now shown as ``…``, while the short words a path is made of stay, so an operator still
knows which server it is."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_tools.servers import free_port
from tesserix_adk.mcp import MCPToolset, MCPUnavailableError
from tesserix_adk.mcp.replies import shown_url

# Characters a path segment may hold as written in a URL (percent-escapes aside).
_SEGMENT = string.ascii_letters + string.digits + "-._~"
_WORDS = st.text(alphabet=_SEGMENT, min_size=1, max_size=12)
# A token: longer than the longest segment shown whole.
_TOKENS = st.text(alphabet=_SEGMENT, min_size=13, max_size=80)


@given(before=st.lists(_WORDS, max_size=3), token=_TOKENS, after=st.lists(_WORDS, max_size=3))
def test_a_long_path_segment_is_never_shown(
    before: list[str], token: str, after: list[str]
) -> None:
    path = "/".join([*before, token, *after])
    shown = shown_url(f"https://mcp.example.com:8443/{path}")
    assert token not in shown, shown
    assert shown.startswith("https://mcp.example.com:8443/"), shown
    # The words around it stay, in their places.
    assert shown == "https://mcp.example.com:8443/" + "/".join([*before, "…", *after])


@given(words=st.lists(_WORDS, max_size=4))
def test_a_path_of_short_words_is_shown_as_it_is(words: list[str]) -> None:
    path = "/" + "/".join(words) if words else ""
    assert shown_url(f"http://127.0.0.1:8000{path}") == f"http://127.0.0.1:8000{path}"


@pytest.mark.parametrize(
    "secret",
    [
        "sk-live-4f9a8b7c6d5e4f3a",  # a long token
        "tok%2Fwith%2Fescapes-123456",  # escaped, still long
        "ab12cd34ef56gh78",  # no separators
    ],
)
def test_a_token_in_the_path_is_neither_in_repr_nor_in_the_error(secret: str) -> None:
    port = free_port()  # nobody listens there
    url = f"http://127.0.0.1:{port}/api/s/{secret}/mcp"
    toolset = MCPToolset.http(url, connect_timeout=5)
    assert secret not in repr(toolset)
    assert (
        repr(toolset)
        == f"MCPToolset(the MCP server at http://127.0.0.1:{port}/api/s/…/mcp, not connected)"
    )


async def test_an_unreachable_server_with_a_token_in_its_path_is_named_without_it() -> None:
    port = free_port()
    secret = "zaps-3c1f0e9d8b7a6c5d4e3f"
    toolset = MCPToolset.http(f"http://127.0.0.1:{port}/s/{secret}/mcp", connect_timeout=5)
    with pytest.raises(MCPUnavailableError) as refused:
        async with toolset:
            pass
    assert secret not in str(refused.value), refused.value
    assert f"http://127.0.0.1:{port}/s/…/mcp" in str(refused.value)
