"""Which unscheduled paths the proxy relays: the pure classification of routes.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from marsproxy.gateway.http.bodies import SCHEDULED_ROUTES
from marsproxy.gateway.http.routes import INFERENCE_ROUTES, OPERATOR_ROUTES, classify
from marsproxy.security_config import AuthConfig


@pytest.mark.parametrize("path", sorted(INFERENCE_ROUTES))
def test_inference_routes_are_relayed_with_any_method(path: str) -> None:
    for method in ("GET", "POST", "OPTIONS"):
        assert classify(method, path) == "relay"


def test_the_default_list_holds_what_clients_use() -> None:
    for path in ("/v1/models", "/v1/embeddings", "/tokenize", "/detokenize", "/health",
                 "/version", "/ping", "/pooling", "/classify", "/score", "/v1/score",
                 "/rerank", "/v1/rerank", "/v2/rerank", "/v1/audio/transcriptions",
                 "/v1/audio/translations", "/invocations"):
        assert path in INFERENCE_ROUTES, path
    assert not INFERENCE_ROUTES & OPERATOR_ROUTES
    assert not INFERENCE_ROUTES & set(SCHEDULED_ROUTES)


def test_stored_responses_are_relayed_by_prefix() -> None:
    assert classify("GET", "/v1/responses/resp_1") == "relay"
    assert classify("POST", "/v1/responses/resp_1/cancel") == "relay"


@pytest.mark.parametrize("path", sorted(SCHEDULED_ROUTES))
def test_scheduled_routes_with_another_method_are_405_but_preflight_passes(path: str) -> None:
    for method in ("GET", "HEAD", "PUT", "DELETE"):
        assert classify(method, path) == "wrong_method"
    assert classify("OPTIONS", path) == "relay"


@pytest.mark.parametrize("path", [
    "/scale_elastic_ep", "/pause", "/sleep", "/wake_up", "/reset_prefix_cache",
    "/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile",
    "/stop_profile", "/update_weights", "/server_info", "/openapi.json",
])
def test_operator_routes_are_refused_unless_listed(path: str) -> None:
    assert classify("POST", path) == "operator"
    assert classify("POST", path, [path]) == "relay"
    assert classify("POST", path, ["/*"]) == "relay"


@pytest.mark.parametrize("path", [
    "/", "/anything", "/v1/models/", "/V1/MODELS", "//v1/models", "/v1/modelsx", "/sleep/",
    "/v1/embeddings/x", "/metrics", "/v1/realtime",
])
def test_everything_else_is_unknown(path: str) -> None:
    # Exact matches only: a trailing slash, another case or a longer path is another route.
    assert classify("GET", path) == "unknown", path


def test_listed_entries_are_exact_or_a_prefix_ending_in_a_star() -> None:
    listed = ["/custom", "/ops/*"]
    assert classify("GET", "/custom", listed) == "relay"
    assert classify("GET", "/custom/more", listed) == "unknown"
    assert classify("GET", "/ops/", listed) == "relay"
    assert classify("DELETE", "/ops/a/b", listed) == "relay"
    assert classify("GET", "/ops", listed) == "unknown"
    assert classify("GET", "/sleep", listed) == "operator"


def test_a_listed_route_must_be_a_path() -> None:
    assert AuthConfig(passthrough_routes=("/sleep", "/ops/*")).passthrough_routes == (
        "/sleep", "/ops/*")
    with pytest.raises(ValidationError, match="starts with '/'"):
        AuthConfig(passthrough_routes=("sleep",))
