"""How a long-running tool's far side is told to answer.

Every dispatched request carries the wait's correlation id. With capability keys
configured it also carries a capability URL: ``{public_url}/v1/callbacks/{token}``, where
the token is signed, names its session, wait and epoch, expires with the wait, and works
once. That lets a third party with no shared secret (an OA mailbox, a vendor portal)
complete exactly this wait and nothing else.
"""

from __future__ import annotations

from torpor.models import SessionSnapshot, Wait
from torpor.tools import CallbackRoute
from torpor.webhooks.capability import mint


class CapabilityRouter:
    def __init__(self, *, keys: list[bytes], public_url: str) -> None:
        if not keys:
            raise ValueError("a capability router needs at least one key")
        self._key = keys[0]
        self._base = public_url.rstrip("/")

    def route(self, snapshot: SessionSnapshot, wait: Wait) -> CallbackRoute:
        token = mint(
            key=self._key,
            tenant=snapshot.tenant,
            session_id=snapshot.session_id,
            wait_id=wait.wait_id,
            correlation_id=wait.correlation_id,
            epoch=wait.epoch,
            expires_at=wait.deadline,
        )
        return CallbackRoute(wait.correlation_id, token, f"{self._base}/v1/callbacks/{token}")
