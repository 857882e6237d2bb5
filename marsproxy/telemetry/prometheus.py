"""Prometheus export of the information stream: a collector that reads the state at scrape time.

Gauges of worker pressure, CPU, tools and sessions are not updated per request or per probe
sample; each scrape of ``/metrics`` builds the state document once (the same one
``GET /mars/v1/state`` serves) and turns it into metric families. Labels are bounded: worker
names from config and the three session states. Never a session id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from marsproxy.telemetry.kv_index import kv_index_metrics
from marsproxy.telemetry.state import SESSION_STATES, AdmissionState, StateDoc, WorkerState

_WORKER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("marsproxy_worker_kv_usage_ratio", "kv_usage", "KV cache usage of the worker, 0..1."),
    ("marsproxy_worker_requests_running", "running", "Requests the worker runs now."),
    ("marsproxy_worker_requests_waiting", "waiting", "Requests queued in the worker."),
    (
        "marsproxy_worker_sample_age_seconds",
        "age_s",
        "Age of the worker's last good /metrics sample.",
    ),
)


class StateCollector(Collector):
    """Exports the state document built by ``state()`` at every scrape."""

    def __init__(self, state: Callable[[], StateDoc]) -> None:
        self._state = state

    def register(self, registry: CollectorRegistry) -> StateCollector:
        registry.register(self)
        return self

    def describe(self) -> list[Metric]:
        # No description: the registry would otherwise call collect() at registration time,
        # before the gateway's probes exist.
        return []

    def collect(self) -> Iterator[Metric]:
        doc = self._state()
        yield from _workers(doc["workers"])
        cpu = GaugeMetricFamily(
            "marsproxy_cpu_pressure_some_avg10",
            "CPU pressure (PSI 'some' avg10, percent 0..100) where tools run.",
        )
        if doc["cpu"]["psi_some_avg10"] is not None:
            cpu.add_metric([], doc["cpu"]["psi_some_avg10"])
        yield cpu
        yield _gauge("marsproxy_tool_cpus", "CPUs available to tools.", doc["cpu"]["tool_cpus"])
        tools = doc["tools"]
        yield _gauge("marsproxy_tools_in_flight", "Tool phases open now.", tools["in_flight"])
        yield _gauge(
            "marsproxy_tool_backlog_ratio",
            "Tools in flight / tool CPUs.",
            tools["backlog_ratio"],
        )
        yield _gauge(
            "marsproxy_tool_queue_wait_ema_seconds",
            "EMA of tool queue wait reported by agents.",
            tools["queue_wait_ema_s"],
        )
        yield _gauge(
            "marsproxy_tool_slowdown_ratio",
            "EMA of tool duration / usual duration of its kind (> 1: tools contend).",
            tools["slowdown_ema"],
        )
        sessions = GaugeMetricFamily(
            "marsproxy_sessions",
            "Sessions remembered, by state (llm: request in flight; tool: in a tool phase).",
            labels=["state"],
        )
        for st in SESSION_STATES:
            sessions.add_metric([st], doc["sessions"]["by_state"].get(st, 0))
        yield sessions
        ev = doc["events"]
        yield _counter("marsproxy_events_published", "Events published on the bus.",
                       ev["published_total"])
        yield _counter(
            "marsproxy_events_dropped",
            "Events slow subscribers lost (the bus ring overran them).",
            ev["dropped_total"],
        )
        yield _gauge("marsproxy_event_subscribers", "Open bus subscriptions.", ev["subscribers"])
        yield from _scheduler(doc)
        if "admission" in doc:
            yield from _admission(doc["admission"])
        if "kv_index" in doc:
            yield from kv_index_metrics(doc["kv_index"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _workers(workers: list[WorkerState]) -> Iterator[Metric]:
    for name, key, doc in _WORKER_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["worker"])
        for w in workers:
            v = w[key]  # type: ignore[literal-required]
            if v is not None:  # unknown: no sample rather than a made-up number
                fam.add_metric([w["name"]], float(v))
        yield fam
    stale = GaugeMetricFamily(
        "marsproxy_worker_stale",
        "1 when the worker's sample is older than stale_after_s (treated as saturated).",
        labels=["worker"],
    )
    errors = CounterMetricFamily(
        "marsproxy_worker_scrape_errors", "Failed /metrics scrapes of the worker.",
        labels=["worker"],
    )
    gpu_mem = GaugeMetricFamily(
        "marsproxy_worker_gpu_memory_used_ratio",
        "Memory used on the fullest GPU of the worker (NVML), 0..1.",
        labels=["worker"],
    )
    gpu_util = GaugeMetricFamily(
        "marsproxy_worker_gpu_utilization_percent",
        "Mean GPU utilization of the worker's GPUs (NVML), 0..100.",
        labels=["worker"],
    )
    for w in workers:
        stale.add_metric([w["name"]], 1.0 if w["stale"] else 0.0)
        errors.add_metric([w["name"]], w["scrape_errors"])
        if w["gpu"]["memory_used_frac"] is not None:
            gpu_mem.add_metric([w["name"]], w["gpu"]["memory_used_frac"])
        if w["gpu"]["utilization_pct"] is not None:
            gpu_util.add_metric([w["name"]], w["gpu"]["utilization_pct"])
    yield from (stale, errors, gpu_mem, gpu_util)


_ADMISSION_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("marsproxy_admission_window", "window", "AIMD admission window of the worker (sessions)."),
    (
        "marsproxy_admission_limit",
        "limit",
        "Sessions the worker may hold now, as the store enforces it (the leader's published"
        " limit with several replicas): the caps and window_max, and the window while the worker"
        " is overloaded; 1048576 (2^20) when nothing bounds the count.",
    ),
    (
        "marsproxy_admission_kv_cap",
        "kv_cap",
        "Sessions the worker's KV budget fits now (the KV cap on the window).",
    ),
    (
        "marsproxy_admission_cpu_cap",
        "cpu_cap",
        "Sessions the tool CPUs carry now (the CPU cap on the window).",
    ),
    (
        "marsproxy_admission_admitted",
        "admitted",
        "Sessions this replica holds admitted on the worker (sum over replicas for the total).",
    ),
    (
        "marsproxy_admission_peak_overcommit",
        "peak_overcommit",
        "Factor the forecast-peak fit uses on the worker now (from the measured overlap, or"
        " peak_overcommit_max while a preemption there is cheap; 1: the strict fit).",
    ),
)


def _admission(adm: AdmissionState) -> Iterator[Metric]:
    for name, key, doc in _ADMISSION_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["worker"])
        for worker, row in adm["workers"].items():
            fam.add_metric([worker], float(row[key]))  # type: ignore[literal-required]
        yield fam
    q = adm["queue"]
    yield _gauge(
        "marsproxy_admission_queue_length",
        "Sessions waiting for admission on this replica (queued, or pending the store).",
        q["length"] + q["pending"],
    )
    yield _gauge(
        "marsproxy_store_up",
        "1 while the admission state store is reachable (the memory store always is).",
        1.0 if adm["store"]["up"] else 0.0,
    )


def _scheduler(doc: StateDoc) -> Iterator[Metric]:
    """Dispatch queues, in-flight, KV ledger and priority mode per worker; warm-resume rate."""
    queue = GaugeMetricFamily(
        "marsproxy_dispatch_queue_length",
        "Continuations held in the worker's gated dispatch queue.", labels=["worker"])
    in_flight = GaugeMetricFamily(
        "marsproxy_dispatch_in_flight",
        "Continuations the scheduler counts running on the worker.", labels=["worker"])
    ledger = GaugeMetricFamily(
        "marsproxy_kv_ledger_blocks",
        "KV blocks reserved for retained dormant sessions on the worker (off the admission"
        " budget).", labels=["worker"])
    held = GaugeMetricFamily(
        "marsproxy_kv_ledger_reservations",
        "Retained dormant sessions on the worker.", labels=["worker"])
    mode = GaugeMetricFamily(
        "marsproxy_worker_priority_mode",
        "1 for the worker's priority mode (priority: body priority; gated: proxy queue; off:"
        " no levels).",
        labels=["worker", "mode"])
    for w in doc["workers"]:
        if "scheduler" not in w:
            continue
        s = w["scheduler"]
        queue.add_metric([w["name"]], s["queue_length"])
        in_flight.add_metric([w["name"]], s["in_flight"])
        ledger.add_metric([w["name"]], s["retained_blocks"])
        held.add_metric([w["name"]], len(s["reservations"]))
        mode.add_metric([w["name"], s["mode"]], 1.0)
    yield from (queue, in_flight, ledger, held, mode)
    rate = GaugeMetricFamily(
        "marsproxy_warm_resume_hit_rate",
        "Share of resumed continuations whose prompt the worker found cached (warm), 0..1.")
    hit = doc["scheduler"]["resumes"]["hit_rate"] if "scheduler" in doc else None
    if hit is not None:
        rate.add_metric([], hit)
    yield rate
