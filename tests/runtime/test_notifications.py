"""Outbound notifications: signed, retried on schedule, dead-lettered, resent."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import standardwebhooks

from storage import keys
from storage.codec import SnapshotCodec
from tests.conftest import eventually
from tests.support.harness import Env, local_env
from tests.support.hostile import Hanging
from tests.support.receiver import Received, Receiver
from torpor import outbound, ssrf
from torpor.deliveries import Delivery, DeliveryStatus
from torpor.errors import DeliveryNotResendable, UnsafeUrl
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, OutboxKind
from torpor.ports import Observer, Reason, TimerKind
from torpor.service.deliveries import DeliveryNotifier, DeliveryWorker, secret_for, tenant_view
from torpor.threads import ProcessPool


@pytest.fixture
def hook() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


async def finished_session(env: Env, url: str, doc: str = "PR-N") -> str:
    sid = await env.submit(doc=doc, callback_url=url)
    await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is SessionState.COMPLETED
    return sid


def verify_signed(env: Env, received: Received, url: str) -> dict[str, Any]:
    """Check the notification with the reference Standard Webhooks library."""
    secret = secret_for(env.services.settings, "acme", url)
    payload: dict[str, Any] = standardwebhooks.Webhook(secret).verify(
        received.body, received.headers
    )
    return payload


async def test_terminal_state_is_notified_signed(
    tmp_path: Path, redis_url: str, redis_prefix: str, hook: Receiver
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await finished_session(env, hook.url)
        worker = DeliveryWorker(env.services)
        assert await worker.due(env.clock.now()) == 1
        [got] = hook.received
        payload = verify_signed(env, got, hook.url)
        assert payload["type"] == "session.completed"
        assert payload["data"]["session_id"] == sid
        assert payload["data"]["result"] == {"decision": "approved", "doc": "PR-N"}
        assert await worker.due(env.clock.now()) == 0  # delivered: nothing more to do


async def test_failures_retry_on_schedule_honouring_retry_after(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    hook = Receiver(script=[500, 302, 503, 200])
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            await finished_session(env, hook.url)
            worker = DeliveryWorker(env.services)
            await worker.due(env.clock.now())  # 500
            assert await worker.due(env.clock.now()) == 0  # the next try is ~5 s away
            env.clock.advance(7)
            await worker.due(env.clock.now())  # 302: redirects are failures, not followed
            hook.retry_after = "7200"
            env.clock.advance(400)
            await worker.due(env.clock.now())  # 503 asking for 2 h, more than the 30 min step
            env.clock.advance(2200)
            assert await worker.due(env.clock.now()) == 0
            env.clock.advance(7200)
            await worker.due(env.clock.now())  # 200
            assert len(hook.received) == 4
            ids = {r.headers["webhook-id"] for r in hook.received}
            assert len(ids) == 1, "every attempt carries the same webhook-id"
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=10
            )
            assert delivery.status is DeliveryStatus.DELIVERED and delivery.attempts == 4
            assert [h["status"] for h in delivery.history] == [500, 302, 503, 200]
    finally:
        hook.close()


async def test_gone_disables_the_endpoint(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    hook = Receiver(script=[410])
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            await finished_session(env, hook.url)
            worker = DeliveryWorker(env.services)
            await worker.due(env.clock.now())
            store = env.services.deliveries
            assert (await store.endpoint("acme", hook.url)).disabled
            await finished_session(env, hook.url, doc="PR-N2")
            await worker.due(env.clock.now())
            assert len(hook.received) == 1, "a disabled endpoint is not called again"
            disabled, _ = await store.list(
                "acme", status=DeliveryStatus.DISABLED, cursor=None, limit=10
            )
            assert len(disabled) == 2
    finally:
        hook.close()


async def test_dead_letter_then_resend(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    hook = Receiver(script=[500])
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            await finished_session(env, hook.url)
            worker = DeliveryWorker(env.services)
            for _ in range(12):
                await worker.due(env.clock.now())
                env.clock.advance(13 * 3600)
            assert len(hook.received) == 8  # the first try and seven retries
            store = env.services.deliveries
            [dead], _ = await store.list("acme", status=DeliveryStatus.DEAD, cursor=None, limit=5)
            hook.script = [200]
            await worker.resend("acme", dead.delivery_id, now=env.clock.now())
            # Pending again: a second resend would give it a fresh set of attempts.
            with pytest.raises(DeliveryNotResendable):
                await worker.resend("acme", dead.delivery_id, now=env.clock.now())
            await worker.due(env.clock.now())
            assert (await store.get("acme", dead.delivery_id)).status is DeliveryStatus.DELIVERED
            # Delivered: a resend would send the notification twice.
            with pytest.raises(DeliveryNotResendable):
                await worker.resend("acme", dead.delivery_id, now=env.clock.now())
            assert len(hook.received) == 9
    finally:
        hook.close()


async def test_a_delivery_waiting_for_its_turn_is_not_posted_again_by_a_second_sweeper(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A worker took every due delivery timer at once (each leased for timeout_s +
    wake_grace_s, 45 s) but attempted only ``concurrency`` at a time. Behind slow
    receivers, one that waited for its turn outlived its lease while still to be posted:
    a second reconciler (``torpor reconcile``) took the timer and posted it, and so did
    the first once its turn came. Here one lane, four deliveries, each receiver taking
    14 s of its 15 s deadline: the fourth starts 42 s after the take."""
    hold = threading.Semaphore(0)
    hook = Receiver(hold=hold)
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            for n in range(4):
                await finished_session(env, hook.url, doc=f"PR-{n}")
            first, second = (
                DeliveryWorker(env.services, concurrency=1),
                DeliveryWorker(env.services, concurrency=1),
            )

            def posted(n: int) -> Callable[[], bool]:
                return lambda: len(hook.received) == n

            await first.start_due(env.clock.now())
            for n in range(1, 5):
                await eventually(posted(n), timeout_s=10)
                env.clock.advance(14)  # the receiver takes its time, within the deadline
                if n < 4:
                    hold.release()
            # 56 s after the first take, the fourth attempt still under way: a second
            # sweeper finds nothing of its to take.
            await second.start_due(env.clock.now())
            hold.release()
            await first.drain()
            await second.drain()
            posts = Counter(r.headers["webhook-id"] for r in hook.received)
            assert sorted(posts.values()) == [1, 1, 1, 1], posts
            delivered, _ = await env.services.deliveries.list(
                "acme", status=DeliveryStatus.DELIVERED, cursor=None, limit=10
            )
            assert [d.attempts for d in delivered] == [1, 1, 1, 1]
    finally:
        hold.release(10)
        hook.close()


async def test_a_free_lane_takes_the_next_due_delivery_as_its_attempt_ends(
    tmp_path: Path, redis_url: str, redis_prefix: str, hook: Receiver
) -> None:
    """Taking only what a lane can attempt now does not leave a backlog to later sweeps."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        for n in range(3):
            await finished_session(env, hook.url, doc=f"PR-{n}")
        assert await DeliveryWorker(env.services, concurrency=1).due(env.clock.now()) == 3
        assert len(hook.received) == 3


async def test_private_callback_urls_are_refused_unless_allowed(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    extra = {"notifications": {"allow_private_callbacks": False}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        for url in (
            "http://127.0.0.1:9/x",
            "http://169.254.169.254/latest",
            "http://10.0.0.1/",
            "http://[::1]/",
            "ftp://example.com/",
            "http://user:pw@example.com/",
        ):
            with pytest.raises(UnsafeUrl):
                await env.submit(doc="PR-X", callback_url=url)


@pytest.mark.parametrize("path", ["/a b", "/a\tb", "/a\x7fb", "/caf\u00e9", "/x?q=\u00e9"])
async def test_a_callback_url_no_request_can_carry_is_refused_at_submit(
    tmp_path: Path, redis_url: str, redis_prefix: str, hook: Receiver, path: str
) -> None:
    """http.client sends no request target holding a space, a control character or a
    non-ASCII one (and urlsplit drops a tab unseen, so the check passed it): accepted
    with a 202, such a URL failed every attempt for a day and ended a dead letter."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        with pytest.raises(UnsafeUrl):
            await env.submit(doc="PR-X", callback_url=hook.url + path)


async def test_suspend_and_resume_can_be_notified_too(
    tmp_path: Path, redis_url: str, redis_prefix: str, hook: Receiver
) -> None:
    extra = {"notifications": {"on": ["terminal", "suspended", "resumed"]}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        sid = await finished_session(env, hook.url)
        await DeliveryWorker(env.services).due(env.clock.now())
        types = sorted(json.loads(r.body)["type"] for r in hook.received)
        assert types == ["session.completed", "session.resumed", "session.suspended"]
        assert all(json.loads(r.body)["data"]["session_id"] == sid for r in hook.received)


class Settled(Observer):
    def __init__(self) -> None:
        self.statuses: list[DeliveryStatus] = []

    async def delivery_settled(self, delivery: Delivery) -> None:
        self.statuses.append(delivery.status)


async def test_each_attempt_is_reported_to_the_observer(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    hook = Receiver(script=[500, 200])
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            await finished_session(env, hook.url)
            observer = Settled()
            env.services.observer = observer
            worker = DeliveryWorker(env.services)
            await worker.due(env.clock.now())
            env.clock.advance(7)
            await worker.due(env.clock.now())
            assert observer.statuses == [DeliveryStatus.PENDING, DeliveryStatus.DELIVERED]
    finally:
        hook.close()


PUBLIC = "93.184.216.34"


class Rebinding:
    """A resolver for ``rebind.test``: ``public_answers`` public answers, then 127.0.0.1
    (a zero-TTL name that changes its answer between the check and the connection).
    Other names resolve for real."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.public_answers = 1

    def __call__(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "rebind.test":
            return self.real(host, port, *args, **kwargs)
        address = PUBLIC if self.public_answers > 0 else "127.0.0.1"
        self.public_answers -= 1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]


async def test_a_rebinding_name_never_reaches_the_address_it_switches_to(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = Receiver()  # on 127.0.0.1: what the name answers once it was vetted
    dialled: list[str] = []
    real_connect = socket.create_connection

    def connect(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        dialled.append(str(address[0]))
        if address[0] == PUBLIC:  # no real network in tests: that host refuses
            raise ConnectionRefusedError(f"{PUBLIC} refused")
        return real_connect(address, *args, **kwargs)

    resolver = Rebinding(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(socket, "create_connection", connect)
    url = hook.url.replace("127.0.0.1", "rebind.test")
    extra = {"notifications": {"allow_private_callbacks": False}}
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished_session(env, url)
            resolver.public_answers = 1  # the delivery's check sees the public address
            await DeliveryWorker(env.services).due(env.clock.now())
            assert hook.received == [], "the connection went to the re-resolved address"
            assert dialled == [PUBLIC]
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.PENDING
            assert delivery.last_category == "connection_refused"
    finally:
        hook.close()


async def test_a_transient_dns_failure_is_retried_on_schedule(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = Receiver()  # stands for the public host PUBLIC (the test has no network)
    real, real_connect = socket.getaddrinfo, socket.create_connection
    failing = [False]

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "flaky.test":
            return real(host, port, *args, **kwargs)
        if failing[0]:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC, int(port)))]

    def connect(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        host = "127.0.0.1" if address[0] in (PUBLIC, "flaky.test") else address[0]
        return real_connect((host, address[1]), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket, "create_connection", connect)
    url = hook.url.replace("127.0.0.1", "flaky.test")
    extra = {"notifications": {"allow_private_callbacks": False}}
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished_session(env, url)
            failing[0] = True  # the name resolved at submission, not at delivery
            worker = DeliveryWorker(env.services)
            await worker.due(env.clock.now())
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.PENDING, "not a dead letter"
            assert delivery.last_category == "dns" and delivery.next_attempt_at is not None
            failing[0] = False
            env.clock.advance((delivery.next_attempt_at - env.clock.now()).total_seconds())
            await worker.due(env.clock.now())
            delivered = await env.services.deliveries.get("acme", delivery.delivery_id)
            assert delivered.status is DeliveryStatus.DELIVERED and len(hook.received) == 1
    finally:
        hook.close()


async def test_a_private_address_at_delivery_is_a_dead_letter_at_once(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolver = Rebinding(socket.getaddrinfo)  # public at submission, private at delivery
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    extra = {"notifications": {"allow_private_callbacks": False}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        await finished_session(env, "http://rebind.test:9/hook")
        await DeliveryWorker(env.services).due(env.clock.now())
        [dead], _ = await env.services.deliveries.list(
            "acme", status=DeliveryStatus.DEAD, cursor=None, limit=5
        )
        assert dead.attempts == 1 and dead.last_category == "refused_by_policy"


_RANDOM_FIELDS = {
    "delivery_id",
    "session_id",
    "url",
    "created_at",
    "next_attempt_at",
    "delivered_at",
    "history",
}


async def test_tenants_see_a_category_operators_the_detail(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    hook = Receiver(script=[404])
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            await finished_session(env, hook.url)
            await DeliveryWorker(env.services).due(env.clock.now())
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.last_status == 404 and delivery.last_error == "http_4xx: HTTP 404"
            assert delivery.history[0]["error"] == "http_4xx: HTTP 404"
            view = tenant_view(delivery)
            assert view["last_category"] == "http_4xx"
            # Ids, times and the tenant's own URL are random enough to contain "404".
            said = {k: v for k, v in view.items() if k not in _RANDOM_FIELDS}
            assert "404" not in json.dumps(said), "no raw status or error text for tenants"
            assert not {"last_status", "last_error"} & view.keys()
            assert view["history"] == [{"at": delivery.history[0]["at"], "category": "http_4xx"}]
    finally:
        hook.close()


async def test_a_replayed_notice_or_an_early_timer_keeps_the_receivers_retry_after(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The receiver asked for an hour (503, Retry-After). An outbox replay of the NOTIFY
    entry (the commit after its enqueue failed) set the delivery's timer to now, and an
    attempt never looked at the delivery's own next attempt time: it was posted again at
    once, and the extra attempt counted towards the dead letter."""
    hook = Receiver(script=[503], retry_after="3600")
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            sid = await finished_session(env, hook.url)
            worker = DeliveryWorker(env.services)
            await worker.due(env.clock.now())  # 503: an hour, please
            assert len(hook.received) == 1
            snap = await env.load(sid)
            [entry] = [e for e in snap.outbox if e.kind is OutboxKind.NOTIFY]
            await DeliveryNotifier(env.services).enqueue(snap, entry)  # the replay
            env.clock.advance(1)
            await worker.due(env.clock.now())
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            member = f"acme|{delivery.delivery_id}"
            # A timer due early all the same (a second taker, a timer moved by hand).
            await env.services.index.schedule(
                kind=TimerKind.DELIVER, member=member, at=env.clock.now()
            )
            await worker.due(env.clock.now())
            assert len(hook.received) == 1 and delivery.attempts == 1
            assert delivery.next_attempt_at is not None
            later = delivery.next_attempt_at - timedelta(seconds=1)
            assert await env.services.index.due(kind=TimerKind.DELIVER, now=later, limit=5) == []
            due = delivery.next_attempt_at
            assert await env.services.index.due(kind=TimerKind.DELIVER, now=due, limit=5) == [
                member
            ]
    finally:
        hook.close()


async def test_a_retry_after_no_date_can_hold_is_ignored_not_an_endless_uncounted_retry(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A receiver answered 503 with a Retry-After date whose parsing overflows: the
    attempt raised after its POST, was never counted nor given its next time, and its
    leased timer brought it back every lease for ever (never a dead letter)."""
    hook = Receiver(script=[503], retry_after="Sun, 01 Mar 2026 11:00:00 +99999999999999999999")
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            await finished_session(env, hook.url)
            worker = DeliveryWorker(env.services)
            await worker.due(env.clock.now())
            assert len(hook.received) == 1
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.PENDING and delivery.attempts == 1
            assert delivery.last_category == "http_5xx"
            # The schedule's first step (5 s ±20 %), the unreadable header ignored.
            assert delivery.next_attempt_at is not None
            wait = (delivery.next_attempt_at - env.clock.now()).total_seconds()
            assert 3.9 <= wait <= 6.1, wait
    finally:
        hook.close()


async def test_a_session_whose_agent_is_gone_still_notifies_its_end(
    tmp_path: Path, redis_url: str, redis_prefix: str, hook: Receiver
) -> None:
    """A notice needs no tool: the session that FAILED for want of its agent told its
    submitter nothing (the notice stayed PENDING, no timer, every repair woke it again),
    and an operator's resend of a dead notice there was refused."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-G", callback_url=hook.url)
        async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": {}}) as gone:
            gone.clock.set(env.clock.now())
            await gone.control.activate(sid, reason=Reason.EVENT)
            snap = await env.load(sid)
            assert snap.state is SessionState.FAILED
            [notice] = [e for e in snap.outbox if e.kind is OutboxKind.NOTIFY]
            assert notice.status is DispatchStatus.DISPATCHED
            assert await DeliveryWorker(gone.services).due(gone.clock.now()) == 1
            [got] = hook.received
            assert verify_signed(env, got, hook.url)["type"] == "session.failed"
            # The same notice given up (a dead letter), resent by an operator there.
            dead = notice.model_copy(update={"status": DispatchStatus.DEAD})
            await env.services.store.put(
                keys.snapshot(sid),
                SnapshotCodec().encode(snap.model_copy(update={"outbox": [dead]})),
            )
            revived = await gone.control.resend_outbox(sid, notice.entry_id)
            assert revived.status is DispatchStatus.PENDING
            [sent] = (await env.load(sid)).outbox
            assert sent.status is DispatchStatus.DISPATCHED


async def test_an_attempt_ends_within_its_deadline_while_outbound_threads_are_busy(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every outbound thread busy (slow LLM calls) held an attempt past its deadline and
    its timer's lease, and it was posted once a thread came free: by then another process
    could have taken the timer and posted the same delivery."""
    hook = Receiver()
    monkeypatch.setattr(outbound, "OUTBOUND", ProcessPool(1, "test-outbound"))
    extra = {"notifications": {"timeout_s": 0.5}}
    release = threading.Event()
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished_session(env, hook.url)
            busy = asyncio.ensure_future(outbound.OUTBOUND.run(release.wait))
            asyncio.get_running_loop().call_later(5, release.set)  # a failing wait ends
            await DeliveryWorker(env.services).due(env.clock.now())
            assert not release.is_set(), "the attempt waited for the busy thread"
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.PENDING and delivery.attempts == 1
            assert delivery.last_category == "internal", "our capacity, not their endpoint"
            release.set()
            await busy
            await outbound.OUTBOUND.run(lambda: None)  # after the queued call, if any
            assert hook.received == [], "the attempt given up on was posted later"
    finally:
        release.set()
        hook.close()


async def test_a_notification_is_signed_after_its_host_resolved(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed with the time the attempt began, a notification whose resolution took long
    carried a timestamp that old to a receiver that refuses stale ones."""
    hook = Receiver()  # stands for the public host PUBLIC (the test has no network)
    real, real_connect = socket.getaddrinfo, socket.create_connection
    envs: list[Env] = []

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "slow.test":
            return real(host, port, *args, **kwargs)
        if envs:  # at delivery: the resolution takes (the manual clock's) four minutes
            envs[0].clock.advance(240)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC, int(port)))]

    def connect(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        host = "127.0.0.1" if address[0] == PUBLIC else address[0]
        return real_connect((host, address[1]), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket, "create_connection", connect)
    url = hook.url.replace("127.0.0.1", "slow.test")
    extra = {"notifications": {"allow_private_callbacks": False}}
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished_session(env, url)
            envs.append(env)
            await DeliveryWorker(env.services).due(env.clock.now())
            [received] = hook.received
            assert int(received.headers["webhook-timestamp"]) == int(env.clock.now().timestamp())
    finally:
        hook.close()


async def test_an_attempt_to_a_private_callback_is_cut_at_its_deadline_while_resolving(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With private callbacks allowed nothing is vetted, and the host was resolved inside
    the socket's connect: a resolver that did not answer held the attempt, and an
    outbound thread, past notifications.timeout_s."""
    hook = Receiver()
    resolver = Hanging()
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    extra = {"notifications": {"timeout_s": 0.5, "allow_private_callbacks": True}}
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished_session(env, hook.url.replace("127.0.0.1", "hang.test"))
            await DeliveryWorker(env.services).due(env.clock.now())
            assert not resolver.answered.is_set(), "the attempt waited for the resolver"
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.PENDING
            assert delivery.last_category == "timeout"
    finally:
        resolver.release.set()
        hook.close()


async def test_no_resolver_thread_free_is_our_failure_not_the_tenants_connection(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ResolversBusy is an OSError: an attempt that found every resolver thread busy
    was shown to its tenant as a failed connection to their endpoint."""
    hook = Receiver()
    monkeypatch.setattr(ssrf, "RESOLVERS", ProcessPool(1, "test-dns"))
    extra = {"notifications": {"timeout_s": 0.5}}
    release = threading.Event()
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished_session(env, hook.url)
            busy = asyncio.ensure_future(ssrf.RESOLVERS.run(release.wait))
            asyncio.get_running_loop().call_later(5, release.set)  # a failing wait ends
            await DeliveryWorker(env.services).due(env.clock.now())
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.PENDING and hook.received == []
            assert delivery.last_category == "internal"
            assert "ResolversBusy" in (delivery.last_error or "")
            release.set()
            await busy
    finally:
        release.set()
        hook.close()
