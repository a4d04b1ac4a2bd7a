"""Every error the installed MCP SDK makes up itself for a call whose answer never came
whole is one the toolset knows as such (a lost reply, the call in doubt), never taken for
the server's own "no".

The SDK's streamable-HTTP client hands such a call a JSON-RPC error of its own making,
which looks like one the server sent; the toolset tells them apart by code and text. A new
SDK release that makes up another must fail here, not send a booking twice in the field.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator

import mcp_types
import pytest
from mcp.client import streamable_http
from mcp.shared.exceptions import MCPError

from tesserix_adk.mcp.replies import stand_in as _stand_in

# How a message built from a variable starts: the only such variable is the description of
# an unfollowed redirect, and both of its texts start so.
_VARIABLES = {"redirect": "Redirect to http://elsewhere/mcp not followed"}


def _made_up() -> Iterator[tuple[int, str, int]]:
    """(code, a message as the SDK makes it, line) for every error the HTTP client makes."""
    tree = ast.parse(inspect.getsource(streamable_http))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        keywords = {k.arg: k.value for k in node.keywords}
        if name == "ErrorData":
            code, message = keywords["code"], keywords["message"]
            if getattr(code, "id", None) == "code":
                continue  # _resolve_abandoned_request's own: its callers are read below
        elif name == "_resolve_abandoned_request":
            message = node.args[2]
            code = keywords.get("code", ast.Name(id="CONNECTION_CLOSED"))
        else:
            continue
        assert isinstance(code, ast.Name), ast.dump(code)
        yield getattr(mcp_types, code.id), _sample(message), node.lineno


def _sample(message: ast.expr) -> str:
    if isinstance(message, ast.Constant) and isinstance(message.value, str):
        return message.value
    if isinstance(message, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "details" for v in message.values
        )
    if isinstance(message, ast.Name) and message.id in _VARIABLES:
        return _VARIABLES[message.id]
    raise AssertionError(f"a made-up error whose text is built another way: {ast.dump(message)}")


MADE_UP = list(_made_up())


def test_the_sdk_still_makes_up_the_errors_this_test_reads() -> None:
    # Found none: the SDK was reorganised and this test would pass unread.
    assert len(MADE_UP) >= 10, MADE_UP


@pytest.mark.parametrize(("code", "message", "line"), MADE_UP)
def test_every_error_the_sdk_makes_up_is_a_stand_in(code: int, message: str, line: int) -> None:
    assert _stand_in(MCPError(code=code, message=message)) is not None, (
        f"streamable_http.py line {line}: ({code}, {message!r}) would be taken for the "
        "server's own answer"
    )


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (-32000, "seat map locked"),  # a server's own code, beside CONNECTION_CLOSED's
        (-32001, "quota exceeded"),
        (mcp_types.INVALID_PARAMS, "Invalid request parameters"),
        (mcp_types.METHOD_NOT_FOUND, "Not Found: book_seat"),
    ],
)
def test_an_error_the_server_wrote_is_not_a_stand_in(code: int, message: str) -> None:
    assert _stand_in(MCPError(code=code, message=message)) is None


@pytest.mark.parametrize(
    "message",
    ["Session terminated before the request completed", "Handler returned an invalid result"],
)
def test_a_servers_internal_error_is_in_doubt(message: str) -> None:
    # It failed while handling the call, perhaps after its tool ran.
    assert _stand_in(MCPError(code=mcp_types.INTERNAL_ERROR, message=message)) is not None
