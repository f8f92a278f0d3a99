"""One activation of one session, by phase, and the runtime that runs it under a lease.

``SessionRuntime.activate`` takes the session's lease, keeps it alive with a heartbeat,
loads the snapshot and drives one activation: wake (gates, guard, apply/observe), the
agent loop with its sync tool calls, then suspend or finish (bind, outbox drain). Every
change reaches storage through the working copy's compare-and-swap commit.
"""

from torpor.session.outcome import ActivationOutcome, ActivationResult
from torpor.session.runtime import SessionRuntime

__all__ = ["ActivationOutcome", "ActivationResult", "SessionRuntime"]
