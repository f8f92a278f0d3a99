"""One error hierarchy for torpor: every error class it raises on purpose is here.

Every error has a stable ``code`` (used in logs, metrics and the problem+json ``type``),
the HTTP ``status`` and ``title`` the edge answers it with (500 "Internal error" unless a
class says otherwise), and a ``retryable`` flag: a retryable error means "the same call
may succeed later" (a store that is down), a permanent one "this input or this race is
final" (a corrupt snapshot, a lost compare-and-swap). ``retryable`` and ``retry_after``
are class defaults that one instance may override, as Temporal's ``ApplicationError``
does with ``non_retryable`` and ``next_retry_delay``. ``torpor.problems`` turns an error
into its HTTP answer by reading these attributes, and nothing else.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Final


class TorporError(Exception):
    """Root of every error torpor raises on purpose."""

    code: ClassVar[str] = "torpor_error"
    status: int = 500
    title: str = "Internal error"
    # The message is phrased for the caller and reveals nothing internal: it becomes the
    # problem's ``detail``. Otherwise the detail stays empty.
    public: ClassVar[bool] = False
    retryable: bool = False
    retry_after: float | None = None  # seconds the caller should wait before trying again

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        retry_after: float | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.context = context
        if retryable is not None:
            self.retryable = retryable
        if retry_after is not None:
            self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message

    @property
    def problem_type(self) -> str:
        """The last segment of the problem+json ``type``."""
        return self.code

    @property
    def problem_detail(self) -> str | None:
        return self.message if self.public else None


class RetryableError(TorporError):
    """The operation may succeed if tried again later."""

    code = "retryable"
    retryable = True


class PermanentError(TorporError):
    """Trying again with the same input will fail the same way."""

    code = "permanent"


# --- configuration -------------------------------------------------------------------


class ConfigError(PermanentError):
    code = "config_invalid"


class ConditionalWritesIgnored(ConfigError):
    """The object store ignores ``If-None-Match``/``If-Match``: create-only and
    compare-and-swap would silently overwrite, so torpor refuses to write to it."""

    code = "conditional_writes_ignored"
    status, title = 503, "Object store unsafe"


class EmbeddedBackendOnCluster(ConfigError):
    """The local-folder store or SQLite index was chosen on a multi-node Ray cluster."""

    code = "embedded_backend_on_cluster"


class PluginNotFound(ConfigError):
    """An agent or tool import path from configuration does not resolve."""

    code = "plugin_not_found"


# --- storage -------------------------------------------------------------------------


class StorageUnavailable(RetryableError):
    """The object store or index did not answer (network, server down, throttled)."""

    code = "storage_unavailable"
    status, title = 503, "Storage unavailable"


class IndexUnavailable(StorageUnavailable):
    code = "index_unavailable"
    title = "Index unavailable"


class StorageRefused(PermanentError):
    """The object store refused a request for good (too large, a key it cannot hold, an
    argument it does not take): sent again, it is refused again."""

    code = "storage_refused"


class BucketNotFound(PermanentError):
    code = "bucket_not_found"


class InvalidKey(PermanentError):
    code = "invalid_object_key"
    status, title = 400, "Invalid identifier"


class ObjectNotFound(PermanentError):
    code = "object_not_found"


class PreconditionFailed(PermanentError):
    """A conditional write lost: the object exists (create-only) or changed (CAS)."""

    code = "precondition_failed"


class ObjectExists(PreconditionFailed):
    code = "object_exists"


class EtagMismatch(PreconditionFailed):
    code = "etag_mismatch"


class SnapshotError(PermanentError):
    code = "snapshot_error"


class SnapshotCorrupt(SnapshotError):
    code = "snapshot_corrupt"


class SnapshotSchemaTooNew(SnapshotError):
    """A newer torpor wrote the snapshot (a rolling upgrade under way). Final for this
    node, not for the caller: a retry may reach a newer one, so the edge answers 503."""

    code = "snapshot_schema_too_new"
    status, title = 503, "Session held by a newer version"
    retry_after = 30.0


class NotFound(PermanentError):
    """Something that is not a session (a batch, a delivery) does not exist, or belongs
    to another tenant: the caller cannot tell which."""

    code = "not_found"
    status, title, public = 404, "Not found", True


class SessionNotFound(NotFound):
    """No such session, or another tenant's."""

    code = "session_not_found"


class CommitConflict(PermanentError):
    """Another writer committed this session first; this writer must stop and reload."""

    code = "commit_conflict"
    status, title = 409, "Conflict"


class LeaseLost(PermanentError):
    code = "lease_lost"


class SessionBusy(RetryableError):
    """An activation holds the session's lease; an operator action must wait for it."""

    code = "session_busy"
    status, title = 409, "Session busy"


# --- lifecycle -----------------------------------------------------------------------


class LifecycleError(PermanentError):
    code = "lifecycle_error"


class IllegalTransition(LifecycleError):
    code = "illegal_transition"


class TerminalStateImmutable(LifecycleError):
    code = "terminal_state_immutable"


# --- runtime -------------------------------------------------------------------------


class ToolError(TorporError):
    """A tool failed. ``retryable`` is decided per instance by the tool (default: no)."""

    code = "tool_error"


class DispatchImpossible(PermanentError):
    """An outbox entry names no long-running tool that could send it."""

    code = "dispatch_impossible"


class AgentError(PermanentError):
    code = "agent_error"


class InvalidRequest(PermanentError):
    code = "invalid_request"
    status, title, public = 400, "Invalid request", True


class AgentUnavailable(RetryableError):
    """The agent's backend (e.g. an LLM endpoint) failed in a way worth retrying."""

    code = "agent_unavailable"


class ResolversBusy(RetryableError, OSError):
    """Every thread that resolves callback hosts is busy (slow resolvers): not the URL's
    fault, so answered 503 at submit, and a delivery attempt is retried."""

    code = "resolvers_busy"
    status, title = 503, "Name resolution busy"


class OutboundBusy(RetryableError, TimeoutError):
    """No outbound thread took a call within its deadline (every one busy with slow
    calls): the call was never made. A ``TimeoutError``, as a call cut at its deadline
    is, for callers that retry those."""

    code = "outbound_busy"
    status, title = 503, "Outbound calls busy"


class WorkStopFailed(RetryableError):
    """A work's stop did not reach it (a job's stop failed, its dashboard did not
    answer) and nothing says it ended: it may still run, so the stop is asked again."""

    code = "work_stop_failed"
    status, title = 503, "Work stop failed"


class WorkStartUnanswered(RetryableError, TimeoutError):
    """A work's watcher did not answer the request to start it within its deadline. The
    order is recorded and the start may still land: asked again, the watcher found by
    its name starts nothing twice (one run per watcher, each run claimed create-only).
    A ``TimeoutError``, as a call cut at its deadline is, for callers that retry those."""

    code = "work_start_unanswered"
    status, title = 503, "Work start unanswered"


class WorkStartFailed(RetryableError):
    """Every watcher asked to start a work was going (exiting, or its actor dead) when
    asked, ``MAX_ATTEMPTS`` times in a row. The order is recorded: a later try starts it."""

    code = "work_start_failed"
    status, title = 503, "Work start failed"


class ActivationUnavailable(RetryableError):
    """No activator took the request (its actor or host did not answer in time)."""

    code = "activation_unavailable"
    status, title = 503, "Activation unavailable"


class ClusterUnavailable(RetryableError, TimeoutError):
    """The cluster's control plane (Ray's GCS) did not answer a lookup of named actors
    within its deadline: that one operation fails, and is asked again later. A
    ``TimeoutError``, as Ray's own ``GetTimeoutError`` for the same lookup is, for the
    callers that already read that one as "not known gone"."""

    code = "cluster_unavailable"
    status, title = 503, "Cluster unavailable"


# --- webhooks ------------------------------------------------------------------------


class RejectReason(StrEnum):
    MISSING_SIGNATURE = "missing_signature"
    MALFORMED_SIGNATURE = "malformed_signature"
    BAD_SIGNATURE = "bad_signature"
    MISSING_TIMESTAMP = "missing_timestamp"
    MALFORMED_TIMESTAMP = "malformed_timestamp"
    TIMESTAMP_TOO_OLD = "timestamp_too_old"
    TIMESTAMP_IN_FUTURE = "timestamp_in_future"
    MISSING_NONCE = "missing_nonce"
    MALFORMED_NONCE = "malformed_nonce"
    REPLAYED = "replayed"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    MALFORMED_BODY = "malformed_body"
    INVALID_CLOUDEVENT = "invalid_cloudevent"
    UNKNOWN_SOURCE = "unknown_source"
    # S105: these are reason names, not credentials.
    INVALID_TOKEN = "invalid_token"  # noqa: S105
    TOKEN_EXPIRED = "token_expired"  # noqa: S105
    TOKEN_USED = "token_used"  # noqa: S105


_R = RejectReason

# The only place a rejection reason becomes an HTTP status. Authentication problems are all 401
# so that a prober learns nothing from the status beyond "not authenticated".
REJECTION_STATUS: Final[dict[RejectReason, int]] = {
    _R.MISSING_SIGNATURE: 401,
    _R.MALFORMED_SIGNATURE: 401,
    _R.BAD_SIGNATURE: 401,
    _R.MISSING_TIMESTAMP: 401,
    _R.MALFORMED_TIMESTAMP: 401,
    _R.TIMESTAMP_TOO_OLD: 401,
    _R.TIMESTAMP_IN_FUTURE: 401,
    _R.MISSING_NONCE: 401,
    _R.MALFORMED_NONCE: 401,
    _R.INVALID_TOKEN: 401,
    _R.REPLAYED: 409,
    _R.TOKEN_USED: 409,
    _R.BODY_TOO_LARGE: 413,
    _R.UNSUPPORTED_MEDIA_TYPE: 415,
    _R.MALFORMED_BODY: 400,
    _R.INVALID_CLOUDEVENT: 400,
    _R.UNKNOWN_SOURCE: 404,
    _R.TOKEN_EXPIRED: 410,
}

# Fixed texts: none of them depends on which secret was tried or on the expected value,
# and "wrong secret" and "tampered body" read the same (both are BAD_SIGNATURE).
_DEFAULT_DETAIL: Final[dict[RejectReason, str]] = {
    _R.MISSING_SIGNATURE: "the signature header is missing",
    _R.MALFORMED_SIGNATURE: "the signature header is malformed",
    _R.BAD_SIGNATURE: "no signature matches",
    _R.MISSING_TIMESTAMP: "the timestamp header is missing",
    _R.MALFORMED_TIMESTAMP: "the timestamp header is malformed",
    _R.TIMESTAMP_TOO_OLD: "the timestamp is outside the accepted window",
    _R.TIMESTAMP_IN_FUTURE: "the timestamp is outside the accepted window",
    _R.MISSING_NONCE: "the delivery id header is missing",
    _R.MALFORMED_NONCE: "the delivery id header is malformed",
    _R.REPLAYED: "this delivery was already received",
    _R.BODY_TOO_LARGE: "the request body is too large",
    _R.UNSUPPORTED_MEDIA_TYPE: "the content type is not supported",
    _R.MALFORMED_BODY: "the request body is malformed",
    _R.INVALID_CLOUDEVENT: "the request is not a valid CloudEvent",
    _R.UNKNOWN_SOURCE: "unknown webhook source",
    _R.INVALID_TOKEN: "the callback token is invalid",
    _R.TOKEN_EXPIRED: "the callback token has expired",
    _R.TOKEN_USED: "the callback token was already used",
}


class WebhookRejected(PermanentError):
    """An inbound webhook, CloudEvent or callback token was refused.

    Every malformed header, body or token at the webhook trust boundary becomes one of
    these; nothing else escapes. The reason decides the status (``REJECTION_STATUS``) and
    a fixed public detail that is safe to send back to whoever made the request, who may
    be an attacker probing for an oracle; ``context`` is for the audit log and must never
    hold secrets either.
    """

    code = "webhook_rejected"

    def __init__(
        self, reason: RejectReason, public_detail: str | None = None, **context: Any
    ) -> None:
        self.reason = RejectReason(reason)
        self.status = REJECTION_STATUS[self.reason]
        self.title = self.reason.value.replace("_", " ").capitalize()
        self.public_detail: str = public_detail or _DEFAULT_DETAIL[self.reason]
        super().__init__(f"{self.reason}: {self.public_detail}", **context)

    @property
    def problem_type(self) -> str:
        return self.reason.value

    @property
    def problem_detail(self) -> str | None:
        return self.public_detail

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling calls cls(*self.args) with the message string; rejections
        # cross Ray process boundaries, so rebuild from the reason instead.
        return (_rebuild, (self.reason, self.public_detail, self.context))

    def __repr__(self) -> str:
        return f"WebhookRejected({self.reason.value!r}, {self.public_detail!r})"


def _rebuild(reason: RejectReason, public_detail: str, context: dict[str, Any]) -> WebhookRejected:
    return WebhookRejected(reason, public_detail, **context)


class WebhookSecretInvalid(ConfigError):
    """A configured webhook secret or capability key is empty, too short or not decodable.

    The message names the secret's position in the configured list, never its value.
    Inline secrets are refused when the settings load; an ``env:`` one can only be
    checked where it is resolved, and a delivery meeting it is answered 503: the sender
    retries, and its delivery is taken once the operator fixes the variable.
    """

    code = "webhook_secret_invalid"
    status, title = 503, "Webhook source misconfigured"


# --- client requests -----------------------------------------------------------------


class Unauthenticated(PermanentError):
    code = "unauthenticated"
    status, title, public = 401, "Unauthenticated", True


class IdempotencyMismatch(PermanentError):
    """The Idempotency-Key was used before with a different request body."""

    code = "idempotency_key_reused"
    status, title = 422, "Idempotency-Key reused with a different request"
    public = True


class IdempotencyInProgress(RetryableError):
    """The first request with this Idempotency-Key is still being processed."""

    code = "idempotency_key_in_progress"
    status, title = 409, "Request with this Idempotency-Key in progress"
    public = True


class ReassignmentRefused(PermanentError):
    """An operator's reassignment the wait's tool refuses (people without authority for
    the amount, or a wait that is no approval): nothing was delivered to the session."""

    code = "reassignment_refused"
    status, title, public = 422, "Reassignment refused", True


class UnknownAgent(PermanentError):
    code = "unknown_agent"
    status, title, public = 422, "Unknown agent", True


class UnsafeUrl(InvalidRequest):
    """An outbound URL torpor will not call (a private address, another scheme)."""

    code = "unsafe_callback_url"
    title = "Callback URL refused"


# --- calls out -----------------------------------------------------------------------


class ResponseTooLarge(PermanentError):
    """An HTTP answer longer than the caller's cap: refused rather than buffered."""

    code = "response_too_large"


class UnknownCorrelation(PermanentError):
    """A webhook event matches no open wait of the source's tenant."""

    code = "unknown_correlation"
    status, title, public = 404, "No matching wait", True


# --- deadlines and bad input ----------------------------------------------------------


class CallTimedOut(RetryableError):
    """A call out (a tool, the agent, a dispatch) did not finish before its deadline.

    Its outcome is unknown: it may have happened on the far side. It is retried under the
    same idempotency key, never run twice at once."""

    code = "call_timed_out"


class GuardUnavailable(RetryableError):
    """The external state the guard needs could not be read (an error or a timeout)."""

    code = "guard_unavailable"


class ActionKeyIncomplete(PermanentError):
    """A wait's action key was built from missing values (``None``, ``null``, empty)."""

    code = "action_key_incomplete"


class UnhandledToolError(AgentError):
    """A tool call failed and the plan has no branch for it: the session fails with the
    cause rather than run the next step on missing values."""

    code = "unhandled_tool_error"


class PlanPathMissing(AgentError):
    """A plan's ``${path}`` names nothing in the session (a field a result lacks, a typo):
    the session fails naming it rather than send the call, or finish, with a null."""

    code = "plan_path_missing"


class SourceNotAllowed(PermanentError):
    """A signed webhook from a source the wait does not name as one that may answer it:
    recorded, never applied (the wait's ``allowed_sources``, declared by its tool or its
    agent's ``answer_sources``)."""

    code = "source_not_allowed"
    status, title, public = 403, "Source not allowed", True


class AmbiguousEvent(PermanentError):
    """A webhook event addressed only by business key that could answer a request the
    session has since re-planned: it is recorded, never applied, and the sender is asked
    to echo the correlation id (or the epoch, or the request's idempotency key)."""

    code = "ambiguous_event"
    status, title, public = 409, "Ambiguous event", True


class BusinessKeyInUse(PermanentError):
    """A long-running tool asked to wait on a business key that another session's open
    wait in the same tenant already holds: the call fails (the agent sees a tool error)
    and the session does not suspend on it, so a business-key-only webhook can never be
    routed to the wrong session."""

    code = "business_key_in_use"
    status, title, public = 409, "Business key in use", True


class BatchNotFinished(PermanentError):
    """The batch's results are asked for while some of its documents are still running."""

    code = "batch_not_finished"
    status, title, public = 409, "Batch not finished", True


class BatchCancelled(PermanentError):
    """A cancelled batch takes no retry."""

    code = "batch_cancelled"
    status, title, public = 409, "Batch cancelled", True


class DeliveryNotResendable(PermanentError):
    """A resend of a delivery that is neither dead nor disabled: a delivered one would be
    sent twice, a pending one would get a fresh set of attempts for ever."""

    code = "delivery_not_resendable"
    status, title, public = 409, "Delivery not dead or disabled", True


class OutboxEntryNotSendable(PermanentError):
    """A resend of a dead undo this cluster cannot send: the long-running tool that
    undoes (its session's agent's) is not configured here. Revived, it would sit PENDING
    for ever, gone from the dead letters without a word."""

    code = "outbox_entry_not_sendable"
    status, title, public = 409, "Outbox entry cannot be sent here", True


class BatchExpired(PermanentError):
    """A batch older than the retention period (``storage.retention_s``) takes no retry:
    its sessions may be gone, and retention may be deleting the batch itself."""

    code = "batch_expired"
    status, title, public = 409, "Batch past its retention period", True
