"""A simulated OA (approvals) and ERP (budgets, orders) system, in its own process.

It is the far side of the demo: it receives approval requests from torpor's tools, holds
them like a busy finance director (until every document has asked), then answers each
with a real signed HTTP webhook after a random delay: some twice, some again much later,
some out of order after a re-plan, some through the capability link. An attacker rides
along: forged "approved" webhooks and replays of captured valid ones. It keeps a tally of
every answer torpor gave, which the demo checks at the end.

    python -m torpor.demo.simulator --config simulator.json
"""

from __future__ import annotations

import argparse
import heapq
import http.client
import itertools
import json
import secrets
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from torpor import outbound
from torpor.demo.scenario import DocPlan, Story, plan_documents
from torpor.webhooks.signing import Scheme, sign

HOLD_MAX_S = 90.0  # decisions are released when every document asked, or after this
QUIET_S = 8.0  # … and then the director takes a while: every session is asleep meanwhile


class Scheduler:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._counter = itertools.count()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def at(self, delay_s: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._counter), fn))
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(timeout)
                _, _, fn = heapq.heappop(self._heap)
            threading.Thread(target=fn, daemon=True).start()


class World:
    def __init__(self, config: dict[str, Any]) -> None:
        self.hook_url = config["torpor_url"].rstrip("/") + "/v1/hooks/" + config["source"]
        self.secret = config["secret"]
        self.plans: dict[str, DocPlan] = plan_documents(config["doc_ids"], seed=config["seed"])
        self.lock = threading.Lock()
        self.scheduler = Scheduler()
        self.requests: dict[str, dict[str, Any]] = {}  # idempotency key → request
        self.by_doc: dict[str, list[str]] = defaultdict(list)
        self.decisions: dict[str, dict[str, Any]] = {}  # idempotency key → decision
        self.versions: dict[str, str] = {}
        self.orders: dict[str, str] = {}  # idempotency key → PO number
        self.order_docs: Counter[str] = Counter()
        self.withdrawn: dict[str, str] = {}
        self.withdraw_docs: Counter[str] = Counter()
        self.responses: dict[str, Counter[int]] = defaultdict(Counter)
        self.followups: Counter[str] = Counter()  # second-stage and escalated requests
        self.reminders: Counter[str] = Counter()  # signed reminders torpor sent, per doc
        self.released = False
        self.first_request_at: float | None = None

    # -- incoming ----------------------------------------------------------------------

    def request(self, body: dict[str, Any]) -> None:
        key, doc = str(body["idempotency_key"]), str(body["doc_id"])
        approvers = body.get("approvers") or ["finance.director"]
        if int(body.get("stage") or 1) > 1 or approvers[0] != "finance.director":
            self._followup(doc, key, body)  # the CFO's: a second stage or an escalation
            return
        with self.lock:
            if key in self.requests:  # a redispatch after a crash: same key, same request
                return
            self.requests[key] = body
            self.by_doc[doc].append(key)
            if self.first_request_at is None:
                self.first_request_at = time.monotonic()
                # Not the scheduler: its queue length tells the demo what is still to come.
                timer = threading.Timer(HOLD_MAX_S, self._release_anyway)
                timer.daemon = True
                timer.start()
            everyone = not self.released and len(self.by_doc) == len(self.plans)
            already = self.released
        if everyone:
            timer = threading.Timer(QUIET_S, self._release_anyway)
            timer.daemon = True
            timer.start()
        elif already:
            self._answer(doc, key)

    def _followup(self, doc: str, key: str, body: dict[str, Any]) -> None:
        """The CFO answers at once what reaches them (a stage or an escalation)."""
        with self.lock:
            if key in self.requests:
                return
            self.requests[key] = body
            self.followups[doc] += 1
        plan = self.plans.get(doc)
        if plan is None or plan.story in (Story.TIMEOUT, Story.CANCEL):
            return
        if plan.story is Story.CAPABILITY:
            self.scheduler.at(0.5, lambda: self._capability(body))
            return
        status = "rejected" if plan.story is Story.REJECT else "approved"
        self.scheduler.at(0.5, lambda: self._send_decision(key, status))

    def _send_decision(self, key: str, status: str) -> None:
        body = self._decision_body(key, status)
        self._post("decision", body, self._headers(body))

    def reminder(self, body: dict[str, Any], signed: bool) -> None:
        data = body.get("data") or {}
        with self.lock:
            if signed and isinstance(data, dict):
                self.reminders[str(data.get("subject"))] += 1

    def _release_anyway(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            pending = [(d, k) for d, keys in self.by_doc.items() for k in keys]
        for doc, key in pending:
            self._answer(doc, key)

    def order(self, body: dict[str, Any]) -> dict[str, str]:
        key, doc = str(body["idempotency_key"]), str(body["doc_id"])
        with self.lock:
            if key not in self.orders:
                self.orders[key] = f"PO-{secrets.randbelow(900000) + 100000}"
                self.order_docs[doc] += 1
            return {"po_number": self.orders[key]}

    def withdraw(self, body: dict[str, Any]) -> None:
        key, doc = str(body["idempotency_key"]), str(body["doc_id"])
        with self.lock:
            if key not in self.withdrawn:
                self.withdrawn[key] = doc
                self.withdraw_docs[doc] += 1

    # -- answering -------------------------------------------------------------------

    def _answer(self, doc: str, key: str) -> None:
        plan = self.plans.get(doc)
        if plan is None or plan.story in (Story.TIMEOUT, Story.CANCEL, Story.ESCALATE):
            return  # nobody answers (escalated: the director is away)
        nth = self.by_doc[doc].index(key) + 1
        request = self.requests[key]
        if plan.story is Story.CAPABILITY:
            self.scheduler.at(plan.delay_s, lambda: self._capability(request))
        elif plan.story is Story.DRIFT and nth == 1:
            self.scheduler.at(plan.delay_s, lambda: self._drift_then_decide(plan, key))
        else:
            delay = plan.delay_s if nth == 1 else 1.0
            self.scheduler.at(delay, lambda: self._decide(plan, key, final=True))
            if plan.story is Story.DRIFT:
                # The first decision, re-sent after the re-plan: late and out of order.
                first = self.by_doc[doc][0]
                self.scheduler.at(delay + 1.5, lambda: self._send_stale(first))

    def _drift_then_decide(self, plan: DocPlan, key: str) -> None:
        with self.lock:
            self.versions[plan.doc_id] = "v2"  # the budget moved while the session slept
        self._decide(plan, key, final=False)

    def _decision_body(self, key: str, status: str, event_id: str | None = None) -> bytes:
        request = self.requests[key]
        approver = (request.get("approvers") or ["finance.director"])[0]
        decision = {"status": status, "approver": approver, "comment": "ok"}
        with self.lock:
            self.decisions[key] = decision
        return json.dumps(
            {
                "eventId": event_id or f"oa-{secrets.token_hex(8)}",
                "eventType": "oa.approval.decided",
                "correlationId": request["correlation_id"],
                "businessKey": request["doc_id"],
                "decision": decision,
            }
        ).encode()

    def _decide(self, plan: DocPlan, key: str, *, final: bool) -> None:
        status = "approved" if plan.story is not Story.REJECT else "rejected"
        if final and plan.forged:
            self._forge(key)
        body = self._decision_body(key, status)
        headers = self._headers(body)
        self._post("decision", body, headers)
        if not final:
            return
        if plan.replay:
            self.scheduler.at(0.8, lambda: self._post("replay", body, headers))
        if plan.duplicate:
            self.scheduler.at(1.2, lambda: self._post("duplicate", body, self._headers(body)))
        if plan.late:
            late = self._decision_body(key, status)
            self.scheduler.at(8.0, lambda: self._post("late", late, self._headers(late)))

    def _send_stale(self, first_key: str) -> None:
        body = self._decision_body(first_key, "rejected")
        self._post("stale", body, self._headers(body))

    def _forge(self, key: str) -> None:
        body = self._decision_body(key, "approved")
        forged = sign(Scheme.TORPOR, body, secrets.token_hex(32), now=datetime.now(UTC))
        self._post("forged", body, {**forged, "Content-Type": "application/json"})

    def _capability(self, request: dict[str, Any]) -> None:
        url = request.get("capability_url")
        if not url:
            return
        approver = (request.get("approvers") or ["finance.director"])[0]
        body = json.dumps({"status": "approved", "approver": approver}).encode()
        headers = {"Content-Type": "application/json"}
        self._post("capability", body, headers, url=url)
        # Someone who saw the link tries to change the answer with it: a used link takes no
        # other body (409). The very same body again would be the sender's own retry (200).
        reuse = json.dumps({"status": "rejected", "approver": "forwarded.mail"}).encode()
        self.scheduler.at(1.0, lambda: self._post("capability_reuse", reuse, headers, url=url))
        with self.lock:
            self.decisions[str(request["idempotency_key"])] = {"status": "approved"}

    def _headers(self, body: bytes) -> dict[str, str]:
        return {
            **sign(Scheme.TORPOR, body, self.secret, now=datetime.now(UTC)),
            "Content-Type": "application/json",
        }

    def _post(
        self, kind: str, body: bytes, headers: dict[str, str], *, url: str | None = None
    ) -> None:
        try:
            response = outbound.request(
                "POST", url or self.hook_url, body=body, headers=headers, timeout_s=30
            )
            status = response.status
        except (OSError, http.client.HTTPException):
            status = 0
        with self.lock:
            self.responses[kind][status] += 1

    # -- reporting -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "released": self.released,
                "requests": len(self.requests),
                "documents_asked": len(self.by_doc),
                "replans": sum(1 for keys in self.by_doc.values() if len(keys) > 1),
                "orders": dict(self.order_docs),
                "withdrawals": dict(self.withdraw_docs),
                "followups": dict(self.followups),
                "reminders": dict(self.reminders),
                "responses": {
                    k: {str(s): n for s, n in v.items()} for k, v in self.responses.items()
                },
                "scheduled": self.scheduler.pending(),
            }


def handler(world: World) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            parsed = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parsed.query))
            if parsed.path == "/erp/budget":
                with world.lock:
                    version = world.versions.get(query.get("doc", ""), "v1")
                self._json(200, {"version": version})
            elif parsed.path == "/oa/decision":
                with world.lock:
                    decision = world.decisions.get(query.get("key", ""))
                self._json(200 if decision else 404, decision)
            elif parsed.path == "/stats":
                self._json(200, world.stats())
            else:
                self._json(404, None)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path == "/oa/requests":
                world.request(body)
                self._json(200, {"accepted": True})
            elif self.path == "/oa/withdraw":
                world.withdraw(body)
                self._json(200, {"withdrawn": True})
            elif self.path == "/oa/reminders":
                world.reminder(body, signed=bool(self.headers.get("webhook-signature")))
                self._json(200, {"ok": True})
            elif self.path == "/erp/orders":
                self._json(200, world.order(body))
            else:
                self._json(404, None)

        def log_message(self, *args: object) -> None:
            return

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as fh:
        config = json.load(fh)
    world = World(config)
    server = ThreadingHTTPServer(("127.0.0.1", int(config["port"])), handler(world))
    server.serve_forever()


if __name__ == "__main__":
    main()
