"""``create_app``: the console as a Starlette ASGI app over one store.

Pages live under ``/t/{tenant}/``: the tenant is always the one in the address, and every
read and decision is made under it. Decisions go through ``actions`` (the CLI's commands).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, unquote, unquote_to_bytes

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from tesserix_adk.cli.failures import ExitCode, explain
from tesserix_adk.console import actions, pages
from tesserix_adk.console.guard import CSRF_COOKIE, TOKEN_COOKIE, Guard, Refusal, csrf_of
from tesserix_adk.console.reads import RunFilter, run_detail, runs, unstarted_run
from tesserix_adk.console.templates import render
from tesserix_adk.errors import AdkError, ConfigurationError
from tesserix_adk.stores.bundle import Stores

__all__ = ["create_app"]

_MAX_FORM = 64 * 1024

Handler = Callable[[Request], Awaitable[Response]]


def create_app(
    url_or_stores: str | Stores, *, token: str | None = None, loopback_only: bool = True
) -> Starlette:
    """The console over a store URL (opened and closed with the app) or open ``Stores``
    (the caller's, on the serving event loop). With ``token``, every request needs it;
    ``loopback_only`` refuses requests whose Host is not a loopback name. Served off
    loopback without a token (none given, or a blank one: an unset variable) is refused,
    ``ConfigurationError``, as ``tesserix ui`` refuses it: anyone who reaches the port could
    approve a call."""
    if not loopback_only and not (token or "").strip():
        raise ConfigurationError(
            "a console served off loopback needs a token (the one given is blank); give "
            "create_app a token, or keep loopback_only"
        )
    state: dict[str, Stores] = {}
    guard = Guard(token=token or None, loopback_only=loopback_only)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if isinstance(url_or_stores, Stores):
            state["stores"] = url_or_stores
            yield
            return
        from tesserix_adk.stores.urls import open_stores

        stores = open_stores(url_or_stores)
        state["stores"] = stores
        try:
            yield
        finally:
            await stores.aclose()

    def stores() -> Stores:
        return state["stores"]

    def guarded(handler: Handler, *, write: bool = False, token: bool = True) -> Handler:
        """``handler`` behind the Host and token checks (``token=False``: the login form's
        own), and for ``write`` the CSRF and Origin checks; the browser's CSRF cookie is set
        on its first page."""

        async def wrapped(request: Request) -> Response:
            csrf, new = csrf_of(request)
            request.state.csrf = csrf
            try:
                _check_path(request)
                guard.check_host(request)
                if token:
                    guard.check_token(request)
                if write:
                    form = await _form(request)
                    request.state.form = form
                    guard.check_origin_and_csrf(request, form)
                response = await handler(request)
            except Refusal as refusal:
                if refusal.status == 401 and not write:
                    return RedirectResponse("/login", status_code=303)
                response = _refused(refusal)
            except AdkError as exc:
                # A store down or slow: what the CLI would say (exit 3), never a bare 500.
                # The run and tenant the page names are the operator's own words.
                _, text = explain(exc, told=request.path_params.values())
                response = _refused(Refusal(503 if exc.retryable else 500, text))
            if new:
                response.set_cookie(
                    CSRF_COOKIE, csrf, httponly=True, samesite="strict", secure=_tls(request)
                )
            return response

        return wrapped

    async def home(request: Request) -> Response:
        return _html(pages.page("tenant", render("home.html")))

    async def tenant(request: Request) -> Response:
        name = request.query_params.get("tenant", "").strip()
        if not name:
            return RedirectResponse("/", status_code=303)
        return RedirectResponse(pages.tenant_path(name, "runs"), status_code=303)

    async def runs_list(request: Request) -> Response:
        tenant = _param(request, "tenant")
        q = request.query_params
        where = RunFilter(
            status=q.get("status") or None, agent=q.get("agent") or None, stuck=bool(q.get("stuck"))
        )
        return _html(pages.runs_page(tenant, where, await runs(stores(), tenant, where)))

    async def run(request: Request) -> Response:
        tenant, run_id = _param(request, "tenant"), _param(request, "run")
        detail = await run_detail(stores(), tenant, run_id)
        if detail is None:
            waiting = await unstarted_run(stores(), tenant, run_id)
            if waiting is not None:
                return _html(pages.unstarted_page(tenant, waiting, request.state.csrf))
            text = f"nothing is checkpointed under run {run_id!r} for tenant {tenant!r}"
            return _html(
                pages.page(
                    "no such run",
                    render("error.html", heading="No such run", text=text),
                    tenant=tenant,
                ),
                404,
            )
        return _html(pages.run_page(tenant, detail, request.state.csrf))

    async def approve(request: Request) -> Response:
        tenant, request_id = _param(request, "tenant"), _param(request, "request")
        form = request.state.form
        decision = form.get("decision")
        if decision not in ("approve", "deny"):
            raise Refusal(400, "say approve or deny: the decision is taken as asked, never guessed")
        argv = actions.approve_argv(
            tenant,
            request_id,
            by=form.get("by", ""),
            note=form.get("note") or None,
            deny=decision == "deny",
        )
        done = await actions.carry_out(argv, stores())
        back = ""
        got = await stores().approvals.get(tenant, request_id)
        if got is not None:
            back = got.run_id
        return _result(tenant, back, "Approval", done)

    async def resolve(request: Request) -> Response:
        tenant, run_id = _param(request, "tenant"), _param(request, "run")
        form = request.state.form
        what = form.get("what")
        if what not in ("never_ran", "outcome"):
            raise Refusal(400, "say whether the call never ran or what its outcome was")
        never_ran = what == "never_ran"
        if never_ran and (form.get("outcome") or "").strip():
            # As the CLI refuses --never-ran beside --outcome: an operator who typed what
            # the call returned and left the choice as it was must not record "never ran",
            # which sends the call again.
            raise Refusal(
                400,
                "say either that the call never ran or what its outcome was, not both: "
                "nothing was recorded",
            )
        argv = actions.resolve_argv(
            tenant,
            run_id,
            call=form.get("call", ""),
            by=form.get("by", ""),
            never_ran=never_ran,
            outcome=form.get("outcome"),
        )
        return _result(tenant, run_id, "Resolution", await actions.carry_out(argv, stores()))

    async def cancel(request: Request) -> Response:
        tenant, run_id = _param(request, "tenant"), _param(request, "run")
        form = request.state.form
        argv = actions.cancel_argv(
            tenant, run_id, by=form.get("by", ""), reason=form.get("reason") or None
        )
        done = await actions.carry_out(argv, stores())
        # A run that ended before the cancel came records none: its page says so.
        heading = "Nothing to cancel" if done.cancel_state == "already_ended" else None
        return _result(tenant, run_id, "Cancel", done, heading=heading)

    async def login_form(request: Request) -> Response:
        return _html(pages.page("token", render("login.html", csrf=request.state.csrf)))

    async def login(request: Request) -> Response:
        given = request.state.form.get("token", "").encode()
        if guard.token is None or not secrets.compare_digest(given, guard.token.encode()):
            raise Refusal(401, "that is not this console's token")
        response = RedirectResponse("/", status_code=303)
        # Secure behind TLS: never sent over plain http, where anyone on the path reads it.
        response.set_cookie(
            TOKEN_COOKIE, guard.token, httponly=True, samesite="strict", secure=_tls(request)
        )
        return response

    files = StaticFiles(packages=[("tesserix_adk.console", "static")])

    async def static(request: Request) -> Response:
        # Behind the same Host and token checks as every page.
        response: Response = await files.get_response(_param(request, "path"), request.scope)
        return response

    routes: list[Any] = [
        Route("/", guarded(home)),
        Route("/tenant", guarded(tenant)),
        Route("/login", guarded(login_form, token=False), methods=["GET"]),
        Route("/login", guarded(login, write=True, token=False), methods=["POST"]),
        Route("/t/{tenant}/runs", guarded(runs_list)),
        Route("/t/{tenant}/runs/{run:path}", guarded(run), methods=["GET"]),
        Route(
            "/t/{tenant}/runs/{run:path}/resolve", guarded(resolve, write=True), methods=["POST"]
        ),
        Route("/t/{tenant}/runs/{run:path}/cancel", guarded(cancel, write=True), methods=["POST"]),
        Route("/t/{tenant}/approvals/{request}", guarded(approve, write=True), methods=["POST"]),
        Route("/static/{path:path}", guarded(static)),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(_RoutedRaw)])


class _RoutedRaw:
    """Routes on the address as sent: an id's encoded ``/`` (``%2F``) stays inside its
    part, so ``/t/acme%2Feu/runs`` is tenant ``acme/eu``, never tenant ``acme``'s run
    ``eu``. Each handler decodes its own parts (``_param``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") if scope["type"] == "http" else None
        if raw:
            # Percent-encoded ASCII as sent (anything else is refused by ``_check_path``).
            scope = {**scope, "path": raw.decode("latin-1")}
        await self.app(scope, receive, send)


def _param(request: Request, name: str) -> str:
    """A part of the address, decoded (``_check_path`` made sure it is UTF-8)."""
    return unquote(request.path_params[name], errors="strict")


def _check_path(request: Request) -> None:
    """An address whose ids are not UTF-8 names no tenant or run: refused, never read as
    the replacement character (two such addresses would be one tenant nobody typed); nor
    does one holding a NUL."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    if not raw.isascii():
        # Sent unencoded, its bytes would be routed as Latin-1 (``_RoutedRaw``).
        raise Refusal(400, "that address is not percent-encoded")
    try:
        path = unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(400, "that address is not UTF-8") from None
    if "\x00" in path:
        # No id the kit keeps holds one (``run.ids``); PostgreSQL could not even be asked.
        raise Refusal(400, "that address holds a NUL character, which no tenant or run id does")


def _tls(request: Request) -> bool:
    """Whether the page was asked for over https (uvicorn's ``--proxy-headers`` says so
    behind a proxy that ends TLS); a cookie marked ``Secure`` over plain http is dropped."""
    return request.url.scheme == "https"


def _refused(refusal: Refusal) -> Response:
    body = render("error.html", heading="Refused", text=refusal.text)
    return _html(pages.page("refused", body), refusal.status)


def _result(
    tenant: str, run_id: str, what: str, done: actions.Done, *, heading: str | None = None
) -> Response:
    """The page a decision answers with: ``what`` recorded or refused (or ``heading``)."""
    body = render(
        "result.html",
        heading=heading or what + (" recorded" if done.ok else " refused"),
        css="done" if done.ok else "refused",
        text=done.text,
        back=pages.tenant_path(tenant, "runs", run_id)
        if run_id
        else pages.tenant_path(tenant, "runs"),
        run=run_id,
    )
    return _html(pages.page(what, body, tenant=tenant), _STATUS.get(done.code, 409))


# What a decision's exit code is over HTTP: the store busy or down (the CLI's "retry
# later") is not a conflict with a decision already made.
_STATUS = {ExitCode.CARRIED_ON: 200, ExitCode.HELD: 503}


def _html(text: str, status: int = 200) -> HTMLResponse:
    response = HTMLResponse(text, status_code=status)
    # No page of the console may be framed by another site (clickjacking a decision).
    response.headers["x-frame-options"] = "DENY"
    response.headers["content-security-policy"] = "default-src 'self'; frame-ancestors 'none'"
    response.headers["referrer-policy"] = "same-origin"
    return response


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the console's only kind of form),
    refused past ``_MAX_FORM`` before more of it is read than that."""
    declared = request.headers.get("content-length", "")
    if declared.strip().isdigit() and int(declared) > _MAX_FORM:
        raise Refusal(413, "that form is too large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > _MAX_FORM:
            raise Refusal(413, "that form is too large")
        chunks.append(chunk)
    body = b"".join(chunks)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refusal(415, "the console takes forms only")
    try:
        fields = parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        # A value that is not UTF-8 would be carried out with U+FFFD in its place.
        raise Refusal(400, "that form is not UTF-8") from None
    form = dict(fields)
    if len(form) != len(fields):
        # ``decision=deny&decision=approve``: which one was meant is not guessed.
        raise Refusal(400, "that form gives a field twice")
    return form
