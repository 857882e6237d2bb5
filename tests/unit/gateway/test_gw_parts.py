"""Error shape, body parsing, header filtering and the worker-health counters."""

import json

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from marsproxy.gateway.http.bodies import BodyError, dump_json, parse_body, set_key, splice_new_key
from marsproxy.gateway.http.errors import error_response, sse_error_event
from marsproxy.gateway.http.health import WorkerHealth
from marsproxy.gateway.http.upstream import request_headers, response_headers


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
            "param": None,
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


@pytest.mark.parametrize(("flag", "stream"), [
    ("true", True), ("YES", True), ("On", True), ("t", True), ("Y", True), ("1", True),
    (1, True), (1.0, True), (True, True),
    ("false", False), ("off", False), ("0", False), ("n", False), (0, False), (0.0, False),
    (None, False),
    # Not a bool to vLLM (it answers 400): left alone, for the worker to refuse.
    ("maybe", False), (" true", False), ("", False), (2, False), (0.5, False), ([], False),
    ({}, False),
])
def test_stream_is_read_as_vllm_reads_it(flag: object, stream: bool) -> None:
    raw = json.dumps({"stream": flag, "messages": []}).encode()
    p = parse_body("chat", raw)
    assert p.stream is stream and p.strip_usage_chunk is stream
    assert (p.raw is raw) is not stream


def test_health_counters_eject_and_readmit() -> None:
    h = WorkerHealth(["a", "b"], unhealthy_after=2, healthy_after=2)
    assert h.healthy() == ["a", "b"]
    assert not h.record("a", False)
    assert h.record("a", True) is False  # a success resets the failure count
    assert not h.record("a", False)
    assert h.record("a", False) and h.healthy() == ["b"]
    assert not h.record("a", True)
    assert h.record("a", True) and h.healthy() == ["a", "b"]


def test_include_usage_is_spliced_in_without_reserializing() -> None:
    raw = (
        '{"model":"m", "stream": true,\n "messages":[{"role":"user","content":"héllo \\u00e9"}]}\n '
    )
    p = parse_body("chat", raw.encode())
    assert p.strip_usage_chunk
    # The client's bytes up to the closing brace go upstream as they were (spacing, escapes).
    body = raw.rstrip()
    assert p.raw == (body[:-1] + ',"stream_options":{"include_usage":true}}' + raw[len(body):]
                     ).encode()
    assert json.loads(p.raw)["stream_options"] == {"include_usage": True}
    assert p.obj["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("opts", "merged"),
    [
        ({"include_usage": False}, {"include_usage": True}),
        ({"continuous_usage_stats": True}, {"continuous_usage_stats": True, "include_usage": True}),
        (None, {"include_usage": True}),
    ],
)
def test_other_stream_options_are_merged(opts: object, merged: dict[str, bool]) -> None:
    raw = json.dumps({"stream": True, "stream_options": opts, "prompt": "x"}).encode()
    p = parse_body("completions", raw)
    assert p.strip_usage_chunk
    assert json.loads(p.raw) == {"stream": True, "stream_options": merged, "prompt": "x"}


def test_hop_by_hop_and_connection_listed_headers_are_not_forwarded() -> None:
    incoming = CIMultiDictProxy(CIMultiDict([
        ("Host", "proxy:8080"), ("Content-Length", "12"), ("Connection", "keep-alive, X-Trace"),
        ("Keep-Alive", "timeout=5"), ("x-trace", "1"), ("Transfer-Encoding", "chunked"),
        ("Authorization", "Bearer k"), ("X-Session-Id", "s1"), ("Accept", "a"), ("Accept", "b"),
        ("TE", "trailers"), ("Accept-Encoding", "gzip"),
    ]))
    out = request_headers(incoming, identity=True)
    assert list(out.items()) == [
        ("Authorization", "Bearer k"), ("X-Session-Id", "s1"), ("Accept", "a"), ("Accept", "b"),
        ("Accept-Encoding", "identity"),
    ]
    assert request_headers(incoming, identity=False)["accept-encoding"] == "gzip"
    upstream = CIMultiDictProxy(CIMultiDict([
        ("Content-Type", "text/event-stream"), ("Date", "x"), ("Server", "uvicorn"),
        ("Content-Length", "3"), ("Transfer-Encoding", "chunked"), ("x-request-id", "r"),
    ]))
    assert list(response_headers(upstream).items()) == [
        ("Content-Type", "text/event-stream"), ("x-request-id", "r"),
    ]


@pytest.mark.parametrize(
    "raw", [b'{"model":"m"}', b'{ "model" : "\xc3\xa9" }\n', b"{}", b"{ }\r\n"]
)
def test_splice_new_key_keeps_the_client_bytes_and_the_parse_in_step(raw: bytes) -> None:
    obj = json.loads(raw)
    out = splice_new_key(raw, obj, "priority", 2)
    assert json.loads(out) == obj and obj["priority"] == 2
    assert out.startswith(raw.rstrip()[:-1])  # everything before the brace is untouched


def test_a_lone_surrogate_survives_every_edit_of_a_body() -> None:
    """JSON allows an unpaired surrogate (clients that cut text at UTF-16 boundaries send
    one); it has no UTF-8 form, so a body the proxy edits is written with escapes instead of
    failing the request."""
    half = "half an emoji \ud83d"
    raw = json.dumps({"messages": [{"role": "user", "content": half}], "stream": True,
                      "stream_options": {"continuous_usage_stats": False}}).encode()
    parsed = parse_body("chat", raw)  # stream_options merged: the body serialized again
    sent = json.loads(parsed.raw)
    assert sent["messages"][0]["content"] == half and parsed.strip_usage_chunk
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    obj = json.loads(raw)
    assert json.loads(splice_new_key(raw, obj, "session_id", half))["session_id"] == half
    assert json.loads(set_key(raw, obj, "session_id", "other"))["session_id"] == "other"
    assert dump_json({"k": "é"}) == '{"k":"é"}'.encode()  # UTF-8 where it can be


def test_a_body_too_deep_to_write_again_is_a_400_not_a_crash() -> None:
    # json.loads took it, a few frames higher up; writing it again from deeper in the stack
    # (stream_options merged, a replaced key) must refuse it as the client's error.
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(BodyError) as err:
        dump_json({"stream": True, "extra": deep})
    assert (err.value.status, err.value.code) == (400, "invalid_json")
