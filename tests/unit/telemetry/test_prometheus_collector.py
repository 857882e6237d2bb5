"""The state collector turns a state document into well-typed, bounded metric families."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.telemetry.prometheus import StateCollector
from marsproxy.telemetry.state import StateDoc, WorkerState


def _worker(name: str, **kw: object) -> WorkerState:
    w: WorkerState = {
        "name": name, "url": f"http://{name}:8000", "healthy": True, "stale": False,
        "age_s": 0.1, "kv_usage": 0.5, "running": 3, "waiting": 1, "preemptions_per_s": None,
        "prefix_cache_hit_rate": None, "prefill_tokens_per_s": None, "block_size": 16,
        "num_gpu_blocks": 100, "scrape_errors": 2, "sessions": 1, "requests_in_flight": 3,
        "gpu": {"available": False, "memory_used_frac": None, "utilization_pct": None},
    }
    w.update(kw)  # type: ignore[typeddict-item]
    return w


def _doc() -> StateDoc:
    return {
        "time": 0.0, "version": "x",
        "workers": [_worker("a"), _worker("b", stale=True, kv_usage=None, age_s=None)],
        "cpu": {"source": "host_psi", "psi_some_avg10": 12.5, "psi_some_avg60": 3.0,
                "throttled_usec": None, "cpu_percent": None, "tool_cpus": 4.0},
        "tools": {"in_flight": 2, "backlog_ratio": 0.5, "queue_wait_ema_s": 0.25,
                  "slowdown_ema": 1.5},
        "sessions": {"total": 3, "by_state": {"llm": 1, "tool": 2, "idle": 0}},
        "events": {"published_total": 10, "dropped_total": 4, "subscribers": 1},
    }


def test_collector_exports_the_document() -> None:
    reg = CollectorRegistry()
    StateCollector(_doc).register(reg)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    kv = {s.labels["worker"]: s.value for s in fams["marsproxy_worker_kv_usage_ratio"].samples}
    assert kv == {"a": 0.5}  # unknown → no sample, not a made-up 0
    stale = {s.labels["worker"]: s.value for s in fams["marsproxy_worker_stale"].samples}
    assert stale == {"a": 0.0, "b": 1.0}
    assert fams["marsproxy_worker_scrape_errors"].type == "counter"
    assert fams["marsproxy_worker_scrape_errors"].samples[0].name.endswith("_total")
    assert fams["marsproxy_cpu_pressure_some_avg10"].samples[0].value == 12.5
    sessions = {s.labels["state"]: s.value for s in fams["marsproxy_sessions"].samples}
    assert sessions == {"llm": 1, "tool": 2, "idle": 0}
    assert fams["marsproxy_events_dropped"].samples[0].value == 4
    assert fams["marsproxy_events_dropped"].samples[0].name == "marsproxy_events_dropped_total"
    assert fams["marsproxy_tool_slowdown_ratio"].samples[0].value == 1.5
