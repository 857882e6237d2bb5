"""Hostile input against every route: property-based bodies and headers (hypothesis), and a
corpus of malformed HTTP. The proxy must answer each with a 4xx (OpenAI-shaped when it is the
proxy's own answer), never a 500 of its own, never crash, and leave other sessions alone.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

Live = Any  # the live stack (conftest.py): a module here cannot import conftest under importlib

SETTINGS = settings(
    max_examples=int(os.environ.get("MARSPROXY_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

MSG = [{"role": "user", "content": "hi"}]
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny-emulated", "messages": MSG, "max_tokens": 2},
    "/v1/completions": {"model": "tiny-emulated", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "tiny-emulated", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny-emulated", "messages": MSG, "max_tokens": 2},
}
# Every body field the proxy itself reads (identity, history, streaming), plus the usual ones.
FIELDS = [
    "messages", "prompt", "input", "instructions", "system", "max_tokens", "stream",
    "stream_options", "priority", "session_params", "prompt_cache_key", "user", "model",
    "metadata",
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)


# The emulated worker serves no /v1/responses: the proxy still reads those bodies (identity,
# history) before relaying, and the worker's 404 comes back, vLLM's {"detail":"Not Found"}.
# /v1/messages errors raised while serving come in Anthropic's shape, which also has
# error.message and error.type.
UNSERVED = {"/v1/responses"}


def _proxy_error_ok(r: Any, path: str) -> None:
    """Not a 500 (the proxy's or the worker's), and an error body in the OpenAI shape."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code == 404 and path in UNSERVED and r.text == '{"detail":"Not Found"}':
        return
    if r.status_code >= 400:
        err = r.json()["error"]
        assert "message" in err and "type" in err, r.text


@SETTINGS
@given(
    path=st.sampled_from(sorted(ROUTES)),
    field=st.sampled_from(FIELDS),
    value=json_values,
    stream=st.booleans(),
)
def test_wrong_types_in_every_field(live: Live, path: str, field: str, value: Any,
                                    stream: bool) -> None:
    body = {**ROUTES[path], "stream": stream, field: value}
    r = live.http.post(path, json=body, headers={"Authorization": "Bearer sk-fuzz"})
    _proxy_error_ok(r, path)


@SETTINGS
@given(path=st.sampled_from([*ROUTES, "/v1/models", "/mars/v1/sessions/x/events"]),
       raw=st.binary(max_size=300))
def test_arbitrary_bytes_as_body(live: Live, path: str, raw: bytes) -> None:
    r = live.http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300])


@SETTINGS
@given(
    name=st.sampled_from([
        "x-session-id", "x-session-final", "authorization", "x-api-key", "session_id",
        "x-claude-code-session-id", "content-type", "accept-encoding", "connection",
        "transfer-encoding", "content-length", "host", "expect", "upgrade",
    ]),
    value=st.binary(min_size=0, max_size=60).filter(lambda b: b"\r" not in b and b"\n" not in b),
)
def test_hostile_header_values(live: Live, name: str, value: bytes) -> None:
    body = json.dumps(ROUTES["/v1/chat/completions"]).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + name.encode() + b": " + value
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % len(body)
    )
    raw = live.raw(head + body)
    status = live.status(raw)
    framing = name in ("content-length", "transfer-encoding")  # may leave the body unread
    assert 0 < status < 500 or (status == 0 and framing), raw
    if status >= 400:
        assert b'"error"' in raw, raw


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sid=st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80
).filter(lambda s: s not in _DOT_SEGMENTS))
def test_any_valid_session_id_can_be_ended_by_its_owner(live: Live, sid: str) -> None:
    from urllib.parse import quote

    assert live.chat(sid, key="sk-owner").status_code == 200
    path = f"/mars/v1/sessions/{quote(sid, safe='')}"
    intruder = live.http.delete(path, headers={"Authorization": "Bearer sk-intruder"})
    assert intruder.status_code == 404
    r = live.http.delete(path, headers={"Authorization": "Bearer sk-owner"})
    assert r.status_code == 200 and r.json()["session"] == sid, (sid, r.text)


_DOT_SEGMENTS = (".", "..")


@pytest.mark.parametrize("sid", _DOT_SEGMENTS)
def test_a_dot_segment_session_id_cannot_be_addressed_in_a_path(live: Live, sid: str) -> None:
    # Clients drop "." and ".." path segments, and the proxy refuses them even encoded
    # (docs/security.md): such a session is served, and ends by its final call or idle timeout.
    assert live.chat(sid, key="sk-owner").status_code == 200
    r = live.http.delete(f"/mars/v1/sessions/{sid.replace('.', '%2E')}",
                         headers={"Authorization": "Bearer sk-owner"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path", r.text


# -- a corpus of malformed requests ------------------------------------------------------------

_BODY = json.dumps(ROUTES["/v1/chat/completions"]).encode()


def _post(path: bytes, extra: bytes = b"", body: bytes = _BODY) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
        + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


def _chat(obj: Any) -> bytes:
    return _post(b"/v1/chat/completions", body=json.dumps(obj).encode())


CORPUS: list[tuple[str, bytes, set[int]]] = [
    ("deeply nested array", _post(b"/v1/chat/completions", body=b"[" * 200_000), {400}),
    ("deeply nested object", _post(b"/v1/messages", body=b'{"a":' * 50_000), {400}),
    ("nested under messages", _post(b"/v1/chat/completions",
        body=b'{"model":"m","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"), {400}),
    ("invalid utf-8 body", _post(b"/v1/chat/completions", body=b'{"model":"\xff\xfe"}'), {400}),
    ("lone surrogate", _chat({**ROUTES["/v1/chat/completions"],
                              "messages": [{"role": "user", "content": "\ud800"}]}), {200, 400}),
    ("huge token ids", _post(b"/v1/completions", body=b'{"model":"tiny-emulated","prompt":'
                             b'[99999999999999999999],"max_tokens":2}'), {400}),
    ("body is a string", _post(b"/v1/responses", body=b'"hi"'), {400}),
    ("empty body", _post(b"/v1/chat/completions", body=b""), {400}),
    ("content-length lies short", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 5\r\n\r\n" + _BODY, {400}),
    ("huge content-length", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 99999999999\r\n\r\n{}", {413}),
    ("negative content-length", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: -1\r\n\r\n{}", {400}),
    ("two content-lengths", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", {400}),
    ("smuggling CL+TE", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", {400}),
    ("gzip that is not gzip", _post(b"/v1/chat/completions", b"Content-Encoding: gzip\r\n"), {400}),
    ("gzip body", _post(b"/v1/chat/completions", b"Content-Encoding: gzip\r\n",
                        gzip.compress(_BODY)), {200}),
    ("gzip body passed through", _post(b"/v1/completions", b"Content-Encoding: gzip\r\n",
        gzip.compress(json.dumps(ROUTES["/v1/completions"]).encode())), {200}),
    ("bad chunk size", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", {400}),
    ("header injection, bare CR", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        b"X-Session-Id: a\rInjected: 1\r\n\r\n", {400}),
    ("header injection, bare LF", _post(b"/v1/chat/completions", b"X-Session-Id: a\nX-Evil: 1\r\n"),
        {200, 400}),
    ("NUL in a header", _post(b"/v1/chat/completions", b"X-Session-Id: a\x00b\r\n"), {400}),
    ("obs-fold header", _post(b"/v1/chat/completions", b"X-Session-Id: a\r\n b\r\n"), {400}),
    ("space before colon", _post(b"/v1/chat/completions", b"X-Session-Id : a\r\n"), {400}),
    ("control char session id in body", _chat({"model": "m", "messages": MSG,
        "session_params": {"session_id": "a\u0007b"}}), {400}),
    ("session id too long", _chat({"model": "m", "messages": MSG, "user": "u" * 5000}), {400}),
    ("final flag garbage", _post(b"/v1/chat/completions", b"X-Session-Final: \xff\xff\r\n"),
        {400}),
    ("unknown method", b"BREW /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("not HTTP at all", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, {400}),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {400, 404, 405, 505}),
    ("unknown admin route", b"GET /mars/v1/nothing HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer adm-Tok3n-for-tests\r\n\r\n", {404}),
    ("admin wrong method", b"PUT /mars/v1/state HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer adm-Tok3n-for-tests\r\nContent-Length: 0\r\n\r\n", {405}),
    ("dot segments to admin", b"GET /v1/../mars/v1/state HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("encoded dot segments", b"GET /v1/%2e%2E/mars/v1/state HTTP/1.1\r\nHost: x\r\n\r\n",
        {400}),
    ("dot segment to a worker", b"GET /v1/./models HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("session id with NUL in path", b"DELETE /mars/v1/sessions/%00 HTTP/1.1\r\nHost: x\r\n\r\n",
        {404}),
    ("absolute-form URI", b"GET http://evil.example/mars/v1/state HTTP/1.1\r\nHost: x\r\n\r\n",
        {401}),
    ("tool event wrong types", _post(b"/mars/v1/sessions/x/events",
        body=b'{"type":1,"tool":[],"ts":"now","queue_wait_s":-1}'), {400, 404}),  # 404 unless
    # an earlier entry left a session "x" open: then the body's types are what is wrong
    ("state with a silly limit", b"GET /mars/v1/state?limit=" + b"9" * 5000
        + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer adm-Tok3n-for-tests\r\n\r\n", {400}),
    ("events with unknown type", b"GET /mars/v1/events?type=%00,nope HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer adm-Tok3n-for-tests\r\n\r\n", {400}),
    ("metrics with a body", b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
        {200}),
]


@pytest.mark.parametrize(("name", "raw", "expected"), CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_corpus(live: Live, name: str, raw: bytes, expected: set[int]) -> None:
    got = live.raw(raw)
    status = live.status(got)
    assert status in expected, (name, got[:400])
    if status >= 400:
        head, _, body = got.partition(b"\r\n\r\n")
        assert b"application/json" in head, (name, got[:400])
        err = json.loads(body)["error"]
        assert {"message", "type", "param", "code"} <= set(err), (name, body)
    assert live.http.get("/healthz").status_code == 200  # still up


def test_a_well_behaved_session_is_untouched_by_the_noise(live: Live) -> None:
    """Turns of one session, streaming, while the whole corpus is thrown at the proxy."""
    turns, results, errors = 12, [], []

    def agent() -> None:
        try:
            msgs: list[dict[str, Any]] = []
            for i in range(turns):
                msgs.append({"role": "user", "content": f"turn {i}"})
                body = {"model": "tiny-emulated", "messages": msgs, "max_tokens": 3,
                        "stream": True, "stream_options": {"include_usage": True}}
                with live.http.stream(
                    "POST", "/v1/chat/completions", json=body,
                    headers={"Authorization": "Bearer sk-good", "x-session-id": "good-agent"},
                ) as r:
                    text = "".join(r.iter_text())
                usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
                         if line.startswith("data: {") and '"usage":{' in line]
                results.append((r.status_code, usage[-1]["completion_tokens"] if usage else None))
                msgs.append({"role": "assistant", "content": "ok"})
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    t = threading.Thread(target=agent)
    t.start()
    for _ in range(2):
        for _, raw, _ in CORPUS:
            live.raw(raw)
    t.join(60)
    assert not errors, errors
    assert results == [(200, 3)] * turns
    assert live.session_turns("good-agent") == turns
    key = next(k for k in live.on_loop(live.running.gateway.sessions.keys)
               if k.endswith("/id/good-agent"))
    assert live.on_loop(lambda: live.running.gateway.placement.worker_of(key)) is not None
