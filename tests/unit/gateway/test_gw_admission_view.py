"""What admission hears and shows: worker signals from probe snapshots, the state's admission
object in Prometheus and in ``marsproxy status``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.aimd.admission import WorkerSignals
from marsproxy.cli.status_render import render_state
from marsproxy.gateway.shells.observations import observation
from marsproxy.policy.observe import admission_signals
from marsproxy.probes.tool_signal import ToolCpuSignals
from marsproxy.probes.vllm_metrics import WorkerMetrics
from marsproxy.probes.vllm_rates import WorkerRates
from marsproxy.probes.vllm_scraper import WorkerPressure
from marsproxy.telemetry.prometheus import StateCollector
from marsproxy.telemetry.state import AdmissionState, StateDoc


def worker_signals(p: WorkerPressure | None, *, healthy: bool, tools: ToolCpuSignals,
                   tool_cpus: float, retained_blocks: int = 0,
                   sessions_elsewhere: int = 0) -> WorkerSignals:
    """The admission core's view of one worker, from its scrape, as the gateway builds it."""
    return admission_signals(observation(p, healthy=healthy), tools, tool_cpus,
                             retained_blocks=retained_blocks,
                             sessions_elsewhere=sessions_elsewhere)


def _pressure(metrics: WorkerMetrics | None, *, stale: bool = False,
              errors: int = 0, rates: WorkerRates | None = None) -> WorkerPressure:
    return WorkerPressure("w0", metrics, rates or WorkerRates(), stale, None, errors, None)




def test_signals_from_a_fresh_vllm_sample() -> None:
    m = WorkerMetrics(sampled_at=0.0, kv_usage=0.25, block_size=16, num_gpu_blocks=1000,
                      running=3, preemptions_total=7.0)
    s = worker_signals(_pressure(m, rates=WorkerRates(prefill_tokens_per_s=5000.0)),
                       healthy=True, tools=ToolCpuSignals(), tool_cpus=4.0)
    assert not s.stale and s.kv_usage == 0.25
    assert s.free_blocks == 750 and s.total_blocks == 1000 and s.block_size == 16
    assert s.running == 3 and s.preemptions_total == 7.0
    assert s.prefill_tokens_per_s == 5000.0  # what a preemption costs (peak_cheap_reprefill_s)
    assert s.tool_cpus == 4.0 and s.psi_some_avg10 is None


def test_not_yet_scraped_is_stale_but_a_worker_without_metrics_is_not() -> None:
    t = ToolCpuSignals()
    unseen = worker_signals(_pressure(None), healthy=True, tools=t, tool_cpus=1.0)
    assert unseen.stale
    blind = worker_signals(_pressure(None, errors=3), healthy=True, tools=t, tool_cpus=1.0)
    # Placeable, KV unknown: the controller reads it as full and keeps it at window_min.
    assert not blind.stale and blind.kv_usage is None and blind.free_blocks is None
    old = WorkerMetrics(sampled_at=0.0, kv_usage=0.1)
    gone = worker_signals(_pressure(old, stale=True, errors=5), healthy=True, tools=t,
                          tool_cpus=1.0)
    assert gone.stale  # had samples, stopped answering: fail closed


def _admission() -> AdmissionState:
    row = {
        "window": 8, "effective_limit": 6, "limit": 5, "kv_cap": 6, "cpu_cap": 30,
        "kv_overloaded": True, "cpu_overloaded": False, "stale": False, "budget_blocks": 40,
        "peak_room_blocks": 40, "peak_overlap": 1.0, "peak_overcommit": 1.0, "reprefill_s": None,
        "idle_s": None,
        "admitted": 5, "held": 5, "admitted_store": 7,
        "sessions": ["a", "b"],
    }
    return {
        "enabled": True,
        "peak_growth": 2.0,
        "session_lifetime_s": None,
        "returns": {},
        "workers": {"w0": row, "w1": {**row, "kv_overloaded": False, "admitted": 1,
                                      "peak_overcommit": 1.6}},  # type: ignore[typeddict-item]
        "queue": {"length": 3, "pending": 1, "mode": "shortest_first", "order": ["x", "y", "z"],
                  "admission_rate_per_s": 0.5, "retry_after_s": 8},
        "store": {"backend": "redis", "mode": "shared", "up": True, "is_leader": True,
                  "live_replicas": 2, "failures_total": 0},
    }


def _doc(with_admission: bool) -> StateDoc:
    doc: StateDoc = {
        "time": 0.0, "version": "x", "workers": [],
        "cpu": {"source": "", "psi_some_avg10": None, "psi_some_avg60": None,
                "throttled_usec": None, "cpu_percent": None, "tool_cpus": 1.0},
        "tools": {"in_flight": 0, "backlog_ratio": 0.0, "queue_wait_ema_s": 0.0,
                  "slowdown_ema": 1.0},
        "sessions": {"total": 0, "by_state": {}},
        "events": {"published_total": 0, "dropped_total": 0, "subscribers": 0},
    }
    if with_admission:
        doc["admission"] = _admission()
    return doc


def _families(doc: StateDoc) -> dict[str, Any]:
    reg = CollectorRegistry()
    StateCollector(lambda: doc).register(reg)
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def test_collector_exports_admission() -> None:
    fams = _families(_doc(True))
    limit = {s.labels["worker"]: s.value for s in fams["marsproxy_admission_limit"].samples}
    assert limit == {"w0": 5.0, "w1": 5.0}
    admitted = {s.labels["worker"]: s.value
                for s in fams["marsproxy_admission_admitted"].samples}
    assert admitted == {"w0": 5.0, "w1": 1.0}
    assert fams["marsproxy_admission_window"].samples[0].value == 8
    kv = {s.labels["worker"]: s.value for s in fams["marsproxy_admission_kv_cap"].samples}
    cpu = {s.labels["worker"]: s.value for s in fams["marsproxy_admission_cpu_cap"].samples}
    assert kv == {"w0": 6.0, "w1": 6.0} and cpu == {"w0": 30.0, "w1": 30.0}
    ovc = {s.labels["worker"]: s.value
           for s in fams["marsproxy_admission_peak_overcommit"].samples}
    assert ovc == {"w0": 1.0, "w1": 1.6}
    assert fams["marsproxy_admission_queue_length"].samples[0].value == 4  # queued + pending
    assert fams["marsproxy_store_up"].samples[0].value == 1
    assert "marsproxy_admission_window" not in _families(_doc(False))


def test_status_shows_admission_and_tolerates_its_absence() -> None:
    text = render_state(_doc(True), 160)  # type: ignore[arg-type]
    line = next(ln for ln in text.splitlines() if ln.startswith("Admission"))
    assert "w0 5/5 win 8 (kv overload)" in line and "w1 1/5 win 8 fit x1.60" in line
    queue = next(ln for ln in text.splitlines() if ln.startswith("Queue"))
    assert "waiting 3" in queue and "pending 1" in queue and "redis/shared leader" in queue
    plain = render_state(_doc(False), 160)  # type: ignore[arg-type]
    assert "Admission" not in plain
    broken = render_state({"admission": {"workers": {"w0": None}, "queue": 7}}, 80)
    assert "w0 -/- win -" in broken
    # No count bound (not overloaded, no window_max): the limit reads as such, not as 2^20.
    free = _doc(True)
    free["admission"]["workers"]["w1"] = {  # type: ignore[typeddict-item]
        **free["admission"]["workers"]["w1"], "limit": 1 << 20, "binds": "none"}
    line = next(ln for ln in render_state(free, 160).splitlines()  # type: ignore[arg-type]
                if ln.startswith("Admission"))
    assert "w1 1/∞ win 8" in line and "w0 5/5" in line
