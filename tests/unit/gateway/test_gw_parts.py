"""Error shape, body parsing and the worker-health counters."""

import json

import pytest

from marsproxy.gateway.bodies import BodyError, parse_body
from marsproxy.gateway.errors import error_response, sse_error_event
from marsproxy.gateway.health import WorkerHealth


def test_error_shape() -> None:
    resp = error_response(
        503, "no healthy worker", code="no_healthy_worker", headers={"Retry-After": "1"}
    )
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert resp.body is not None
    body = json.loads(bytes(resp.body))  # type: ignore[arg-type]
    assert body == {
        "error": {
            "message": "no healthy worker",
            "type": "service_unavailable",
            "code": "no_healthy_worker",
        }
    }
    event = sse_error_event("silent", code="upstream_timeout")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["code"] == "upstream_timeout"


@pytest.mark.parametrize("raw", [b"{bad", b"[1, 2]", b'"str"', b""])
def test_bad_bodies_are_400(raw: bytes) -> None:
    with pytest.raises(BodyError) as exc:
        parse_body("chat", raw)
    assert exc.value.status == 400


def test_body_bytes_untouched_unless_usage_is_added() -> None:
    raw = b'{"model":"m",  "messages":[], "tools":[{"x":1}], "unknown_field":true}'
    assert parse_body("chat", raw).raw is raw
    streamed_with_usage = b'{"stream":true,"stream_options":{"include_usage":true}}'
    p = parse_body("chat", streamed_with_usage)
    assert p.raw is streamed_with_usage and not p.strip_usage_chunk
    p = parse_body("completions", b'{"stream":true,"prompt":"x","extra":{"a":[1]}}')
    assert p.strip_usage_chunk
    assert json.loads(p.raw) == {
        "stream": True,
        "prompt": "x",
        "extra": {"a": [1]},
        "stream_options": {"include_usage": True},
    }
    # Other routes are never rewritten.
    raw = b'{"stream":true}'
    assert parse_body("messages", raw).raw is raw


def test_health_counters_eject_and_readmit() -> None:
    h = WorkerHealth(["a", "b"], unhealthy_after=2, healthy_after=2)
    assert h.healthy() == ["a", "b"]
    assert not h.record("a", False)
    assert h.record("a", True) is False  # a success resets the failure count
    assert not h.record("a", False)
    assert h.record("a", False) and h.healthy() == ["b"]
    assert not h.record("a", True)
    assert h.record("a", True) and h.healthy() == ["a", "b"]
