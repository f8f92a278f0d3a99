"""One error hierarchy for torpor.

Every error has a stable ``code`` (used in logs, metrics and problem+json ``type``) and a
``retryable`` flag: a retryable error means "the same call may succeed later" (a store
that is down), a permanent one means "this input or this race is final" (a corrupt
snapshot, a lost compare-and-swap). Mapping to HTTP happens in exactly one place, the
ingress' exception handler.
"""

from __future__ import annotations

from typing import Any, ClassVar


class TorporError(Exception):
    """Root of every error torpor raises on purpose."""

    code: ClassVar[str] = "torpor_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context

    def __str__(self) -> str:
        return self.message


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


class IndexUnavailable(StorageUnavailable):
    code = "index_unavailable"


class BucketNotFound(PermanentError):
    code = "bucket_not_found"


class InvalidKey(PermanentError):
    code = "invalid_object_key"


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
    code = "snapshot_schema_too_new"


class SnapshotNotFound(SnapshotError):
    code = "session_not_found"


class CommitConflict(PermanentError):
    """Another writer committed this session first; this writer must stop and reload."""

    code = "commit_conflict"


class LeaseLost(PermanentError):
    code = "lease_lost"


# --- lifecycle -----------------------------------------------------------------------


class LifecycleError(PermanentError):
    code = "lifecycle_error"


class IllegalTransition(LifecycleError):
    code = "illegal_transition"


class TerminalStateImmutable(LifecycleError):
    code = "terminal_state_immutable"


# --- runtime -------------------------------------------------------------------------


class ToolError(TorporError):
    """A tool failed. ``retryable`` is decided per instance by the tool."""

    code = "tool_error"

    def __init__(self, message: str, *, retryable: bool = False, **context: Any) -> None:
        super().__init__(message, **context)
        self.retryable_instance = retryable


class UnknownTool(PermanentError):
    code = "unknown_tool"


class AgentError(PermanentError):
    code = "agent_error"


class SessionBusy(RetryableError):
    """Another activation holds this session's lease."""

    code = "session_busy"


class InvalidRequest(PermanentError):
    code = "invalid_request"


class AgentUnavailable(RetryableError):
    """The agent's backend (e.g. an LLM endpoint) failed in a way worth retrying."""

    code = "agent_unavailable"


# --- webhooks ------------------------------------------------------------------------
# ``WebhookRejected`` (an attacker-facing PermanentError) lives in torpor.webhooks.rejections.


class WebhookSecretInvalid(ConfigError):
    """A configured webhook secret or capability key is empty, too short or not decodable.

    The message names the secret's position in the configured list, never its value.
    """

    code = "webhook_secret_invalid"


# --- client requests -----------------------------------------------------------------


class IdempotencyMismatch(PermanentError):
    """The Idempotency-Key was used before with a different request body."""

    code = "idempotency_key_reused"


class IdempotencyInProgress(RetryableError):
    """The first request with this Idempotency-Key is still being processed."""

    code = "idempotency_key_in_progress"


class UnknownAgent(PermanentError):
    code = "unknown_agent"


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
