"""Which long-running tools take an operator's reassignment at the API
(``LongRunningTool.reassignment_refused``): a tool that reviews its events decides in the
session, one that does not refuses at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from torpor.events import InboxEvent
from torpor.models import Wait
from torpor.tools import LongRunningTool, Review, ReviewAction

NOW = datetime(2026, 1, 1, tzinfo=UTC)
WAIT = Wait(
    wait_id="w1",
    correlation_id="c" * 32,
    waiting_step_id="1",
    epoch=1,
    action_key="sign:s1:call_1",
    tool_name="sign",
    tool_call_id="call_1",
    opened_at=NOW,
    deadline=NOW + timedelta(hours=1),
    expected_duration_s=60,
)


class Plain(LongRunningTool):
    """Answered by whatever comes: no review."""


class Reviewing(LongRunningTool):
    """A plugin's tool that handles operator instructions in its own ``review`` (as the
    approval tool does) but predates ``reassignment_refused``."""

    def review(self, wait: Wait, event: InboxEvent, *, now: datetime) -> Review | None:
        return Review(ReviewAction.OBSERVE)


def test_a_tool_that_reviews_nothing_refuses_a_reassignment() -> None:
    assert Plain().reassignment_refused(WAIT, ["bob"])


def test_a_reviewing_tool_is_left_to_decide_in_the_session() -> None:
    """Refused at the API by the default, a reviewing tool's every reassignment was a 422
    its own ``review`` (the one that reads operator events) never saw."""
    assert Reviewing().reassignment_refused(WAIT, ["bob"]) is None
