"""Who may use the console: the token, the CSRF check and the Host check.

With a token set, every request needs it (``Authorization: Bearer`` or the cookie the login
form sets). Every state-changing request also needs the per-browser CSRF token (a cookie
and the same value in the form) and an ``Origin`` (or, without one, ``Referer``) naming this
very host. Bound to loopback, the ``Host`` header must be a loopback name, so a page of
another site cannot reach the console by rebinding its own name to 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

__all__ = ["CSRF_COOKIE", "TOKEN_COOKIE", "Guard", "Refusal", "csrf_of", "host_name", "is_loopback"]

CSRF_COOKIE = "tesserix_csrf"
TOKEN_COOKIE = "tesserix_token"


def is_loopback(host: str) -> bool:
    """``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# RFC 9110's Host: a name, an IPv4 address or a bracketed IPv6 one, then perhaps a port.
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::[0-9]{1,5})?")


def host_name(host: str) -> str:
    """The name a ``Host`` header gives, or ``""`` when it is not one (``a\\@localhost``
    is no host, whatever a URL parser would make of it)."""
    match = _HOST.fullmatch(host)
    return "" if match is None else match.group(1)


@dataclass(frozen=True, slots=True)
class Refusal(Exception):
    """A request the console will not serve, with the HTTP status and the sentence why."""

    status: int
    text: str


@dataclass(frozen=True, slots=True)
class Guard:
    """The checks of one app: its token (or ``None``) and whether it serves loopback only."""

    token: str | None
    loopback_only: bool

    def check_host(self, request: Request) -> None:
        """Served on loopback, the request must name a loopback host (DNS rebinding) and
        come from a loopback address: an app served on every address by whoever embeds it
        must not take a peer's ``Host: 127.0.0.1`` for this machine."""
        if not self.loopback_only:
            return
        if not is_loopback(host_name(request.headers.get("host", ""))):
            raise Refusal(421, "this console answers to loopback names only")
        if _off_loopback(request.client.host if request.client is not None else ""):
            raise Refusal(403, "this console answers to this machine only")

    def check_token(self, request: Request) -> None:
        """With a token set, the request carries it (header or cookie)."""
        if self.token is None:
            return
        given = request.cookies.get(TOKEN_COOKIE, "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if not secrets.compare_digest(given.encode(), self.token.encode()):
            raise Refusal(401, "this console needs its token")

    def check_origin_and_csrf(self, request: Request, form: dict[str, str]) -> None:
        """A state-changing request comes from a page of this console: same origin, and
        the form's CSRF token is this browser's."""
        host = request.headers.get("host", "")
        origin = request.headers.get("origin") or request.headers.get("referer")
        if not origin or urlsplit(origin).netloc != host:
            raise Refusal(403, "a change must come from a page of this console (Origin check)")
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = form.get("csrf", "")
        if not cookie or not secrets.compare_digest(cookie.encode(), sent.encode()):
            raise Refusal(403, "the form's CSRF token is missing or stale; reload the page")


def csrf_of(request: Request) -> tuple[str, bool]:
    """This browser's CSRF token, and whether it is new (then it must be set as a cookie)."""
    known = request.cookies.get(CSRF_COOKIE)
    if known and len(known) == 64:
        return known, False
    return secrets.token_hex(32), True


def _off_loopback(peer: str) -> bool:
    """Whether ``peer`` is an address of another machine. A peer that is no address (a
    Unix socket, an in-process transport) is this machine's."""
    try:
        return not ipaddress.ip_address(peer.strip("[]")).is_loopback
    except ValueError:
        return False
