"""CloudEvents v1.0 over HTTP, and plain JSON payloads, normalised into ``InboundEvent``.

Pure: the caller has already verified the signature over the raw body. The mode is
decided by Content-Type as the HTTP binding says: structured
(``application/cloudevents+json``), batched (``application/cloudevents-batch+json``),
binary (``ce-*`` headers) or, for senders that do not speak CloudEvents, JSON mapped
through a per-source ``PayloadMapping``. Every problem becomes a ``WebhookRejected``
whose public detail names at most an attribute, never echoing attacker input.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final
from urllib.parse import unquote_to_bytes, urlsplit

from pydantic import JsonValue

from torpor.errors import RejectReason, WebhookRejected
from torpor.webhooks.headers import RequestHeaders
from torpor.webhooks.payloads import (
    MAX_TEXT_CHARS,
    InboundEvent,
    PayloadMapping,
    bounded_text,
    echoed_epoch,
    from_mapping,
    loads_json,
    loads_object,
    malformed,
    parse_rfc3339,
)
from torpor.webhooks.rejections import ensure_body_size

__all__ = ["InboundEvent", "PayloadMapping", "handshake", "parse_http"]

_R = RejectReason

STRUCTURED_MEDIA_TYPE: Final = "application/cloudevents+json"
BATCH_MEDIA_TYPE: Final = "application/cloudevents-batch+json"
MAX_BATCH_EVENTS: Final = 100
DEFAULT_MAX_BODY_BYTES: Final = 1024 * 1024

_CORE_ATTRIBUTES: Final = frozenset(
    {"id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject", "time"}
)
# "data" would collide with the payload member of the JSON format.
_RESERVED_NAMES: Final = frozenset({"data"})
_ATTRIBUTE_NAME: Final = re.compile(r"[a-z0-9]{1,20}")
_JSON_MEDIA_TYPE: Final = re.compile(r"(application|text)/([a-z0-9.\-]+\+)?json")
_URI_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")
_WHITESPACE_OR_CONTROL: Final = re.compile(r"[\s\x00-\x1f\x7f]")


def _invalid(attribute: str, why: str = "is missing or invalid") -> WebhookRejected:
    return WebhookRejected(_R.INVALID_CLOUDEVENT, f"CloudEvent attribute '{attribute}' {why}")


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _bytes_to_data(raw: bytes, content_type: str | None) -> JsonValue:
    if not raw:
        return None
    if content_type is None:
        # No datacontenttype: JSON if it parses, else text, else opaque bytes.
        try:
            parsed: JsonValue = loads_json(raw)
        except WebhookRejected:
            pass
        else:
            return parsed
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    media = _media_type(content_type)
    if _JSON_MEDIA_TYPE.fullmatch(media):
        document: JsonValue = loads_json(raw)
        return document
    if media.startswith("text/"):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise malformed("the text payload is not UTF-8") from None
    return base64.b64encode(raw).decode("ascii")


def _is_uri_reference(value: str) -> bool:
    if _WHITESPACE_OR_CONTROL.search(value):
        return False
    try:
        urlsplit(value)
    except ValueError:
        return False
    return True


def _is_absolute_uri(value: str) -> bool:
    return _is_uri_reference(value) and _URI_SCHEME.match(value) is not None


def _build(attrs: dict[str, str], data: JsonValue, now: datetime) -> InboundEvent:
    if attrs.get("specversion") != "1.0":
        raise _invalid("specversion", "must be 1.0")
    for name in ("id", "source", "type"):
        if not attrs.get(name):
            raise _invalid(name)
    for name, value in attrs.items():
        if len(value) > MAX_TEXT_CHARS:
            raise _invalid(name, "is too long")
        if name in _RESERVED_NAMES:
            raise _invalid(name, "is a reserved name")
    if not _is_uri_reference(attrs["source"]):
        raise _invalid("source", "must be a URI-reference")
    if "subject" in attrs and not attrs["subject"]:
        raise _invalid("subject", "must not be empty")
    time = None
    if "time" in attrs and (time := parse_rfc3339(attrs["time"])) is None:
        raise _invalid("time", "must be an RFC 3339 timestamp")
    if "dataschema" in attrs and not _is_absolute_uri(attrs["dataschema"]):
        raise _invalid("dataschema", "must be an absolute URI")
    if "datacontenttype" in attrs and "/" not in attrs["datacontenttype"]:
        raise _invalid("datacontenttype", "must be a media type")

    extensions = {k: v for k, v in attrs.items() if k not in _CORE_ATTRIBUTES}
    payload = data if isinstance(data, dict) else {}
    # Conventions, not spec: an extension wins over the same field inside data.
    # Bounded as the extensions are (above): these go on into the index and the audit.
    correlation = extensions.get("correlationid") or bounded_text(
        payload.get("correlationId", payload.get("correlation_id")), "correlation id"
    )
    business_key = extensions.get("businesskey") or bounded_text(
        payload.get("businessKey", payload.get("business_key")), "business key"
    )
    return InboundEvent(
        event_id=attrs["id"],
        source=attrs["source"],
        type=attrs["type"],
        subject=attrs.get("subject"),
        time=time,
        correlation_id=correlation,
        business_key=business_key,
        status=bounded_text(payload.get("status"), "status"),
        # Which request the event answers, if the sender says: stale answers are observed.
        epoch=echoed_epoch(extensions.get("epoch"), extensions.get("idempotencykey")),
        data=data,
        datacontenttype=attrs.get("datacontenttype"),
        dataschema=attrs.get("dataschema"),
        extensions=extensions,
        received_at=now,
    )


def _attribute_value(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    # The JSON format lets extensions be booleans and integers; core attributes are text.
    if name not in _CORE_ATTRIBUTES:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int) and -(2**31) <= value < 2**31:
            return str(value)
    raise _invalid(name, "has the wrong type")


def _from_structured(document: dict[str, Any], now: datetime) -> InboundEvent:
    members = dict(document)
    has_data = "data" in members
    data: JsonValue = members.pop("data", None)
    data_base64 = members.pop("data_base64", None)
    if has_data and data_base64 is not None:
        raise _invalid("data_base64", "cannot appear together with data")
    attrs: dict[str, str] = {}
    for name, value in members.items():
        if value is None:
            continue  # null means absent in the JSON format
        if not _ATTRIBUTE_NAME.fullmatch(name):
            raise WebhookRejected(
                _R.INVALID_CLOUDEVENT,
                "CloudEvent attribute names are 1-20 lowercase letters or digits",
            )
        attrs[name] = _attribute_value(name, value)
    if data_base64 is not None:
        if not isinstance(data_base64, str):
            raise _invalid("data_base64", "must be a base64 string")
        try:
            raw = base64.b64decode(data_base64, validate=True)
        except (binascii.Error, ValueError):
            raise _invalid("data_base64", "must be a base64 string") from None
        data = _bytes_to_data(raw, attrs.get("datacontenttype"))
    return _build(attrs, data, now)


def _percent_decode(name: str, value: str) -> str:
    if not value.isascii():
        raise _invalid(name, "header is not percent-encoded ASCII")
    try:
        return unquote_to_bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid(name, "header is not percent-encoded UTF-8") from None


def _from_binary(body: bytes, headers: Mapping[str, str], now: datetime) -> InboundEvent:
    if "ce-datacontenttype" in headers:
        raise WebhookRejected(
            _R.INVALID_CLOUDEVENT, "the ce-datacontenttype header is not allowed; use Content-Type"
        )
    attrs: dict[str, str] = {}
    for header, value in headers.items():
        if not header.startswith("ce-"):
            continue
        name = header.removeprefix("ce-")
        if not _ATTRIBUTE_NAME.fullmatch(name):
            raise WebhookRejected(
                _R.INVALID_CLOUDEVENT,
                "CloudEvent attribute names are 1-20 lowercase letters or digits",
            )
        attrs[name] = _percent_decode(name, value)
    content_type = headers.get("content-type") or None
    if content_type is not None:
        attrs["datacontenttype"] = content_type
    return _build(attrs, _bytes_to_data(body, content_type), now)


def _from_batch(body: bytes, now: datetime) -> list[InboundEvent]:
    document = loads_json(body)
    if not isinstance(document, list):
        raise malformed("a CloudEvents batch must be a JSON array")
    if not 1 <= len(document) <= MAX_BATCH_EVENTS:
        raise WebhookRejected(
            _R.INVALID_CLOUDEVENT, f"a batch holds 1 to {MAX_BATCH_EVENTS} events"
        )
    events: list[InboundEvent] = []
    for index, item in enumerate(document):
        if not isinstance(item, dict):
            raise malformed(f"batch event #{index} is not a JSON object")
        try:
            events.append(_from_structured(item, now))
        except WebhookRejected as rejected:
            raise WebhookRejected(
                rejected.reason, f"batch event #{index}: {rejected.public_detail}"
            ) from None
    return events


def _normalise(headers: Mapping[str, str]) -> Mapping[str, str]:
    read = RequestHeaders.of(headers)
    for name in read.differing:  # in the request's order: the first such decides
        if name == "content-type":
            raise WebhookRejected(_R.UNSUPPORTED_MEDIA_TYPE)
        if name.startswith("ce-"):
            raise WebhookRejected(_R.INVALID_CLOUDEVENT, "conflicting duplicate ce- headers")
    return read.by_name


def is_batch(headers: Mapping[str, str]) -> bool:
    """Whether the request is in batched mode: decided by Content-Type, as ``parse_http``
    decides it, never by how many events it held (a batch may hold one)."""
    return _media_type(_normalise(headers).get("content-type", "")) == BATCH_MEDIA_TYPE


def parse_http(
    body: bytes,
    headers: Mapping[str, str],
    *,
    mapping: PayloadMapping | None,
    source_name: str,
    now: datetime,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    binary: bool = True,
) -> list[InboundEvent]:
    """Parse a verified HTTP request into one or more events (a batch gives several).

    ``binary=False`` refuses binary mode (415): its attributes travel in ``ce-*`` headers,
    which a signature over the body alone does not cover."""
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("now must be a timezone-aware datetime")
    ensure_body_size(len(body), limit=max_body_bytes)
    normalised = _normalise(headers)
    media = _media_type(normalised.get("content-type", ""))
    # The HTTP binding decides the mode by Content-Type first: ce- headers on a
    # structured request are ignored, as the spec says.
    if media == STRUCTURED_MEDIA_TYPE:
        return [_from_structured(loads_object(body), now)]
    if media == BATCH_MEDIA_TYPE:
        return _from_batch(body, now)
    if any(name.startswith("ce-") for name in normalised):
        if not binary:
            raise WebhookRejected(
                _R.UNSUPPORTED_MEDIA_TYPE,
                "CloudEvents binary mode is not accepted: its ce- headers are not signed;"
                " send structured mode (application/cloudevents+json)",
            )
        return [_from_binary(body, normalised, now)]
    if _JSON_MEDIA_TYPE.fullmatch(media):
        if mapping is None:
            raise WebhookRejected(
                _R.INVALID_CLOUDEVENT,
                "this source accepts CloudEvents only (no payload mapping is configured)",
            )
        return [from_mapping(body, mapping, source_name, now)]
    raise WebhookRejected(_R.UNSUPPORTED_MEDIA_TYPE)


def handshake(
    headers: Mapping[str, str], *, allowed_origins: Sequence[str], allowed_rate: int | None
) -> dict[str, str] | None:
    """Answer the CloudEvents webhook abuse-protection ``OPTIONS`` handshake.

    Returns the response headers for a registered ``WebHook-Request-Origin`` (the rate
    ``*`` when ``allowed_rate`` is None), or None when the origin is absent or not
    registered (the caller answers 405).
    """
    if isinstance(allowed_origins, str):
        # A bare string is a Sequence[str]: membership would match single characters.
        raise TypeError("allowed_origins must be a sequence of origins, not one string")
    origin = ""
    for name, value in headers.items():
        if name.strip().lower() == "webhook-request-origin":
            origin = value.strip()
    if not origin or not origin.isascii() or _WHITESPACE_OR_CONTROL.search(origin):
        return None
    # Host names compare case-insensitively (RFC 4343).
    if origin.lower() not in {allowed.strip().lower() for allowed in allowed_origins}:
        return None
    # The rate always: the spec requires it whenever the sender asked for one (4.2.2),
    # and "*" is its word for no limit, which is what an unconfigured rate means.
    rate = str(allowed_rate) if allowed_rate else "*"
    return {
        "WebHook-Allowed-Origin": origin,
        "WebHook-Allowed-Rate": rate,
        "Allow": "POST, OPTIONS",
    }
