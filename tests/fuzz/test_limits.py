"""Authentication, tenant scoping and every cap, over real HTTP against a live proxy.

Each cap must answer its documented status with an OpenAI-shaped body naming the cap
(docs/security.md); the admin token guards the operator endpoints; one API key never reaches
another key's session.
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The live stack comes from conftest.py (fixtures `live`, `make_live`); under importlib
# imports a test module cannot import it, so helpers ride on the Live object.
Live = Any


def _err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]


def _refused(live: Live, status: int) -> float:
    """``marsproxy_refused_total{status}`` on the proxy's /metrics (0 before the first)."""
    text = live.http.get("/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == "marsproxy_refused":
            for sample in fam.samples:
                if sample.name.endswith("_total") and sample.labels["status"] == str(status):
                    return float(sample.value)
    return 0.0


A = {"Authorization": "Bearer sk-tenant-a"}
B = {"Authorization": "Bearer sk-tenant-b"}
EVENT = {"type": "tool_start", "tool": "bash"}


# -- admin token ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/mars/v1/state", "/mars/v1/openapi.json", "/mars/v1/events", "/mars/v1/nope"]
)
def test_operator_endpoints_need_the_admin_token(live: Live, path: str) -> None:
    before = _refused(live, 401)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": live.token},
                    {"Authorization": f"Basic {live.token}"}, A):
        r = live.http.get(path, headers=headers)
        assert r.status_code == 401, (path, headers)
        assert _err(r)["code"] == "invalid_admin_token"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert _refused(live, 401) == before + 5  # every refusal is counted
    if path != "/mars/v1/events":  # the stream never ends; its 200 is checked in test_openapi
        r = live.http.get(path, headers=live.admin)
        assert r.status_code == (404 if path.endswith("nope") else 200)


def test_health_stays_open_and_metrics_only_when_asked(
    live: Live, make_live: Callable[[dict[str, Any]], Live]
) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert live.http.get(path).status_code == 200, path
    guarded = make_live({"auth": {"protect_metrics": True}})
    assert guarded.http.get("/metrics").status_code == 401
    assert guarded.http.get("/metrics", headers=guarded.admin).status_code == 200
    assert guarded.http.get("/healthz").status_code == 200


def test_no_token_configured_leaves_the_operator_endpoints_open(
    make_live: Callable[[dict[str, Any]], Live],
) -> None:
    open_ = make_live({"auth": {"admin_token": ""}})
    assert open_.http.get("/mars/v1/state").status_code == 200


# -- tenant scoping ---------------------------------------------------------------------------


def test_one_key_cannot_see_end_or_post_to_another_keys_session(live: Live) -> None:
    assert live.chat("shared-id", key="sk-tenant-a").status_code == 200
    # B: the same id names nothing of B's.
    r = live.http.post("/mars/v1/sessions/shared-id/events", json=EVENT, headers=B)
    assert r.status_code == 404 and _err(r)["code"] == "session_not_found"
    r = live.http.delete("/mars/v1/sessions/shared-id", headers=B)
    assert r.status_code == 404
    r = live.http.delete("/mars/v1/sessions/shared-id", headers={"x-api-key": "sk-tenant-b"})
    assert r.status_code == 404
    assert live.http.delete("/mars/v1/sessions/shared-id").status_code == 404  # no key at all
    # B's own session of the same id is a different session; A's is untouched by B's calls.
    assert live.chat("shared-id", key="sk-tenant-b").status_code == 200
    assert live.http.delete("/mars/v1/sessions/shared-id", headers=B).status_code == 200
    r = live.http.post("/mars/v1/sessions/shared-id/events", json=EVENT, headers=A)
    assert r.status_code == 202, r.text
    # Tenants never see each other through the session endpoints' answers either.
    assert live.http.delete("/mars/v1/sessions/shared-id", headers=B).status_code == 404
    assert live.http.delete("/mars/v1/sessions/shared-id", headers=A).status_code == 200
    # The state document shows ids without the tenant hash, and only to the operator.
    doc = live.http.get("/mars/v1/state?sessions=1", headers=live.admin).json()
    assert all("/id/" not in d["id"] for d in doc["sessions"].get("details", []))


# -- caps -------------------------------------------------------------------------------------


def test_body_cap_answers_413(make_live: Callable[[dict[str, Any]], Live]) -> None:
    live = make_live({"server": {"max_body_bytes": 2048}})
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    assert live.chat("s").status_code == 200
    for path in ("/v1/chat/completions", "/v1/embeddings", "/mars/v1/sessions/s/events"):
        r = live.http.post(path, json=big, headers=A)
        assert r.status_code == 413, path
        assert _err(r)["code"] == "body_too_large"
        assert "server.max_body_bytes" in _err(r)["message"]
    # Chunked, so the size is only known while reading.
    r = live.http.post("/v1/chat/completions", content=iter([b"{" + b" " * 1500] * 3))
    assert r.status_code == 413 and "2048" in _err(r)["message"]
    # A small gzip body that decodes past the cap (Content-Length counts encoded bytes).
    bomb = gzip.compress(json.dumps(big).encode() + b" " * 100_000)
    assert len(bomb) < 2048
    r = live.http.post("/v1/chat/completions", content=bomb,
                       headers={**A, "Content-Encoding": "gzip",
                                "Content-Type": "application/json"})
    assert r.status_code == 413 and _err(r)["code"] == "body_too_large"


def test_header_caps_answer_431(live: Live) -> None:
    cap = live.cfg.limits.max_header_bytes
    before = _refused(live, 431)
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    one_line = live.raw(head + b"X-Big: " + b"a" * (cap + 1) + b"\r\n\r\n")
    many = b"".join(b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(cap // 1000 + 2))
    total = live.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    count = b"".join(b"X-%d: 1\r\n" % i for i in range(live.cfg.limits.max_header_count + 1))
    too_many = live.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + count + b"\r\n")
    long_url = live.raw(b"GET /" + b"a" * (cap + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    for raw in (one_line, total, too_many, long_url):
        assert live.status(raw) == 431, raw[:200]
        assert b'"type": "invalid_request_error"' in raw
        assert b"limits.max_header_" in raw  # names the cap
    assert live.http.get("/healthz").status_code == 200
    assert _refused(live, 431) == before + 4


def test_connection_cap_answers_429_then_frees(
    make_live: Callable[[dict[str, Any]], Live],
) -> None:
    live = make_live({"limits": {"max_connections": 3}})
    held = [socket.create_connection((live.host, live.port)) for _ in range(3)]
    try:
        time.sleep(0.2)
        raw = live.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert live.status(raw) == 429, raw
        assert b"too_many_connections" in raw and b"limits.max_connections" in raw
        assert b"Retry-After: 1" in raw
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while live.on_loop(lambda: live.running.site.connections.open) > 0:
        assert time.monotonic() < deadline, "closed connections were never uncounted"
        time.sleep(0.02)
    assert live.http.get("/healthz").status_code == 200
    assert _refused(live, 429) >= 1  # counted in marsproxy_refused_total (read once freed)


def test_sessions_per_tenant_cap_evicts_the_least_recently_seen(
    make_live: Callable[[dict[str, Any]], Live],
) -> None:
    # One-shot sessions never ended: at the cap the next one takes the place of the key's
    # least recently seen session with nothing in flight, not a 429 (tests/unit/gateway/
    # test_gw_session_caps.py has the 429, where every one is in flight).
    live = make_live({"limits": {"max_sessions_per_tenant": 2}})
    sessions = live.running.gateway.sessions
    assert live.chat("s1").status_code == 200
    assert live.chat("s2").status_code == 200
    assert live.chat("s1").status_code == 200  # s1 seen again: s2 is the least recent now
    assert live.chat("s3").status_code == 200
    assert sorted(k.rsplit("/", 1)[1] for k in live.on_loop(sessions.keys)) == ["s1", "s3"]
    assert live.chat("s4", key="sk-other").status_code == 200  # another key's are its own
    assert live.on_loop(lambda: len(sessions)) == 3


def test_session_id_problems_answer_400(live: Live) -> None:
    too_long = "x" * (live.cfg.limits.max_session_id_chars + 1)
    for sid in (too_long, "a\x01b", "tab\there", "del\x7f", "c1\x85"):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "session_params": {"session_id": sid}}
        r = live.http.post("/v1/chat/completions", json=body, headers=A)
        assert r.status_code == 400, sid
        assert _err(r)["code"] == "invalid_session_id"
    # Path segments are opaque characters of an id, not paths.
    assert live.chat("../../etc/passwd").status_code == 200
    r = live.http.delete("/mars/v1/sessions/..%2F..%2Fetc%2Fpasswd", headers=A)
    assert r.status_code == 200 and r.json()["session"] == "../../etc/passwd"


def test_tool_event_rate_answers_429_with_retry_after(
    make_live: Callable[[dict[str, Any]], Live],
) -> None:
    live = make_live({"limits": {"session_events_per_s": 2.0, "session_events_burst": 3}})
    assert live.chat("busy").status_code == 200
    assert live.chat("calm").status_code == 200
    url = "/mars/v1/sessions/{}/events"
    got = [live.http.post(url.format("busy"), json=EVENT, headers=A).status_code for _ in range(6)]
    assert got[:3] == [202, 202, 202] and 429 in got[3:], got
    r = live.http.post(url.format("busy"), json=EVENT, headers=A)
    assert r.status_code == 429
    assert _err(r)["code"] == "session_event_rate" and "session_events_per_s" in _err(r)["message"]
    assert int(r.headers["Retry-After"]) >= 1
    # Per session: another session is not slowed by this one.
    assert live.http.post(url.format("calm"), json=EVENT, headers=A).status_code == 202
    time.sleep(0.6)  # one token back at 2/s
    assert live.http.post(url.format("busy"), json=EVENT, headers=A).status_code == 202


# -- slow clients -----------------------------------------------------------------------------


def test_slow_loris_head_is_cut_and_others_are_served(
    make_live: Callable[[dict[str, Any]], Live],
) -> None:
    live = make_live({"limits": {"header_timeout_s": 0.5}})
    with socket.create_connection((live.host, live.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        began, closed = time.monotonic(), False
        while time.monotonic() - began < 4:
            assert live.chat("meanwhile").status_code == 200  # others are served all along
            try:
                s.sendall(b"X-Drip: 1\r\n")
                s.settimeout(0.1)
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, "a client dripping its head was never cut off"


def test_slow_body_answers_408(make_live: Callable[[dict[str, Any]], Live]) -> None:
    live = make_live({"limits": {"body_timeout_s": 0.5}})
    for path in ("/v1/chat/completions", "/v1/embeddings", "/mars/v1/sessions/x/events"):
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        if path.startswith("/mars"):
            assert live.chat("x").status_code == 200
            head += "Authorization: Bearer sk-tenant-a\r\n"
        raw = live.raw(head.encode() + b'\r\n{"model":', read_timeout_s=5)
        assert live.status(raw) == 408, (path, raw)
        assert b"body_timeout" in raw and b"limits.body_timeout_s" in raw
    assert live.chat("after").status_code == 200
