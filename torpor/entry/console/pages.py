"""The console's pages as HTML strings: every value escaped here, nothing else renders.

Server-rendered, one small script (``static/console.js``) for live counts and confirm
prompts; every form that changes something carries the login's CSRF token.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

from torpor.deliveries import Delivery
from torpor.entry.console.login import Principal
from torpor.entry.console.reads import Filters, Page, SoonWait, Timeline
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus


def e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def when(at: datetime | None) -> str:
    return "—" if at is None else at.strftime("%Y-%m-%d %H:%M:%S")


def layout(base: str, principal: Principal | None, title: str, body: str, csrf: str = "") -> str:
    who = ""
    if principal is not None:
        scope = "all tenants" if principal.tenant is None else f"tenant {principal.tenant}"
        who = (
            f'<span class="who">{e(principal.role.value)} {e(principal.key_id)} · {e(scope)}'
            f"{' · read-only' if not principal.operator else ''}</span>"
            f'<form method="post" action="{base}/logout" class="inline">'
            f'<input type="hidden" name="csrf" value="{e(csrf)}">'
            f'<button type="submit">Log out</button></form>'
        )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)} · torpor console</title>"
        f'<link rel="stylesheet" href="{base}/static/console.css">'
        f'<script defer src="{base}/static/console.js"></script>'
        f'</head><body data-base="{e(base)}"><header>'
        f'<a class="brand" href="{base}/">torpor console</a>'
        f"{who}</header><main>{body}</main></body></html>"
    )


def login(base: str, csrf: str, error: str | None = None) -> str:
    note = f'<p class="error" role="alert">{e(error)}</p>' if error else ""
    body = (
        '<section class="login"><h1>Sign in</h1>'
        "<p>An operator key sees and steers every tenant; a tenant's API key gives a "
        "read-only view of that tenant.</p>"
        f"{note}"
        f'<form method="post" action="{base}/login">'
        f'<input type="hidden" name="csrf" value="{e(csrf)}">'
        '<label>Key <input type="password" name="key" autocomplete="off" required '
        'autofocus></label> <button type="submit">Sign in</button></form></section>'
    )
    return layout(base, None, "Sign in", body)


def _options(values: Iterable[str], chosen: str | None, blank: str) -> str:
    out = [f'<option value="">{e(blank)}</option>']
    for v in values:
        sel = " selected" if v == chosen else ""
        out.append(f'<option value="{e(v)}"{sel}>{e(v)}</option>')
    return "".join(out)


def counts_bar(counts: dict[str, int]) -> str:
    cells = "".join(
        f'<a class="count" href="?state={e(s)}"><span class="label">{e(s)}</span>'
        f'<span class="n" data-count="{e(s)}">{n}</span></a>'
        for s, n in counts.items()
    )
    return f'<nav class="counts" aria-label="sessions by state">{cells}</nav>'


def session_list(
    base: str,
    principal: Principal,
    csrf: str,
    *,
    tenants: list[str],
    agents: list[str],
    filters: Filters,
    page: Page,
    counts: dict[str, int],
    query: dict[str, str],
    search: str = "",
    search_missed: bool = False,
    overview: str = "",
) -> str:
    state = filters.state.value if filters.state else None
    states = _options([s.value for s in SessionState], state, "any")
    due = "" if filters.due_within_s is None else f"{filters.due_within_s / 60:g}"
    form = (
        f'<form class="filters" method="get" action="{base}/">'
        f'<label>Tenant <select name="tenant">{_options(tenants, filters.tenant, "all")}'
        "</select></label>"
        f'<label>Agent <select name="agent">{_options(agents, filters.agent, "any")}'
        "</select></label>"
        f'<label>Batch <input name="batch" value="{e(filters.batch or "")}" size="14"></label>'
        f'<label>State <select name="state">{states}'
        "</select></label>"
        "<label>Due within (min) "
        f'<input name="due" type="number" min="0" step="any" value="{e(due)}" size="5"></label>'
        '<button type="submit">Filter</button></form>'
        f'<form class="search" method="get" action="{base}/search">'
        "<label>Find "
        f'<input name="q" value="{e(search)}" size="44" '
        'placeholder="session id, correlation id or business key"></label>'
        '<button type="submit">Search</button></form>'
    )
    missed = (
        f'<p class="error" role="alert">Nothing found for {e(search)}</p>' if search_missed else ""
    )
    rows = "".join(
        "<tr>"
        f'<td><a class="sid" href="{base}/sessions/{e(r.session_id)}">{e(r.session_id)}</a></td>'
        f"<td>{e(r.tenant)}</td><td>{e(r.agent)}</td>"
        f'<td><span class="state s-{e(r.state.value)}">{e(r.state.value)}</span></td>'
        f"<td>{e(r.batch_id or '')}</td><td>{when(r.next_deadline)}"
        f"</td><td>{when(r.updated_at)}</td>"
        "</tr>"
        for r in page.rows
    )
    table = (
        '<table class="sessions"><thead><tr><th>Session</th><th>Tenant</th><th>Agent</th>'
        "<th>State</th><th>Batch</th><th>Next deadline</th><th>Updated</th></tr></thead>"
        f"<tbody>{rows or '<tr><td colspan=7>No sessions match.</td></tr>'}</tbody></table>"
    )
    more = ""
    if page.next_cursor:
        link = urlencode({**query, "cursor": page.next_cursor})
        more = f'<p><a class="next" rel="next" href="{base}/?{e(link)}">Next page →</a></p>'
    body = f"{counts_bar(counts)}{form}{missed}<h1>Sessions</h1>{table}{more}{overview}"
    return layout(base, principal, "Sessions", body, csrf)


def _reason_field() -> str:
    return '<input name="reason" required placeholder="reason (audited)" size="28">'


def _form(base: str, action: str, csrf: str, label: str, fields: str = "", cls: str = "") -> str:
    return (
        f'<form method="post" action="{base}{action}"'
        f' class="action {cls}" data-confirm="{e(label)}?">'
        f'<input type="hidden" name="csrf" value="{e(csrf)}">{fields}{_reason_field()}'
        f'<button type="submit">{e(label)}</button></form>'
    )


def overview(
    base: str,
    principal: Principal,
    csrf: str,
    *,
    soon: list[SoonWait],
    outcomes: dict[str, Counter[str]],
    dead: list[Delivery],
    health: dict[str, Any],
    audit: dict[str, Any] | None,
) -> str:
    soon_rows = "".join(
        f'<tr><td><a href="{base}/sessions/{e(s.session_id)}">{e(s.session_id)}</a></td>'
        f"<td>{e(s.tenant)}</td><td>{e(s.wait.tool_name)}</td>"
        f"<td><code>{e(s.wait.correlation_id)}</code></td>"
        f"<td>{when(s.wait.deadline)}</td></tr>"
        for s in soon
    )
    out_rows = "".join(
        f"<tr><td>{e(src)}</td><td>{e(verdict)}</td><td>{n}</td></tr>"
        for src, c in sorted(outcomes.items())
        for verdict, n in sorted(c.items())
    )
    dead_rows = "".join(
        f'<tr class="dead-letter" data-delivery="{e(d.delivery_id)}"><td>{e(d.tenant)}</td>'
        f'<td><a href="{base}/sessions/{e(d.session_id)}">{e(d.session_id)}</a></td>'
        f"<td>{e(d.event_type)}</td><td>{e(d.url)}</td><td>{d.attempts}</td>"
        f"<td>{e(d.last_error if principal.operator else d.last_category)}</td><td>"
        + (
            _form(base, f"/deliveries/{e(d.tenant)}/{e(d.delivery_id)}/resend", csrf, "Resend")
            if principal.operator
            else ""
        )
        + "</td></tr>"
        for d in dead
    )
    steps = health.get("steps") or {}
    step_rows = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in steps.items())
    age = health.get("last_sweep_age_s")
    audit_html = ""
    if audit is not None:
        audit_rows = "".join(
            f"<tr><td>{e(stream)}</td><td>{'ok' if c.ok else 'BROKEN'}</td><td>{c.records}</td>"
            f"<td>{e(c.why)}</td><td>{e(c.checkpoints)}</td></tr>"
            for stream, c in audit.items()
        )
        audit_html = (
            '<section id="audit"><h2>Audit chain</h2>'
            "<table><thead><tr><th>Stream</th><th>Chain</th>"
            "<th>Records</th><th>Why</th><th>Checkpoints</th></tr></thead>"
            f"<tbody>{audit_rows or '<tr><td colspan=5>No audit records yet.</td></tr>'}"
            "</tbody></table></section>"
        )
    elif principal.operator:
        audit_html = (
            f'<section id="audit"><h2>Audit chain</h2><p><a href="{base}/?verify=1#audit">'
            "Verify the audit chain</a> (reads every block)</p></section>"
        )
    problems = health.get("problems") or []
    return (
        '<section id="due"><h2>Waits due soon</h2><table><thead><tr><th>Session</th><th>Tenant</th>'
        "<th>Tool</th><th>Correlation id</th><th>Deadline</th></tr></thead>"
        f"<tbody>{soon_rows or '<tr><td colspan=5>None.</td></tr>'}</tbody></table></section>"
        '<section id="outcomes"><h2>Webhook outcomes</h2><table><thead><tr><th>Source</th>'
        "<th>Verdict</th><th>Count</th></tr></thead>"
        f"<tbody>{out_rows or '<tr><td colspan=3>None recorded.</td></tr>'}"
        "</tbody></table></section>"
        '<section id="dead"><h2>Dead letters</h2><table><thead><tr><th>Tenant</th><th>Session</th>'
        "<th>Event</th><th>URL</th><th>Attempts</th><th>Last error</th><th></th></tr></thead>"
        f"<tbody>{dead_rows or '<tr><td colspan=7>None.</td></tr>'}</tbody></table></section>"
        '<section id="health"><h2>Reconciler</h2>'
        f"<p>Last complete sweep: {'never' if age is None else f'{age:.0f} s ago'}"
        f"{' · ' + e('; '.join(problems)) if problems else ' · healthy'}</p>"
        "<table><thead><tr><th>Step</th><th>Last error</th></tr></thead>"
        f"<tbody>{step_rows or '<tr><td colspan=2>No step errors reported.</td></tr>'}"
        "</tbody></table></section>"
        f"{audit_html}"
    )


def _json(value: object) -> str:
    return e(json.dumps(value, default=str, ensure_ascii=False)[:2000])


def session_page(
    base: str,
    principal: Principal,
    csrf: str,
    t: Timeline,
    *,
    can_reassign: bool,
    notice: str | None = None,
) -> str:
    s = t.snapshot
    op = principal.operator
    sid = e(s.session_id)
    history = "".join(
        f"<li><time>{when(h.at)}</time> "
        f"<span class='state s-{e(h.state.value)}'>{e(h.state.value)}</span>"
        f" epoch {h.epoch} <span class='why'>{e(h.reason)}</span></li>"
        for h in s.history
    )
    waits = ""
    for w in s.waits:
        guard = w.guard.model_dump(mode="json", exclude_none=True) if w.guard else None
        actions = ""
        if op and not s.terminal:
            cid = e(w.correlation_id)
            actions = _form(
                base,
                f"/sessions/{sid}/resolve",
                csrf,
                "Force-resolve",
                f'<input type="hidden" name="correlation_id" value="{cid}">'
                f'<textarea name="payload" rows="2" cols="36" required>{{"status": "approved"}}'
                "</textarea>",
                "resolve",
            )
            if can_reassign:
                actions += _form(
                    base,
                    f"/sessions/{sid}/reassign",
                    csrf,
                    "Reassign approval",
                    f'<input type="hidden" name="correlation_id" value="{cid}">'
                    '<input name="approver" required placeholder="new approver" size="14">',
                )
        waits += (
            f'<div class="wait" data-correlation="{e(w.correlation_id)}"><dl>'
            f"<dt>Tool</dt><dd>{e(w.tool_name)}</dd>"
            f"<dt>Correlation id</dt><dd><code>{e(w.correlation_id)}</code></dd>"
            f"<dt>Business key</dt><dd>{e(w.business_key)}</dd>"
            f"<dt>Epoch / step</dt><dd>{w.epoch} / {e(w.waiting_step_id)}</dd>"
            f"<dt>Deadline</dt><dd>{when(w.deadline)}</dd>"
            f"<dt>Guard baseline</dt><dd><code>{_json(guard)}</code></dd>"
            f"<dt>Sources</dt><dd>{e(', '.join(w.allowed_sources))}</dd>"
            f"</dl>{actions}</div>"
        )
    inbox = "".join(
        f"<tr><td>{when(line.event.received_at)}</td><td>{e(line.event.source)}</td>"
        f"<td>{e(line.event.type)}</td><td><code>{e(line.event.event_id)}</code></td>"
        f"<td>{e(line.event.kind.value)}</td><td class='verdict'>{e(line.verdict)}</td>"
        f"<td><code>{_json(line.event.data)}</code></td></tr>"
        for line in t.inbox
    )
    tools = "".join(
        f"<tr><td>{entry.step}</td><td>{e(entry.tool_name)}"
        f"</td><td><code>{e(entry.tool_call_id)}</code></td>"
        f"<td>{when(entry.completed_at)}</td><td><code>{_json(entry.result)}</code></td></tr>"
        for entry in s.tool_log.values()
    )
    outbox = ""
    for o in s.outbox:
        resend = ""
        if op and o.status is DispatchStatus.DEAD:
            resend = _form(base, f"/sessions/{sid}/outbox/{e(o.entry_id)}/resend", csrf, "Resend")
        outbox += (
            f"<tr><td>{e(o.kind.value)}</td><td>{e(o.tool_name)}"
            f"</td><td><code>{e(o.idempotency_key)}</code></td>"
            f"<td>{e(o.status.value)}</td><td>{o.attempts}</td><td>{e(o.last_error)}</td>"
            f"<td>{when(o.dispatched_at)}</td><td>{resend}</td></tr>"
        )
    notes = "".join(
        f"<tr><td>{e(d.event_type)}</td><td>{e(d.url)}</td><td>{e(d.status.value)}</td>"
        f"<td>{d.attempts}</td><td>{when(d.delivered_at)}</td></tr>"
        for d in t.deliveries
    )
    audit = "".join(
        f"<tr><td>{when(r.at)}</td><td>{e(r.source)}</td><td>{e(r.verdict)}</td>"
        f"<td><code>{e(r.event_id)}</code></td><td><code>{e(r.hash[:16])}</code></td></tr>"
        for r in t.audit
    )
    controls = ""
    if op and not s.terminal:
        controls = (
            '<div class="controls">'
            + _form(base, f"/sessions/{sid}/cancel", csrf, "Cancel session", cls="danger")
            + _form(base, f"/sessions/{sid}/retry", csrf, "Retry now")
            + "</div>"
        )
    quarantine = (
        f'<p class="error">Quarantined: {e(s.quarantine.reason)} ({e(s.quarantine.code)})</p>'
        if s.quarantine
        else ""
    )
    flash = f'<p class="notice" role="status">{e(notice)}</p>' if notice else ""

    def table(head: list[str], rows: str, empty: str = "None.") -> str:
        cols = "".join(f"<th>{e(h)}</th>" for h in head)
        return (
            f"<table><thead><tr>{cols}</tr></thead><tbody>"
            f"{rows or f'<tr><td colspan={len(head)}>{e(empty)}</td></tr>'}</tbody></table>"
        )

    body = (
        f'<h1>Session <code id="session-id">{sid}</code></h1>{flash}'
        f"<p>Tenant {e(s.tenant)} · agent {e(s.agent.name)} {e(s.agent.version)} · "
        f'<span id="session-state" class="state s-{e(s.state.value)}" '
        f'data-live-state="{sid}">{e(s.state.value)}'
        "</span>"
        f" · epoch {s.epoch} · generation {s.generation} · trace <code>{e(s.trace_id)}</code>"
        f"{' · batch ' + e(s.batch_id) if s.batch_id else ''}</p>{quarantine}{controls}"
        '<section id="transitions"><h2>Transitions</h2>'
        f'<ol class="history">{history}</ol></section>'
        f'<section id="waits"><h2>Waits</h2>{waits or "<p>No open wait.</p>"}</section>'
        '<section id="inbox"><h2>Inbox</h2>'
        + table(["Received", "Source", "Type", "Event id", "Kind", "Verdict", "Data"], inbox)
        + '</section><section id="tools"><h2>Tool calls</h2>'
        + table(["Step", "Tool", "Call id", "Completed", "Result"], tools)
        + '</section><section id="outbox"><h2>Outbox</h2>'
        + table(
            ["Kind", "Tool", "Idempotency key", "Status", "Attempts", "Last error", "Sent", ""],
            outbox,
        )
        + '</section><section id="notifications"><h2>Notifications</h2>'
        + table(["Event", "URL", "Status", "Attempts", "Delivered"], notes)
        + '</section><section id="audit-records"><h2>Audit records</h2>'
        + table(["At", "Source", "Verdict", "Event id", "Hash"], audit)
        + f'</section><section id="result"><h2>Result</h2><code>{_json(s.result)}</code>'
        f"{'<p>Error: ' + e(s.error.message) + '</p>' if s.error else ''}</section>"
    )
    return layout(base, principal, f"Session {s.session_id}", body, csrf)
