"""The console's pages, rendered from ``reads`` with ``templates`` (every value escaped)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from tesserix_adk.checkpoint.payload import CheckpointStatus
from tesserix_adk.cli.reasons import carriable
from tesserix_adk.console.reads import RunDetail, RunFilter, RunSummary, key_digest, shown_value
from tesserix_adk.console.templates import Markup, join, render
from tesserix_adk.run.approvals import of_the_turn, whose
from tesserix_adk.run.unstarted import Unstarted
from tesserix_adk.stores.protocols import RecordStatus, RunLease
from tesserix_adk.timestamps import shown_time
from tesserix_adk.tools import key_digest as digest_of

__all__ = ["page", "run_page", "runs_page", "tenant_path", "unstarted_page"]


def tenant_path(tenant: str, *rest: str) -> str:
    """``/t/TENANT/...`` with each part quoted, so an id never changes the address."""
    return "/" + "/".join(quote(p, safe="") for p in ("t", tenant, *rest))


def page(title: str, body: Markup, *, tenant: str | None = None) -> str:
    """A whole page around ``body``."""
    crumbs: Markup | str = ""
    if tenant is not None:
        crumbs = render("crumbs.html", href=tenant_path(tenant, "runs"), tenant=tenant)
    return str(render("layout.html", title=title, crumbs=crumbs, body=body))


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return shown_time(epoch, "%Y-%m-%d %H:%M:%S")


def _held(lease: RunLease | None) -> str:
    if lease is None:
        return "nobody"
    return f"{lease.holder} (fence {lease.fence}) until {_when(lease.expires_at)} UTC"


def runs_page(tenant: str, where: RunFilter, rows: list[RunSummary]) -> str:
    """The runs list with its filters."""
    options = [render("option.html", value="", selected="", label="any")]
    for status in CheckpointStatus:
        selected = "selected" if where.status == status.value else ""
        options.append(render("option.html", value=status.value, selected=selected, label=status))
    body = render(
        "runs.html",
        tenant=tenant,
        status_options=join(options),
        agent=where.agent or "",
        stuck_checked=Markup("checked") if where.stuck else "",
        rows=join([_run_row(tenant, r) for r in rows]),
        empty=Markup("<p id='none'>no runs</p>") if not rows else "",
    )
    return page(f"runs of {tenant}", body, tenant=tenant)


def _run_row(tenant: str, r: RunSummary) -> Markup:
    return render(
        "run_row.html",
        css="stuck" if r.stuck else "",
        href=tenant_path(tenant, "runs", r.run_id),
        run=r.run_id,
        agent=r.agent,
        status=r.said or (r.status if r.unreadable is None else f"unreadable: {r.unreadable}"),
        step="-" if r.unstarted else r.step,
        written=_when(r.written_at),
        in_flight=r.in_flight,
        held=_held(r.lease) if r.lease else "",
        waiting=r.pending_approval or "",
        parked=r.parked if r.parked is not None else (r.blocked or ""),
    )


def _call_item(tool: str, call: str, arguments: Mapping[str, Any]) -> Markup:
    return render("call_item.html", tool=tool, call=call, arguments=shown_value(dict(arguments)))


def run_page(tenant: str, d: RunDetail, csrf: str) -> str:
    """One run: its frontier, plan, calls, steps, approval, parked reason and actions."""
    cp = d.checkpoint
    run_path = tenant_path(tenant, "runs", cp.run_id)
    in_flight = {r.key for r in d.records if r.status is RecordStatus.in_flight}
    plan_rows = []
    for p in d.plan.calls:
        resolve: Markup | str = ""
        if p.key in in_flight:
            resolve = render(
                "resolve_form.html",
                action=run_path + "/resolve",
                csrf=csrf,
                # The record by its key's digest: one record, whatever the call ids.
                call=digest_of(p.key),
            )
        plan_rows.append(
            render(
                "plan_row.html",
                tool=p.tool,
                call=p.call_id or "-",
                key=key_digest(p.key),
                disposition=p.disposition,
                reason=p.reason,
                arguments="-" if p.arguments is None else shown_value(dict(p.arguments)),
                resolve=resolve,
            )
        )
    record_rows = [
        render(
            "record_row.html",
            tool=r.tool,
            call=r.call_id or "-",
            iteration="-" if r.iteration is None else r.iteration,
            key=key_digest(r.key),
            status=r.status,
            holder=r.holder if r.by is None else f"{r.holder}; recorded by {r.by}",
            outcome="-" if r.outcome is None else shown_value(r.outcome)[:2000],
        )
        for r in d.records
    ]
    step_rows = [
        render(
            "step_row.html",
            step=s.step,
            boundary=s.boundary if s.unreadable is None else f"unreadable: {s.unreadable}",
            iteration=s.iteration,
            status=s.status,
            written=_when(s.written_at),
            size=s.size,
        )
        for s in d.steps
    ]
    if d.steps_problem is not None:
        step_rows.append(
            render(
                "step_row.html",
                step="-",
                boundary=f"steps cannot be listed: {d.steps_problem}",
                iteration="-",
                status="-",
                written="-",
                size="-",
            )
        )
    messages = [
        render(
            "message.html",
            role=m.role,
            content=shown_value(m.content if isinstance(m.content, str) else list(m.content))[
                :2000
            ],
            calls=join([_call_item(c.name, c.id, c.arguments) for c in m.tool_calls]),
        )
        for m in d.messages
    ]
    if d.told_from is not None:
        messages.insert(0, render("message.html", role="not kept", content=d.told_from, calls=""))
    if d.transcript_problem is not None:
        messages.append(
            render("message.html", role="unreadable", content=d.transcript_problem, calls="")
        )
    approval: Markup | str = ""
    asked = cp.pending_approval
    unusable = None
    if asked is not None and d.approval is None:
        unusable = "The run waits on it, but it is gone from the approval store."
    elif d.approval is not None and not of_the_turn(d.approval, cp.tenant, cp.run_id, cp.iteration):
        # Never a form for it: deciding here would decide that other run's request.
        unusable = f"The approval store's request under this id names {whose(d.approval)}."
    if asked is not None and unusable is not None:
        approval = render("approval_unusable.html", id=asked.id, why=unusable)
    elif d.approval is not None:
        a = d.approval
        approval = render(
            "approval.html",
            id=a.id,
            requested=_when(a.requested_at),
            iteration=a.iteration,
            status=a.status,
            decided=""
            if a.by is None
            else f" by {a.by} at {_when(a.decided_at)} (UTC)" + (f": {a.note}" if a.note else ""),
            calls=join([_call_item(c.name, c.id, c.arguments) for c in a.calls]),
            action=tenant_path(tenant, "approvals", a.id),
            csrf=csrf,
        )
    parked: Markup | str = ""
    if d.parked is not None:
        parked = render("parked.html", reason=d.parked.reason or "")
    elif d.entry_problem is not None:
        parked = render("entry_problem.html", problem=d.entry_problem)
    cancel: Markup | str = ""
    if not cp.status.finished:
        cancel = render("cancel.html", action=run_path + "/cancel", csrf=csrf)
    body = render(
        "run.html",
        run=cp.run_id,
        tenant=cp.tenant,
        agent=cp.agent_name,
        revision=cp.agent_revision or "-",
        status=cp.status,
        step=cp.step,
        boundary=cp.boundary or "-",
        iteration=cp.iteration,
        input_tokens=d.usage.input_tokens,
        output_tokens=d.usage.output_tokens,
        spent=d.spent,
        lease=_held(d.lease),
        output=cp.output or "-",
        reason=cp.reason or "-",
        safe="yes" if carriable(cp, d.plan, d.refused) else "no",
        parked=parked,
        approval=approval,
        plan_rows=join(plan_rows),
        record_rows=join(record_rows),
        step_rows=join(step_rows),
        messages=join(messages),
        cancel=cancel,
    )
    return page(f"run {cp.run_id}", body, tenant=tenant)


def unstarted_page(tenant: str, run: Unstarted, csrf: str) -> str:
    """A run with no frontier yet: when it was submitted (or how a cancel ended it), why a
    worker parked it if one did, and the cancel form while it still waits."""
    item = run.item
    if run.unreadable is not None:
        where = f"unreadable: {run.unreadable}"
    elif run.cancel is not None:
        where = f"{run.said}, at {_when(item.since)} UTC"
    elif run.lease is not None:
        where = (
            f"submitted at {_when(item.since)} UTC; a worker is starting it: held by "
            f"{_held(run.lease)} (no frontier yet)"
        )
    else:
        where = f"submitted at {_when(item.since)} UTC; no worker has started it yet"
    parked: Markup | str = ""
    if run.parked is not None:
        parked = render("parked.html", reason=run.parked)
    cancel: Markup | str = ""
    if run.cancel is None and run.unreadable is None:
        action = tenant_path(tenant, "runs", item.run_id, "cancel")
        cancel = render("cancel.html", action=action, csrf=csrf)
    body = render(
        "unstarted.html",
        run=item.run_id,
        tenant=item.tenant,
        agent=item.agent,
        status=run.status,
        where=where,
        parked=parked,
        cancel=cancel,
    )
    return page(f"run {item.run_id}", body, tenant=tenant)
