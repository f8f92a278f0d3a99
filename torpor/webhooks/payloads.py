"""The normalised inbound event, and plain JSON payloads mapped onto it.

Senders that do not speak CloudEvents post their own JSON; a per-source ``PayloadMapping``
says where the event id, type, correlation id and so on live in it. The JSON reading here
is shared with ``torpor.webhooks.cloudevents`` and is strict on purpose: duplicate keys,
NaN and absurd nesting are refused rather than interpreted.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from torpor.errors import RejectReason, WebhookRejected

_MAX_JSON_DEPTH: Final = 64
# Ids and attributes end up in storage keys and logs; nothing legitimate is this long.
MAX_TEXT_CHARS: Final = 2048
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
# Where a lone surrogate can come from in text that decoded as strict UTF-8: a ``\u``
# escape of one. Any ``\ud`` is looked at, wider than the surrogates' ``\ud800``-``\udfff``:
# a scanner that read other digits than ASCII's would find no way past (an escaped
# backslash before "ud800" matches too: the walk then says no).
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD]")
_RFC3339: Final = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]{1,18}))?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


class InboundEvent(BaseModel):
    """One event, whatever shape it arrived in; ``source`` + ``event_id`` is unique."""

    model_config = ConfigDict(frozen=True)

    event_id: str
    source: str
    type: str
    subject: str | None = None
    time: datetime | None = None
    correlation_id: str | None = None
    business_key: str | None = None
    status: str | None = None
    # The epoch of the request this event answers, when the sender echoes it (directly or
    # as the last part of the request's idempotency key ``tenant:action_key:epoch``).
    epoch: int | None = None
    # Non-JSON, non-text payloads are carried as base64 text; datacontenttype says so.
    data: JsonValue = None
    datacontenttype: str | None = None
    dataschema: str | None = None
    extensions: dict[str, str] = Field(default_factory=dict)
    received_at: datetime | None = None


class PayloadMapping(BaseModel):
    """How a source's plain JSON payload maps onto an ``InboundEvent``.

    Paths are dotted (``order.approval.id``); a segment of digits indexes a list. Keys that
    themselves contain dots cannot be addressed. Without ``event_id_path`` the event id is
    the SHA-256 of the body, so identical redeliveries deduplicate.

    ``epoch_path`` or ``idempotency_key_path`` name where the sender echoes which request
    it answers (the epoch, or the idempotency key ``tenant:action_key:epoch`` it was sent
    with): an answer to a request that was since re-planned is then recognised as stale.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id_path: str | None = None
    type_path: str | None = None
    default_type: str | None = None
    subject_path: str | None = None
    time_path: str | None = None
    correlation_id_path: str | None = None
    business_key_path: str | None = None
    epoch_path: str | None = None
    idempotency_key_path: str | None = None
    status_path: str | None = None
    data_path: str | None = None

    @field_validator(
        "event_id_path",
        "type_path",
        "subject_path",
        "time_path",
        "correlation_id_path",
        "business_key_path",
        "epoch_path",
        "idempotency_key_path",
        "status_path",
        "data_path",
    )
    @classmethod
    def _dotted(cls, value: str | None) -> str | None:
        if value is not None and not all(value.split(".")):
            raise ValueError("a path is dot-separated non-empty segments")
        return value

    @model_validator(mode="after")
    def _has_type(self) -> PayloadMapping:
        if self.type_path is None and not self.default_type:
            raise ValueError("give type_path or default_type")
        return self


def malformed(detail: str | None = None) -> WebhookRejected:
    """A ``malformed_body`` rejection (to raise) with an optional safe detail."""
    return WebhookRejected(RejectReason.MALFORMED_BODY, detail)


class DuplicateName(ValueError):
    """A JSON object names a member twice; the name (JSON-quoted, cut at 40) is ``str``."""


def unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` that refuses a name twice in one object: two
    parsers disagreeing on which duplicate wins is a classic smuggling vector (the
    webhooks' bodies, and the API's, which Pydantic parses taking the last)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise DuplicateName(json.dumps(name[:40]))
            seen.add(name)
    return found


def _reject_constant(_: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


class _OutOfRange(ValueError):
    """A number past a 64-bit float's range (``1e400`` parses as infinity)."""


def _finite(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise _OutOfRange(literal[:40])
    return number


def _has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def _tree_problem(value: Any) -> str | None:
    """Why a parsed document is refused (too deep, a lone surrogate), or None."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            # ``"\ud800"`` is valid JSON but no Unicode text: it would pass here and fail
            # later when hashed or stored, after the replay claim. Refuse it up front.
            if _has_surrogate(item):
                return "the JSON document holds a lone UTF-16 surrogate"
        elif isinstance(item, float) and not math.isfinite(item):
            # 1e400 parses as infinity (the literals are refused by ``parse_constant``)
            # and would be stored as null: not what the sender signed.
            return "the JSON document holds a number out of range"
        elif isinstance(item, dict | list):
            if depth > _MAX_JSON_DEPTH:
                return "the JSON document is nested too deeply"
            if isinstance(item, dict):
                stack.extend((key, depth) for key in item)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


def loads_json(raw: bytes) -> Any:
    """Strict UTF-8 JSON: any problem is a ``malformed_body`` rejection.

    A number out of range is refused as it is parsed. The walk of the parsed tree for
    the rest (``_tree_problem``: some 300 interpreted instructions a webhook) is made
    only for text that could hold a problem: more opening brackets than the depth
    allowed (each level of nesting takes one, so fewer cannot nest too deep), or a
    ``\\u`` escape of a surrogate (strict UTF-8 decoding refuses every other way in)."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(
            text,
            object_pairs_hook=unique_names,
            parse_constant=_reject_constant,
            parse_float=_finite,
        )
    except _OutOfRange:
        raise malformed("the JSON document holds a number out of range") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise malformed() from None
    if (
        text.count("{") + text.count("[") > _MAX_JSON_DEPTH
        or _SURROGATE_ESCAPE.search(text) is not None
    ):
        why = _tree_problem(value)
        if why is not None:
            raise malformed(why)
    return value


def loads_object(raw: bytes) -> dict[str, Any]:
    value = loads_json(raw)
    if not isinstance(value, dict):
        raise malformed("the JSON body must be an object")
    return value


def parse_rfc3339(value: str) -> datetime | None:
    """An aware datetime for an RFC 3339 timestamp, None for anything else."""
    match = _RFC3339.fullmatch(value)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, offset = match.groups()
    leap = second == "60"
    try:
        if offset in ("Z", "z"):
            tz = UTC
        else:
            sign = -1 if offset[0] == "-" else 1
            delta = timedelta(hours=int(offset[1:3]), minutes=int(offset[4:6]))
            tz = timezone(sign * delta)
        parsed = datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            59 if leap else int(second),
            int((fraction or "0")[:6].ljust(6, "0")),
            tzinfo=tz,
        )
        # A leap second (23:59:60) is legal RFC 3339; datetime cannot hold it.
        return parsed + timedelta(seconds=1) if leap else parsed
    except (ValueError, OverflowError):
        return None


def text_value(value: Any) -> str | None:
    """A str or int (not bool) as text, else None: for ids read out of payloads."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def bounded_text(value: Any, field: str) -> str | None:
    """``text_value``, refused (``malformed_body``) past ``MAX_TEXT_CHARS``: an id read out
    of a payload goes on into index lookups, the inbox event and the audit record."""
    text = text_value(value)
    if text is not None and len(text) > MAX_TEXT_CHARS:
        raise malformed(f"the payload's {field} is too long")
    return text


_MISSING: Final = object()


def _lookup(document: Any, path: str) -> Any:
    current = document
    for segment in path.split("."):
        if isinstance(current, dict) and segment in current:
            current = current[segment]
        elif isinstance(current, list) and segment.isascii() and segment.isdigit():
            index = int(segment)
            if index >= len(current):
                return _MISSING
            current = current[index]
        else:
            return _MISSING
    return current


def _mapped_text(document: Any, path: str | None, field: str) -> str | None:
    if path is None:
        return None
    value = _lookup(document, path)
    if value is _MISSING or value is None:
        return None
    if text_value(value) is None:
        raise malformed(f"the payload's {field} is not a string or integer")
    return bounded_text(value, field)


def echoed_epoch(epoch: str | None, idempotency_key: str | None) -> int | None:
    """The epoch a sender names, from an echoed epoch or idempotency key; both must agree."""
    named: set[int] = set()
    for text, what in ((epoch, "epoch"), (idempotency_key, "idempotency key")):
        if text is None:
            continue
        tail = text.rsplit(":", 1)[-1] if what == "idempotency key" else text
        if not (tail.isascii() and tail.isdigit()) or len(tail) > 12:
            raise malformed(f"the payload's {what} does not name an epoch")
        named.add(int(tail))
    if len(named) > 1:
        raise malformed("the payload's epoch and idempotency key disagree")
    return named.pop() if named else None


def from_mapping(
    body: bytes, mapping: PayloadMapping, source_name: str, now: datetime
) -> InboundEvent:
    """Normalise a plain JSON payload from ``source_name`` through its mapping."""
    document = loads_object(body)
    if mapping.event_id_path is None:
        event_id: str | None = "sha256:" + hashlib.sha256(body).hexdigest()
    else:
        event_id = _mapped_text(document, mapping.event_id_path, "event id")
    if event_id is None:
        raise malformed("the payload has no event id")
    event_type = _mapped_text(document, mapping.type_path, "event type") or mapping.default_type
    if event_type is None:
        raise malformed("the payload has no event type")
    time = None
    time_text = _mapped_text(document, mapping.time_path, "time")
    if time_text is not None and (time := parse_rfc3339(time_text)) is None:
        raise malformed("the payload's time is not an RFC 3339 timestamp")
    data: JsonValue = document
    if mapping.data_path is not None:
        found = _lookup(document, mapping.data_path)
        data = None if found is _MISSING else found
    return InboundEvent(
        event_id=event_id,
        source=f"torpor:{source_name}",
        type=event_type,
        subject=_mapped_text(document, mapping.subject_path, "subject"),
        time=time,
        correlation_id=_mapped_text(document, mapping.correlation_id_path, "correlation id"),
        business_key=_mapped_text(document, mapping.business_key_path, "business key"),
        status=_mapped_text(document, mapping.status_path, "status"),
        epoch=echoed_epoch(
            _mapped_text(document, mapping.epoch_path, "epoch"),
            _mapped_text(document, mapping.idempotency_key_path, "idempotency key"),
        ),
        data=data,
        datacontenttype="application/json",
        received_at=now,
    )
