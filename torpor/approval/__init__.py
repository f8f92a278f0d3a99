"""Human approval as a built-in long-running tool (``ApprovalTool``): who may approve
(``AuthorityPolicy``), how many must (``Quorum``), reminders, escalation and reassignment."""

from torpor.approval.policy import AuthorityPolicy, Delegation, Mode, Quorum, Tier
from torpor.approval.tool import ApprovalTool, Stage

__all__ = ["ApprovalTool", "AuthorityPolicy", "Delegation", "Mode", "Quorum", "Stage", "Tier"]
