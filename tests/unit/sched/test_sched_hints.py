"""Hint encoders' outputs and the vLLM body priority."""

from __future__ import annotations

from typing import Any

import pytest

from marsproxy.sched.hints import apply_vllm_priority, dynamo_priority, encode, encoders


def test_registry_names_match_config_literal() -> None:
    assert set(encoders()) == {"headers", "dynamo", "none"}


def test_headers_encoder() -> None:
    headers: dict[str, str] = {"authorization": "x"}
    body: dict[str, Any] = {"model": "m"}
    encode("headers", "sess-1", 2, 3.25, headers, body)
    assert headers == {
        "authorization": "x",
        "x-mars-session-id": "sess-1",
        "x-mars-priority": "2",
        "x-mars-kv-retain-seconds": "3.25",
    }
    assert body == {"model": "m"}


@pytest.mark.parametrize(
    ("retain", "want"), [(2.0, "2"), (0.0, "0"), (60.0, "60"), (1.5, "1.5"), (-1.0, "0")]
)
def test_headers_retention_format(retain: float, want: str) -> None:
    headers: dict[str, str] = {}
    encode("headers", "s", 0, retain, headers, {})
    assert headers["x-mars-kv-retain-seconds"] == want


def test_headers_without_retention() -> None:
    headers: dict[str, str] = {}
    encode("headers", "s", 1, None, headers, {})
    assert "x-mars-kv-retain-seconds" not in headers
    assert headers["x-mars-priority"] == "1"


def test_dynamo_encoder_merges_into_body() -> None:
    headers: dict[str, str] = {}
    body: dict[str, Any] = {"model": "m", "nvext": {"foo": 1, "agent_hints": {"osl": 128}}}
    encode("dynamo", "sess-1", 0, 4.0, headers, body)
    assert body == {
        "model": "m",
        "nvext": {"foo": 1, "agent_hints": {"osl": 128, "priority": 3, "kv_retain_seconds": 4.0}},
    }
    assert headers == {"x-mars-session-id": "sess-1"}


def test_dynamo_encoder_creates_nvext_and_leaves_odd_shapes() -> None:
    body: dict[str, Any] = {}
    encode("dynamo", "s", 3, None, {}, body)
    assert body == {"nvext": {"agent_hints": {"priority": 0}}}
    odd: dict[str, Any] = {"nvext": "client-string"}
    encode("dynamo", "s", 1, 2.0, {}, odd)
    assert odd == {"nvext": "client-string"}
    odd2: dict[str, Any] = {"nvext": {"agent_hints": [1]}}
    encode("dynamo", "s", 1, 2.0, {}, odd2)
    assert odd2 == {"nvext": {"agent_hints": [1]}}


@pytest.mark.parametrize(("lvl", "want"), [(0, 3), (1, 2), (2, 1), (3, 0), (9, 0), (-1, 3)])
def test_dynamo_polarity(lvl: int, want: int) -> None:
    assert dynamo_priority(lvl) == want


def test_none_encoder_sends_nothing() -> None:
    headers: dict[str, str] = {"a": "b"}
    body: dict[str, Any] = {"model": "m"}
    encode("none", "s", 2, 5.0, headers, body)
    assert (headers, body) == ({"a": "b"}, {"model": "m"})


def test_unknown_encoder() -> None:
    with pytest.raises(ValueError, match="unknown hint encoder 'grpc'"):
        encode("grpc", "s", 0, None, {}, {})


def test_vllm_priority_override_and_respect() -> None:
    body: dict[str, Any] = {"priority": -5}
    assert apply_vllm_priority(body, 2, override_client=True) == 2
    assert body["priority"] == 2
    body = {"priority": -5}
    assert apply_vllm_priority(body, 2, override_client=False) == -5
    assert body["priority"] == -5
    body = {}
    assert apply_vllm_priority(body, 1, override_client=False) == 1
    assert body == {"priority": 1}
    for odd in ("high", True, 1.5):
        body = {"priority": odd}
        assert apply_vllm_priority(body, 3, override_client=False) == 3
        assert body["priority"] == 3
