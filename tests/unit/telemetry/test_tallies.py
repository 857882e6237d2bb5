"""The request path's lock-free metrics expose exactly what prometheus_client's own would."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.telemetry.tallies import Distribution, Tally, TallyCollector


def _without_created(text: bytes) -> str:
    # _created holds the creation time of each child, which differs between the two.
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())


def test_exposition_matches_prometheus_client() -> None:
    ref, fast = CollectorRegistry(), CollectorRegistry()
    c1 = Counter("t_requests", "Requests.", ["route", "code"], registry=ref)
    h1 = Histogram("t_seconds", "Time.", ["route"], buckets=(0.1, 1, 2.5), registry=ref)
    c2 = Tally("t_requests", "Requests.", ["route", "code"])
    h2 = Distribution("t_seconds", "Time.", ["route"], (0.1, 1, 2.5))
    TallyCollector([c2, h2]).register(fast)
    assert _without_created(generate_latest(ref)) == _without_created(generate_latest(fast))
    # Values on the bucket bounds, between them, above the last, zero; two children each.
    for v in (0.0, 0.05, 0.1, 0.5, 1.0, 2.5, 3.0, 100.0):
        for route in ("chat", "messages"):
            c1.labels(route, "200").inc(v)
            c2.labels(route, "200").inc(v)
            h1.labels(route).observe(v)
            h2.labels(route).observe(v)
    c1.labels("chat", "503").inc()
    c2.labels("chat", "503").inc()
    got = _without_created(generate_latest(fast))
    assert got == _without_created(generate_latest(ref))
    assert 't_seconds_bucket{le="1.0",route="chat"} 5.0' in got


def test_misuse_is_refused_as_by_prometheus_client() -> None:
    t = Tally("t_x", "X.", ["a"])
    with pytest.raises(ValueError):
        t.labels("a", "b")
    with pytest.raises(ValueError):
        t.labels("a").inc(-1)
    with pytest.raises(ValueError):
        Distribution("t_h", "H.", ["a"], (1.0,)).labels()
    reg = CollectorRegistry()
    Gauge("t_x_total", "Clash.", registry=reg)
    with pytest.raises(ValueError):  # the registry sees the collector's names
        TallyCollector([t]).register(reg)


def test_gateway_metrics_render_request_path_metrics() -> None:
    m = GatewayMetrics()
    m.in_flight.inc()
    m.in_flight.inc()
    m.in_flight.dec()
    m.requests.labels("chat", "200").inc()
    m.latency.labels("chat").observe(0.02)
    m.tool_duration.labels("true").observe(3.0)
    text = m.render().decode()
    assert "marsproxy_requests_in_flight 1.0" in text
    assert 'marsproxy_requests_total{code="200",route="chat"} 1.0' in text
    assert 'marsproxy_request_duration_seconds_bucket{le="0.025",route="chat"} 1.0' in text
    assert 'marsproxy_tool_duration_seconds_count{inferred="true"} 1.0' in text
    assert "# TYPE marsproxy_ttft_seconds histogram" in text  # no child yet: still described
