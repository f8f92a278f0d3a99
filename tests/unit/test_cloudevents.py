"""CloudEvents over HTTP (structured, binary, batched), mapped payloads, the handshake."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from torpor.webhooks import (
    InboundEvent,
    PayloadMapping,
    RejectReason,
    WebhookRejected,
    handshake,
    parse_http,
)

R = RejectReason
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
STRUCTURED = {"Content-Type": "application/cloudevents+json"}
BATCH = {"Content-Type": "application/cloudevents-batch+json"}
JSON = {"Content-Type": "application/json"}


def event(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "specversion": "1.0",
        "id": "evt-1",
        "source": "https://erp.example.com/orders",
        "type": "com.example.order.approved",
        "time": "2026-01-01T11:59:00Z",
        "datacontenttype": "application/json",
        "data": {"orderId": "o-7", "status": "approved", "correlationId": "c-42"},
    }
    for key, value in overrides.items():
        if value is ...:
            document.pop(key, None)
        else:
            document[key] = value
    return document


def parse(
    body: bytes | dict[str, Any] | list[Any],
    headers: Mapping[str, str] = STRUCTURED,
    mapping: PayloadMapping | None = None,
) -> list[InboundEvent]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_http(raw, headers, mapping=mapping, source_name="erp", now=NOW)


def rejected(
    body: bytes | dict[str, Any] | list[Any],
    headers: Mapping[str, str] = STRUCTURED,
    mapping: PayloadMapping | None = None,
) -> WebhookRejected:
    with pytest.raises(WebhookRejected) as info:
        parse(body, headers, mapping)
    return info.value


# --- structured mode -------------------------------------------------------------------


def test_structured_event() -> None:
    [parsed] = parse(event(subject="order/o-7", tenantid="acme"))
    assert parsed.event_id == "evt-1"
    assert parsed.source == "https://erp.example.com/orders"
    assert parsed.type == "com.example.order.approved"
    assert parsed.subject == "order/o-7"
    assert parsed.time == datetime(2026, 1, 1, 11, 59, tzinfo=UTC)
    assert parsed.correlation_id == "c-42"
    assert parsed.status == "approved"
    assert parsed.business_key is None
    assert parsed.data == {"orderId": "o-7", "status": "approved", "correlationId": "c-42"}
    assert parsed.extensions == {"tenantid": "acme"}
    assert parsed.datacontenttype == "application/json"
    assert parsed.received_at == NOW


@pytest.mark.parametrize(
    "content_type",
    [
        "application/cloudevents+json; charset=utf-8",
        "Application/CloudEvents+JSON",
        " application/cloudevents+json ;charset=UTF-8",
    ],
)
def test_structured_content_type_parameters_and_case(content_type: str) -> None:
    assert parse(event(), {"content-type": content_type})[0].event_id == "evt-1"


def test_structured_mode_ignores_ce_headers() -> None:
    headers = {**STRUCTURED, "ce-id": "from-header", "ce-specversion": "0.3"}
    assert parse(event(), headers)[0].event_id == "evt-1"


def test_extensions_win_over_data_conventions() -> None:
    data = {"correlation_id": "in-data", "business_key": "bk-data", "status": "done"}
    [parsed] = parse(event(data=data, correlationid="in-ext", businesskey="bk-ext"))
    assert (parsed.correlation_id, parsed.business_key) == ("in-ext", "bk-ext")
    [parsed] = parse(event(data=data))
    assert (parsed.correlation_id, parsed.business_key, parsed.status) == (
        "in-data",
        "bk-data",
        "done",
    )
    [parsed] = parse(event(data={"businessKey": 12345, "status": {"nested": True}}))
    assert (parsed.business_key, parsed.status, parsed.correlation_id) == ("12345", None, None)


@pytest.mark.parametrize("member", ["correlationId", "business_key", "status"])
def test_an_id_read_from_data_is_bounded_as_a_mapped_payloads_is(member: str) -> None:
    """The extension and the mapped payload were held to MAX_TEXT_CHARS; the same id read
    from a CloudEvent's data was not, and went on into the index lookup, the inbox event
    and the audit record at whatever length the body allowed."""
    error = rejected(event(data={member: "x" * 2049}))
    assert error.reason is R.MALFORMED_BODY
    assert "too long" in error.public_detail
    assert len(parse(event(data={member: "x" * 2048}))) == 1  # the limit itself is fine


def test_extension_values_of_json_types_become_text() -> None:
    [parsed] = parse(event(retries=3, urgent=True, quiet=False, dropped=None))
    assert parsed.extensions == {"retries": "3", "urgent": "true", "quiet": "false"}


def test_null_attribute_is_absent_and_data_is_optional() -> None:
    [parsed] = parse(event(subject=None, data=..., datacontenttype=..., time=...))
    assert (parsed.subject, parsed.data, parsed.time, parsed.datacontenttype) == (
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-01-01T12:00:00.123456789Z", datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)),
        (
            "2026-01-01T14:00:00+02:00",
            datetime(2026, 1, 1, 14, tzinfo=timezone(timedelta(hours=2))),
        ),
        ("2026-01-01t12:00:00z", datetime(2026, 1, 1, 12, tzinfo=UTC)),
        ("2016-12-31T23:59:60Z", datetime(2017, 1, 1, tzinfo=UTC)),
    ],
)
def test_rfc3339_times(value: str, expected: datetime) -> None:
    assert parse(event(time=value))[0].time == expected


def test_data_base64() -> None:
    encoded = base64.b64encode(b'{"status":"done"}').decode()
    [parsed] = parse(event(data=..., data_base64=encoded))
    assert parsed.data == {"status": "done"}
    assert parsed.status == "done"
    binary = base64.b64encode(b"\x00\xff\x10").decode()
    [parsed] = parse(event(data=..., data_base64=binary, datacontenttype="image/png"))
    assert parsed.data == binary
    text = base64.b64encode("héllo".encode()).decode()
    [parsed] = parse(event(data=..., data_base64=text, datacontenttype="text/plain"))
    assert parsed.data == "héllo"


INVALID_ATTRIBUTES: list[tuple[dict[str, Any], str]] = [
    ({"id": ...}, "id"),
    ({"id": ""}, "id"),
    ({"id": 7}, "id"),
    ({"source": ...}, "source"),
    ({"source": ""}, "source"),
    ({"source": "has a space"}, "source"),
    ({"source": "http://[::1"}, "source"),
    ({"specversion": ...}, "specversion"),
    ({"specversion": "0.3"}, "specversion"),
    ({"specversion": "1.0.2"}, "specversion"),
    ({"specversion": 1.0}, "specversion"),
    ({"type": ...}, "type"),
    ({"type": ""}, "type"),
    ({"type": ["a"]}, "type"),
    ({"subject": ""}, "subject"),
    ({"time": "yesterday"}, "time"),
    ({"time": "2026-13-01T00:00:00Z"}, "time"),
    ({"time": "2026-01-01T00:00:00"}, "time"),
    ({"time": "2026-01-01 00:00:00Z"}, "time"),
    ({"time": 1767268800}, "time"),
    ({"dataschema": "/schemas/order.json"}, "dataschema"),
    ({"dataschema": "https://example.com/a b"}, "dataschema"),
    ({"datacontenttype": "json"}, "datacontenttype"),
    ({"ratio": 0.5}, "ratio"),
    ({"meta": {"a": 1}}, "meta"),
    ({"big": 2**40}, "big"),
    ({"data_base64": "aGk="}, "data_base64"),
    ({"data": ..., "data_base64": "not base64!"}, "data_base64"),
    ({"data": ..., "data_base64": 5}, "data_base64"),
    ({"id": "x" * 3000}, "id"),
]


@pytest.mark.parametrize(("overrides", "attribute"), INVALID_ATTRIBUTES)
def test_invalid_attribute(overrides: dict[str, Any], attribute: str) -> None:
    error = rejected(event(**overrides))
    assert error.reason is R.INVALID_CLOUDEVENT
    assert error.status == 400
    assert f"'{attribute}'" in error.public_detail


@pytest.mark.parametrize("name", ["Foo", "foo_bar", "a" * 21, "ünïcode", "with-dash"])
def test_invalid_extension_names(name: str) -> None:
    error = rejected(event(**{name: "x"}))
    assert error.reason is R.INVALID_CLOUDEVENT
    assert name not in error.public_detail  # attacker input is never echoed


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'"a string"',
        b"\xff\xfe{}",
        b'{"id": "a", "id": "b"}',
        b'{"id": NaN}',
        b"[" * 100 + b"]" * 100,
        b"[" * 100_000,
        b"",
        b"\xef\xbb\xbf{}",
    ],
)
def test_malformed_structured_body(body: bytes) -> None:
    error = rejected(body)
    assert error.reason is R.MALFORMED_BODY
    assert error.status == 400


def test_deep_nesting_inside_data_is_refused() -> None:
    deep: Any = "leaf"
    for _ in range(70):
        deep = {"d": deep}
    assert rejected(event(data=deep)).reason is R.MALFORMED_BODY


# --- binary mode -----------------------------------------------------------------------


def binary_headers(**overrides: str) -> dict[str, str]:
    headers = {
        "ce-specversion": "1.0",
        "ce-id": "evt-2",
        "ce-source": "%2Ferp%2Forders",
        "ce-type": "com.example.order.approved",
        "Content-Type": "application/json; charset=utf-8",
    }
    headers.update(overrides)
    return {k: v for k, v in headers.items() if v != "-"}


def test_binary_event_with_percent_encoded_values() -> None:
    headers = binary_headers(
        **{
            "CE-Subject": "caf%C3%A9%20%2F%20%22quoted%22",
            "ce-correlationid": "c%2D9",
            "ce-time": "2026-01-01T11:00:00%2B01:00",
        }
    )
    [parsed] = parse(b'{"status":"rejected","businessKey":"PO-1"}', headers)
    assert parsed.event_id == "evt-2"
    assert parsed.source == "/erp/orders"
    assert parsed.subject == 'café / "quoted"'
    assert parsed.time == datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert parsed.correlation_id == "c-9"
    assert parsed.business_key == "PO-1"
    assert parsed.status == "rejected"
    assert parsed.datacontenttype == "application/json; charset=utf-8"
    assert parsed.extensions == {"correlationid": "c-9"}


@pytest.mark.parametrize(
    ("content_type", "body", "data"),
    [
        ("text/plain", "héllo".encode(), "héllo"),
        ("application/octet-stream", b"\x00\x01", base64.b64encode(b"\x00\x01").decode()),
        ("-", b'{"a": 1}', {"a": 1}),
        ("-", b"plain words", "plain words"),
        ("-", b"\xff\xfe", base64.b64encode(b"\xff\xfe").decode()),
        ("application/json", b"", None),
        ("application/vnd.acme+json", b"[1, 2]", [1, 2]),
    ],
)
def test_binary_data_by_content_type(content_type: str, body: bytes, data: object) -> None:
    [parsed] = parse(body, binary_headers(**{"Content-Type": content_type}))
    assert parsed.data == data


@pytest.mark.parametrize(
    ("overrides", "body", "reason"),
    [
        ({"ce-datacontenttype": "application/json"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-subject": "%FF%FE"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-subject": "caf\u00e9"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-foo_bar": "x"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-": "x"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-data": "x"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-specversion": "-"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-specversion": "0.3"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-id": "-"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-time": "soon"}, b"{}", R.INVALID_CLOUDEVENT),
        ({"ce-dataschema": "relative/path"}, b"{}", R.INVALID_CLOUDEVENT),
        ({}, b"{broken", R.MALFORMED_BODY),
        ({"Content-Type": "text/plain"}, b"\xff", R.MALFORMED_BODY),
    ],
)
def test_invalid_binary_event(overrides: dict[str, str], body: bytes, reason: RejectReason) -> None:
    assert rejected(body, binary_headers(**overrides)).reason is reason


def test_any_ce_header_means_binary_mode() -> None:
    # Without ce-specversion this is a broken binary event, not a mapped payload.
    headers = {**JSON, "ce-id": "x"}
    error = rejected(b"{}", headers, PayloadMapping(default_type="t"))
    assert error.reason is R.INVALID_CLOUDEVENT
    assert "specversion" in error.public_detail


def test_conflicting_duplicate_ce_headers() -> None:
    headers = {**binary_headers(), "CE-ID": "evt-other"}
    assert rejected(b"{}", headers).reason is R.INVALID_CLOUDEVENT


# --- batched mode ----------------------------------------------------------------------


def test_batch() -> None:
    parsed = parse([event(id=f"evt-{n}") for n in range(3)], BATCH)
    assert [e.event_id for e in parsed] == ["evt-0", "evt-1", "evt-2"]
    assert len(parse([event(id=f"e{n}") for n in range(100)], BATCH)) == 100


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ([], R.INVALID_CLOUDEVENT),
        ([event(id=f"e{n}") for n in range(101)], R.INVALID_CLOUDEVENT),
        (event(), R.MALFORMED_BODY),
        ([event(), "not an object"], R.MALFORMED_BODY),
        (b"[{]", R.MALFORMED_BODY),
    ],
)
def test_invalid_batch(body: Any, reason: RejectReason) -> None:
    assert rejected(body, BATCH).reason is reason


def test_batch_names_the_bad_event() -> None:
    error = rejected([event(), event(source="")], BATCH)
    assert error.reason is R.INVALID_CLOUDEVENT
    assert error.public_detail.startswith("batch event #1:")
    assert "'source'" in error.public_detail


# --- mapped (non-CloudEvents) payloads -------------------------------------------------

MAPPING = PayloadMapping(
    event_id_path="meta.delivery.id",
    type_path="meta.kind",
    correlation_id_path="order.refs.0.correlation",
    business_key_path="order.number",
    status_path="order.approval.state",
    subject_path="order.number",
    time_path="meta.at",
    data_path="order",
)
ORDER = {
    "meta": {"delivery": {"id": 991}, "kind": "erp.order.approval", "at": "2026-01-01T11:00:00Z"},
    "order": {
        "number": "PO-77",
        "refs": [{"correlation": "c-1"}, {"correlation": "c-2"}],
        "approval": {"state": "approved", "by": "cfo"},
    },
}


def test_mapping_with_nested_paths() -> None:
    [parsed] = parse(ORDER, JSON, MAPPING)
    assert parsed.event_id == "991"
    assert parsed.source == "torpor:erp"
    assert parsed.type == "erp.order.approval"
    assert parsed.correlation_id == "c-1"
    assert parsed.business_key == "PO-77"
    assert parsed.subject == "PO-77"
    assert parsed.status == "approved"
    assert parsed.time == datetime(2026, 1, 1, 11, tzinfo=UTC)
    assert parsed.data == ORDER["order"]
    assert parsed.extensions == {}
    assert parsed.received_at == NOW


def test_mapping_defaults() -> None:
    mapping = PayloadMapping(default_type="erp.callback")
    body = json.dumps({"anything": [1, 2]}).encode()
    [parsed] = parse(body, {"Content-Type": "application/vnd.erp+json"}, mapping)
    assert parsed.event_id == "sha256:" + hashlib.sha256(body).hexdigest()
    assert parsed.type == "erp.callback"
    assert parsed.data == {"anything": [1, 2]}
    assert (parsed.correlation_id, parsed.status, parsed.time) == (None, None, None)


def test_mapping_falls_back_to_default_type_and_tolerates_missing_optionals() -> None:
    mapping = MAPPING.model_copy(update={"default_type": "fallback"})
    body = {"meta": {"delivery": {"id": "d1"}}, "order": {"refs": []}}
    [parsed] = parse(body, JSON, mapping)
    assert parsed.type == "fallback"
    assert (parsed.correlation_id, parsed.business_key, parsed.status) == (None, None, None)
    mapping = PayloadMapping(event_id_path="id", default_type="t", data_path="missing.path")
    assert parse({"id": "x"}, JSON, mapping)[0].data is None


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"order": {}}, "event id"),
        ({"meta": {"delivery": {"id": {"nested": 1}}}}, "event id"),
        ({"meta": {"delivery": {"id": True}}}, "event id"),
        ({"meta": {"delivery": {"id": "d"}}}, "event type"),
        ({"meta": {"delivery": {"id": "d"}, "kind": "k", "at": "noon"}}, "time"),
        (
            {"meta": {"delivery": {"id": "d"}, "kind": "k"}, "order": {"approval": {"state": []}}},
            "status",
        ),
        ([1, 2], "object"),
    ],
)
def test_mapping_rejections(body: Any, detail: str) -> None:
    error = rejected(body, JSON, MAPPING)
    assert error.reason is R.MALFORMED_BODY
    assert detail in error.public_detail


def test_plain_json_without_mapping_is_refused() -> None:
    error = rejected(ORDER, JSON, None)
    assert error.reason is R.INVALID_CLOUDEVENT
    assert error.status == 400


def test_payload_mapping_validation() -> None:
    with pytest.raises(ValidationError, match="default_type"):
        PayloadMapping(event_id_path="id")
    with pytest.raises(ValidationError, match="segments"):
        PayloadMapping(default_type="t", status_path="a..b")
    with pytest.raises(ValidationError):
        PayloadMapping(default_type="t", unknown_path="x")  # type: ignore[call-arg]


# --- media types and size --------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/cloudevents+xml"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": ""},
    ],
)
def test_unsupported_media_type(headers: dict[str, str]) -> None:
    error = rejected(event(), headers, MAPPING)
    assert (error.reason, error.status) == (R.UNSUPPORTED_MEDIA_TYPE, 415)


def test_conflicting_content_types() -> None:
    headers = {"Content-Type": "application/cloudevents+json", "content-type": "application/json"}
    assert rejected(event(), headers).reason is R.UNSUPPORTED_MEDIA_TYPE


def test_content_types_differing_only_in_padding_are_one_content_type() -> None:
    headers = {
        "Content-Type": "application/cloudevents+json",
        "content-type": " application/cloudevents+json",
    }
    body = json.dumps(event()).encode()
    [parsed] = parse_http(body, headers, mapping=None, source_name="s", now=NOW)
    assert parsed.event_id == event()["id"]


@pytest.mark.parametrize(
    ("first", "reason"),
    [("ce-type", R.INVALID_CLOUDEVENT), ("content-type", R.UNSUPPORTED_MEDIA_TYPE)],
)
def test_of_two_conflicting_headers_the_first_in_the_request_decides(first: str, reason: R) -> None:
    conflicting = {
        "ce-type": ("ce-type", "Ce-Type", "a", "b"),
        "content-type": ("content-type", "Content-Type", "application/json", "text/plain"),
    }
    order = [first, *(name for name in conflicting if name != first)]
    headers: dict[str, str] = {}
    for name in order:
        lower, title, one, other = conflicting[name]
        headers[lower], headers[title] = one, other
    assert rejected(event(), headers).reason is reason


def test_body_too_large() -> None:
    body = json.dumps(event(data={"pad": "x" * 200})).encode()
    with pytest.raises(WebhookRejected) as info:
        parse_http(body, STRUCTURED, mapping=None, source_name="s", now=NOW, max_body_bytes=100)
    assert (info.value.reason, info.value.status) == (R.BODY_TOO_LARGE, 413)


def test_naive_now_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        parse_http(b"{}", STRUCTURED, mapping=None, source_name="s", now=datetime(2026, 1, 1))


# --- interop with the cloudevents SDK --------------------------------------------------


def sdk_event(**attributes: Any) -> CloudEvent:
    base = {
        "type": "com.example.order.approved",
        "source": "https://erp.example.com/orders",
        "id": "sdk-1",
        "time": datetime(2026, 1, 1, 11, 30, tzinfo=UTC),
        "subject": "commande n°7 / «urgent»",
        "correlationid": "c-sdk",
        "datacontenttype": "application/json",
    }
    base.update(attributes)
    base = {k: v for k, v in base.items() if v is not None}
    return CloudEvent(attributes=base, data={"status": "approved", "amount": 10})


def check_sdk_event(parsed: InboundEvent) -> None:
    assert parsed.event_id == "sdk-1"
    assert parsed.source == "https://erp.example.com/orders"
    assert parsed.subject == "commande n°7 / «urgent»"
    assert parsed.time == datetime(2026, 1, 1, 11, 30, tzinfo=UTC)
    assert parsed.correlation_id == "c-sdk"
    assert parsed.status == "approved"
    assert parsed.data == {"status": "approved", "amount": 10}


def test_sdk_structured() -> None:
    message = ce_http.to_structured_event(sdk_event())
    check_sdk_event(parse(message.body, message.headers)[0])


def test_sdk_binary() -> None:
    message = ce_http.to_binary_event(sdk_event())
    assert any(v.count("%") for v in message.headers.values())  # really percent-encoded
    check_sdk_event(parse(message.body, message.headers)[0])


def test_sdk_binary_without_datacontenttype() -> None:
    message = ce_http.to_binary_event(sdk_event(datacontenttype=None))
    assert not any(k.lower() == "content-type" for k in message.headers)
    check_sdk_event(parse(message.body, message.headers)[0])


def test_sdk_batch() -> None:
    # The SDK has no batch writer: a batch is a JSON array of structured events.
    events = [sdk_event(id=f"sdk-{n}") for n in range(3)]
    body = b"[" + b",".join(ce_http.to_structured_event(e).body for e in events) + b"]"
    parsed = parse(body, BATCH)
    assert [p.event_id for p in parsed] == ["sdk-0", "sdk-1", "sdk-2"]


def test_sdk_reads_what_we_accept() -> None:
    body = json.dumps(event(tenantid="acme")).encode()
    [ours] = parse(body)
    theirs = ce_http.from_http_event(ce_http.HTTPMessage(headers=dict(STRUCTURED), body=body))
    assert theirs.get_id() == ours.event_id
    assert theirs.get_source() == ours.source
    assert theirs.get_time() == ours.time


# --- abuse-protection handshake --------------------------------------------------------

ORIGINS = ["eventemitter.example.com", "Hooks.Partner.io"]


def test_handshake_allowed() -> None:
    headers = {"webhook-request-origin": "EventEmitter.Example.com"}
    assert handshake(headers, allowed_origins=ORIGINS, allowed_rate=120) == {
        "WebHook-Allowed-Origin": "EventEmitter.Example.com",
        "WebHook-Allowed-Rate": "120",
        "Allow": "POST, OPTIONS",
    }
    response = handshake(
        {"WebHook-Request-Origin": "hooks.partner.io", "WebHook-Request-Rate": "10"},
        allowed_origins=ORIGINS,
        allowed_rate=None,
    )
    # A rate asked for is always answered (spec 4.2.2): "*" when none is configured.
    assert response == {
        "WebHook-Allowed-Origin": "hooks.partner.io",
        "WebHook-Allowed-Rate": "*",
        "Allow": "POST, OPTIONS",
    }


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"WebHook-Request-Origin": ""},
        {"WebHook-Request-Origin": "evil.example.com"},
        {"WebHook-Request-Origin": "eventemitter.example.com.evil.io"},
        {"WebHook-Request-Origin": "eventemitter.example.com\r\nX-Injected: 1"},
        {"WebHook-Request-Origin": "éventemitter.example.com"},
        {"Origin": "eventemitter.example.com"},
    ],
)
def test_handshake_denied(headers: dict[str, str]) -> None:
    assert handshake(headers, allowed_origins=ORIGINS, allowed_rate=5) is None


def test_handshake_needs_a_list_of_origins() -> None:
    with pytest.raises(TypeError):
        handshake({"WebHook-Request-Origin": "a"}, allowed_origins="abc", allowed_rate=None)


# --- fuzzing ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
attribute_names = st.sampled_from(
    [
        *("id", "source", "specversion", "type", "time", "subject", "dataschema"),
        *("datacontenttype", "data", "data_base64", "correlationid", "Bad_Name"),
    ]
)
content_types = st.sampled_from(
    [
        "application/cloudevents+json",
        "application/cloudevents-batch+json",
        "application/json",
        "text/plain",
        "",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    document=st.one_of(
        st.dictionaries(attribute_names, json_values, max_size=8),
        st.lists(st.dictionaries(attribute_names, json_values, max_size=8), max_size=3),
        json_values,
    ),
    content_type=content_types,
)
def test_parse_http_on_random_json_only_raises_rejections(document: Any, content_type: str) -> None:
    body = json.dumps(document).encode()
    try:
        parse(body, {"Content-Type": content_type}, PayloadMapping(default_type="t"))
    except WebhookRejected as error:
        assert error.status in {400, 415}


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=80),
    headers=st.dictionaries(
        st.sampled_from(
            [
                *("Content-Type", "ce-id", "ce-source", "ce-specversion", "ce-type"),
                *("ce-time", "ce-datacontenttype", "CE-Type", "ce-x"),
            ]
        )
        | st.text(max_size=10),
        st.text(max_size=30),
        max_size=6,
    ),
)
def test_parse_http_on_random_bytes_only_raises_rejections(
    body: bytes, headers: dict[str, str]
) -> None:
    try:
        parse(body, headers, PayloadMapping(event_id_path="id", type_path="t"))
    except WebhookRejected as error:
        assert error.status in {400, 415}


def test_a_mapping_reads_the_epoch_the_sender_echoes() -> None:
    from torpor.webhooks.payloads import PayloadMapping, from_mapping

    mapping = PayloadMapping(
        default_type="t", epoch_path="epoch", idempotency_key_path="request.key"
    )
    now = datetime(2026, 1, 1, tzinfo=UTC)
    key = b'{"request": {"key": "acme:approve:PR-1:3"}}'
    assert from_mapping(key, mapping, "oa", now).epoch == 3
    assert from_mapping(b'{"epoch": 1}', mapping, "oa", now).epoch == 1
    assert from_mapping(b"{}", mapping, "oa", now).epoch is None
    for bad in (b'{"epoch": "one"}', b'{"epoch": 1, "request": {"key": "acme:a:2"}}'):
        with pytest.raises(WebhookRejected):
            from_mapping(bad, mapping, "oa", now)


def test_a_cloudevent_may_name_the_epoch_it_answers() -> None:
    [parsed] = parse(event(data={}, idempotencykey="acme:approve:PR-1:1"))
    assert parsed.epoch == 1
    [parsed] = parse(event(data={}, epoch="3"))
    assert parsed.epoch == 3
    assert parse(event(data={}))[0].epoch is None
    with pytest.raises(WebhookRejected):
        parse(event(data={}, epoch="3", idempotencykey="acme:approve:PR-1:1"))
