"""What a call that hands a session to an actor (a dedicated session actor, a standby,
a pool host) may fail with and still be tried again, how often, and how long its answer
is waited for: shared by the dedicated path (``ray_activator``) and the pooled one
(``pool_hosts``)."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from torpor.backoff import Backoff

RETRYABLE = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)
MAX_ATTEMPTS = 40
# Ray needs a moment to settle a dying actor or a restarting host: retry soon, then less
# often. No jitter: one caller retries one actor, there is no fleet to spread out.
DEDICATED_BACKOFF = Backoff(base_s=0.02, cap_s=0.5, jitter=0)
POOLED_BACKOFF = Backoff(base_s=0.05, cap_s=1.0, jitter=0)
ACTIVATE_TIMEOUT_S = 20.0
