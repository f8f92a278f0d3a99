"""Leaving a batch session's running slot when its activation ends.

The activation request took the slot (``torpor.service.admission``); whatever the
activation did (suspended, finished, checkpointed for a retry) the session's process is
done with it now, so the slot goes back and the first sessions queued behind it get a
retry timer due now: the reconciler's next round asks for their activation. If this
process dies before leaving, the slot's lease expires by itself, and the session's own
recovery re-enters and leaves it.
"""

from __future__ import annotations

import logging

from torpor.errors import IndexUnavailable
from torpor.ids import in_batch
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.ports.services import Services

# Queued sessions woken per slot given back: one takes the slot; the second covers a head
# that is being activated already (it finds its slot held by itself and runs).
HEADS_WOKEN = 2
log = logging.getLogger(__name__)


async def leave_slot(deps: Services, session_id: str, state: SessionState | None) -> None:
    slots = deps.slots
    if slots is None or not in_batch(session_id):  # only a batch's sessions took one
        return
    try:
        forget = state is not None and state.terminal
        heads = await slots.leave(member=session_id, forget=forget, limit=HEADS_WOKEN)
        now = deps.clock.now()
        for head in heads:
            await deps.index.schedule(kind=TimerKind.RETRY, member=head, at=now, keep_earlier=True)
    except IndexUnavailable:
        # The slot expires on its own; queued sessions keep their safety-net retry timers.
        log.warning("could not give back the running slot of %s", session_id, exc_info=True)
