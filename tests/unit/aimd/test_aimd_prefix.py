"""Prefix placement (aimd/prefix.py) and the peak fit from resident blocks (KV events)."""

from __future__ import annotations

from typing import Any

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, PlacementConfig
from marsproxy.aimd.peak import PeakForecast
from marsproxy.aimd.prefix import prefer_prefix
from marsproxy.aimd.queue import WorkerView

W = ("w0", "w1", "w2")


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.1, free_blocks=10_000, total_blocks=10_000,
                                block_size=16)
    base.update(kw)
    return WorkerSignals(**base)


def core(enabled: bool = True, **placement: Any) -> AdmissionCore:
    placement.setdefault("min_prefix_tokens", 1)  # any block counts here, unless said
    c = AdmissionCore(AdmissionConfig(enabled=enabled, window_init=8, window_max=8), W,
                      PlacementConfig(**placement))
    c.tick(0.0, {w: sig() for w in W})
    return c


def admit(c: AdmissionCore, key: str, prefix: dict[str, int] | None) -> str | None:
    d = c.on_request(0.0, key, "t", 100, prefix=prefix)
    assert d.kind is DecisionKind.ADMITTED
    return d.worker


def test_a_new_session_goes_where_its_prefix_is_cached() -> None:
    c = core()
    assert admit(c, "a", {"w0": 0, "w1": 0, "w2": 0}) == "w0"  # nothing cached: least loaded
    assert admit(c, "b", {"w0": 512, "w1": 0, "w2": 0}) == "w0"  # least loaded is w1
    assert admit(c, "c", {"w0": 0, "w1": 0, "w2": 64}) == "w2"


def test_the_load_guard_spreads_one_hot_prefix() -> None:
    c = core(max_load_gap=1)
    hot = {"w0": 4096, "w1": 0, "w2": 0}
    placed = [admit(c, f"s{i}", hot) for i in range(6)]
    # w0 takes sessions only while it holds at most one more than the least loaded.
    assert placed == ["w0", "w0", "w1", "w2", "w0", "w1"]


def test_least_loaded_policy_and_no_prefix_map_place_as_before() -> None:
    for c, prefix in ((core(policy="least_loaded"), {"w2": 4096}), (core(), None)):
        assert [admit(c, f"s{i}", prefix) for i in range(3)] == ["w0", "w1", "w2"]


def test_admission_off_follows_the_prefix_too() -> None:
    c = core(enabled=False)
    assert admit(c, "a", {"w1": 160}) == "w1"


def test_min_prefix_tokens_and_the_fit_bound_the_move() -> None:
    cfg = PlacementConfig(min_prefix_tokens=64)
    views = [WorkerView("w0", admitted=0, limit=4, budget_blocks=100),
             WorkerView("w1", admitted=0, limit=4, budget_blocks=2)]
    assert prefer_prefix(cfg, views, {"w1": 48}, "w0", 16, counted=False) is None
    assert prefer_prefix(cfg, views, {"w1": 64}, "w0", 16, counted=False) == "w1"
    # w1's budget cannot take a 100-token prompt (7 blocks): it stays.
    assert prefer_prefix(cfg, views, {"w1": 640}, "w0", 100, counted=False) is None
    full = [views[0], WorkerView("w1", admitted=2, limit=2)]  # within the load gap
    assert prefer_prefix(cfg, full, {"w1": 640}, "w0", 16, counted=False) is None
    assert prefer_prefix(cfg, full, {"w1": 640}, "w0", 16, counted=False, slots=False) == "w1"


def test_resident_blocks_replace_the_forecast_of_served_sessions() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=1)
    p.admit("a", "w0", 1000)
    p.admit("b", "w0", 1000)
    p.observe("a", 1000, 200)  # context 1200, forecast max(1200, 2000) = 2000
    # a: 10 resident blocks of 16 + growth 800; b: not served yet, its forecast 2000.
    assert p.resident_committed_tokens("w0", {"a": 10}, 16) == 160 + 800 + 2000
    assert p.committed_tokens("w0") == 4000
    # Sessions of other replicas there count at this worker's mean.
    assert p.resident_committed_tokens("w0", {"a": 10}, 16, elsewhere=2) == 2 * 2960


def test_the_fit_reads_resident_blocks_where_an_index_exists() -> None:
    c = AdmissionCore(AdmissionConfig(), ["w0"])
    c.sessions.returns.record("t", True)  # agents: dormant sessions hold their room
    c.tick(0.0, {"w0": sig(total_blocks=1000, free_blocks=1000)})
    for i in range(4):
        c.on_request(0.0, f"s{i}", "t", 1600)
    without = c.peak_room("w0")
    c.tick(0.2, {"w0": sig(total_blocks=1000, free_blocks=1000, session_blocks={})})
    with_index = c.peak_room("w0")
    # Nothing served yet: the same forecasts and the same overcommit, so the same room.
    assert without is not None and with_index == without
    # Served sessions count what they hold: half their context evicted, more room.
    for i in range(4):
        c.on_response_end(0.3, f"s{i}", prompt_tokens=1600, completion_tokens=100)
    c.tick(0.4, {"w0": sig(total_blocks=1000, free_blocks=1000, session_blocks={})})
    evicted = c.peak_room("w0")
    c.tick(0.6, {"w0": sig(total_blocks=1000, free_blocks=1000,
                           session_blocks={f"s{i}": 106 for i in range(4)})})
    resident = c.peak_room("w0")
    assert evicted is not None and resident is not None and evicted > resident


def test_by_default_a_short_shared_prefix_does_not_move_a_session() -> None:
    # A system prompt cached on one worker is not worth a move; a long shared prompt is.
    c = core(min_prefix_tokens=PlacementConfig().min_prefix_tokens)
    assert admit(c, "a", {"w0": 0, "w1": 0, "w2": 0}) == "w0"
    assert admit(c, "b", {"w0": 128, "w1": 0, "w2": 0}) == "w1"  # least loaded
    assert admit(c, "c", {"w0": 0, "w1": 0, "w2": 4096}) == "w2"
