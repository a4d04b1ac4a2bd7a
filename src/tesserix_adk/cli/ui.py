"""``tesserix ui``: serve the web console (``tesserix_adk.console``) with uvicorn.

It binds to loopback unless told otherwise, and any other host needs a token (``--token``
or ``$TESSERIX_UI_TOKEN``): the console decides approvals and calls in doubt, so it is never
open to a network without one. Starlette and uvicorn (the ``[ui]`` extra) are imported only
here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from typing import Any

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.cli.failures import ExitCode
from tesserix_adk.cli.text import escaped

__all__ = ["TOKEN_ENV", "add_ui_command", "run_ui"]

TOKEN_ENV = "TESSERIX_UI_TOKEN"


def add_ui_command(sub: Any, parents: Any = ()) -> None:
    """Add ``ui`` to ``sub`` (an ``add_subparsers()`` result)."""
    p = sub.add_parser(
        "ui",
        help="serve the web console (loopback only unless given a token)",
        description=(
            "Runs, their frontiers and calls, approvals and parked runs in a browser; approve, "
            "deny, resolve and cancel there as with the commands. Any host but loopback needs "
            f"a token (--token or ${TOKEN_ENV})."
        ),
        parents=parents,
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8765, help="the port (default 8765)")
    p.add_argument("--token", help=f"the token every request must carry (default ${TOKEN_ENV})")


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is one sentence (and port 0
    is a free one, printed)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def _stopped(signum: int, frame: Any) -> None:
    """The signal uvicorn already stopped on, raised again: nothing more to do."""


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number (0-65535)")
    return port


def run_ui(args: argparse.Namespace, url: str) -> int:
    """Serve the console on ``args.host``/``args.port`` over the store ``url`` until stopped."""
    try:
        import uvicorn

        from tesserix_adk.console import create_app
        from tesserix_adk.console.guard import is_loopback
    except ImportError as exc:
        sys.stderr.write(
            f"tesserix: ui: the console needs the ui extra ({exc}): "
            'pip install "tesserix-adk[ui]"\n'
        )
        return int(ExitCode.USAGE)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    loopback = is_loopback(args.host)
    if not loopback and token is None:
        sys.stderr.write(
            f"tesserix: ui: host {escaped(args.host)} is not loopback, so the console needs a "
            f"token: pass --token or set ${TOKEN_ENV}\n"
        )
        return int(ExitCode.USAGE)
    from tesserix_adk.errors import ConfigurationError
    from tesserix_adk.stores.urls import open_stores, redact_url

    try:
        # Read now (it does no I/O), so a URL no store can open is one sentence here, not
        # a traceback from the server's start-up.
        probe = open_stores(url)
    except ConfigurationError as exc:
        # Masked as every other command's error is: it may quote the store's URL.
        sys.stderr.write(f"tesserix: ui: {escaped(default_redactor().text(str(exc)))}\n")
        return int(ExitCode.USAGE)
    asyncio.run(probe.aclose())
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        sys.stderr.write(
            f"tesserix: ui: cannot listen on {escaped(args.host)} port {args.port}: "
            f"{escaped(exc.strerror or str(exc))}\n"
        )
        return int(ExitCode.HELD)
    port = sock.getsockname()[1]
    try:
        app = create_app(url, token=token, loopback_only=loopback)
    except ConfigurationError as exc:
        sock.close()
        sys.stderr.write(f"tesserix: ui: {escaped(default_redactor().text(str(exc)))}\n")
        return int(ExitCode.USAGE)
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", access_log=False, ws="none", http="h11"
    )
    server = uvicorn.Server(config)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    sys.stdout.write(
        f"tesserix ui: serving {escaped(redact_url(url))} on http://{escaped(shown)}:{port}/ "
        f"({'token required' if token else 'loopback, no token'}); Ctrl-C stops it\n"
    )
    sys.stdout.flush()
    # uvicorn stops on SIGINT/SIGTERM, then raises the signal again for the handler it found;
    # with this one that is the end of a clean stop (exit 0), not a death by signal.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stopped)
    with sock:
        server.run(sockets=[sock])
    return int(ExitCode.CARRIED_ON) if server.started else int(ExitCode.HELD)
