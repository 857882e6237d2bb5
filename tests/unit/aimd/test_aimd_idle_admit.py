"""Idle admission: a worker whose admitted sessions all sit in tool phases, with nothing running
and sessions waiting, takes one more past the forecast-peak fit
(``admission.tuning.idle_admit``)."""

from __future__ import annotations

from typing import Any

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning

# Forecasts of 450 blocks each (150-block first prompts, growth 3): two fill the 900 usable.
FIRST = 150 * 16


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.0, free_blocks=1000, total_blocks=1000, block_size=16,
                                running=0)
    base.update(kw)
    return WorkerSignals(**base)


def core(**cfg: Any) -> AdmissionCore:
    base: dict[str, Any] = dict(window_init=8, window_min=2, window_max=8, kv_reserve_frac=0.1,
                                peak_growth_prior=3.0, peak_min_samples=1, peak_free_sessions=0,
                                idle_admit_after_s=0.5)
    base.update(cfg)
    c = AdmissionCore(_config(base), ["w0"])
    # Agents: tenant t's sessions come back after a call, so dormant ones hold KV room.
    c.sessions.returns.record("t", True)
    c.tick(0.0, {"w0": sig()})
    return c


def two_in_tools(c: AdmissionCore, at: float = 1.0) -> None:
    """Two sessions fill the forecast room, are served, and go into their tool phases."""
    for i in range(2):
        assert c.on_request(at, f"s{i}", "t", FIRST).kind is DecisionKind.ADMITTED
    c.on_response_end(at + 0.1, "s0", prompt_tokens=FIRST)
    c.on_response_end(at + 0.2, "s1", prompt_tokens=FIRST)  # the worker is idle from here


def test_an_idle_worker_takes_one_more_once_idle_long_enough() -> None:
    c = core()
    two_in_tools(c)
    assert c.on_request(1.3, "x", "t", FIRST).kind is DecisionKind.WAIT  # idle 0.1 s only
    assert c.peak_room("w0") == 0  # the fit says no: no room for a 150-block prompt
    acts = c.tick(1.7, {"w0": sig(kv_usage=0.3, free_blocks=700)})  # idle 0.5 s
    assert [a.entry.session for a in acts.admitted] == ["x"]
    assert acts.admitted[0].idle and "x" not in c.queue


def test_only_one_per_idle_spell_the_admitted_one_runs() -> None:
    c = core()
    two_in_tools(c)
    c.on_request(1.3, "x", "t", FIRST)
    c.on_request(1.4, "y", "t", FIRST)
    acts = c.tick(1.8, {"w0": sig(kv_usage=0.3, free_blocks=700)})
    assert [a.entry.session for a in acts.admitted] == ["x"]  # arrival order: x first
    assert c.idle_s(2.0, "w0") is None  # x's request is in flight
    assert not c.tick(2.0, {"w0": sig(kv_usage=0.3, free_blocks=700)}).admitted
    assert "y" in c.queue


def test_off_the_fit_holds_the_queue() -> None:
    c = core(idle_admit=False)
    two_in_tools(c)
    c.on_request(1.3, "x", "t", FIRST)
    assert not c.tick(3.0, {"w0": sig(kv_usage=0.3, free_blocks=700)}).admitted
    assert "x" in c.queue


def test_the_engine_running_anything_is_not_idle() -> None:
    # Another replica's (or anyone's) requests run there: the engine is busy.
    c = core()
    two_in_tools(c)
    c.on_request(1.3, "x", "t", FIRST)
    assert not c.tick(3.0, {"w0": sig(kv_usage=0.3, free_blocks=700, running=1)}).admitted
    # Without a running gauge, sessions held by other replicas make idleness unknowable.
    assert not c.tick(3.2, {"w0": sig(kv_usage=0.3, free_blocks=700, running=None,
                                        sessions_elsewhere=1)}).admitted
    assert c.idle_s(3.2, "w0") is None
    # Without the gauge but with no one else there, this replica's own view is the whole one.
    acts = c.tick(3.4, {"w0": sig(kv_usage=0.3, free_blocks=700, running=None)})
    assert [a.entry.session for a in acts.admitted] == ["x"]


def test_a_gauge_read_before_the_last_call_ended_does_not_hold_an_idle_admission() -> None:
    # The scrape counted the call that has ended since: alone on the worker, this replica's
    # own sessions (all in tools) are the current view; read after it, the gauge is believed.
    c = core()
    two_in_tools(c)  # their calls ended at 1.1 and 1.2
    c.on_request(1.3, "x", "t", FIRST)
    busy_since = {"kv_usage": 0.3, "free_blocks": 700, "running": 1}
    assert not c.tick(3.0, {"w0": sig(**busy_since, sampled_at=2.9)}).admitted
    acts = c.tick(3.2, {"w0": sig(**busy_since, sampled_at=1.05)})
    assert [a.entry.session for a in acts.admitted] == ["x"]


def test_the_first_prompt_must_fit_the_free_blocks() -> None:
    c = core()
    two_in_tools(c)
    c.on_request(1.3, "big", "t", 400 * 16)
    # 250 free, less the 10 % reserve (100): 150 blocks, and the prompt needs 400.
    assert not c.tick(3.0, {"w0": sig(kv_usage=0.75, free_blocks=250)}).admitted
    acts = c.tick(3.2, {"w0": sig(kv_usage=0.3, free_blocks=700)})
    assert [a.entry.session for a in acts.admitted] == ["big"]


def test_nothing_admitted_is_not_idle_and_sessions_in_flight_are_not_dormant() -> None:
    c = core()
    assert c.idle_s(5.0, "w0") is None  # nothing admitted: the ordinary fit decides
    c.on_request(1.0, "s0", "t", FIRST)
    assert c.idle_s(5.0, "w0") is None  # its first call is in flight
    c.on_response_end(2.0, "s0", prompt_tokens=FIRST)
    assert c.idle_s(5.0, "w0") == 3.0
    assert c.sessions.dormant_since("w0") == 2.0


def cpu_bound(**kw: Any) -> WorkerSignals:
    # Six tools on one CPU: CPU overload, the window walks down to window_min (2).
    base: dict[str, Any] = dict(kv_usage=0.3, free_blocks=700, tools_in_flight=6,
                                backlog_ratio=6.0, tool_cpus=1.0)
    base.update(kw)
    return sig(**base)


def test_a_tool_cpu_limit_does_not_stop_an_idle_admission() -> None:
    # The CPU cap binds on tool-CPU overload (here ceil(1 CPU · 1.5) = 2); an engine
    # with nothing to run adds nothing to the tools until the new session's call is done, so
    # the idle rule passes it (up to the KV cap).
    c = core(idle_admit_after_s=1.0, cpu_cap_backlog=1.5)
    two_in_tools(c)  # idle from 1.2
    c.on_request(1.3, "x", "t", FIRST)
    for k in range(4):
        assert not c.tick(1.3 + 0.2 * k, {"w0": cpu_bound()}).admitted
    ctl = c.controllers["w0"]
    assert ctl.cpu_overloaded and ctl.effective_limit == 2 and ctl.idle_limit == 8
    acts = c.tick(2.2, {"w0": cpu_bound()})
    assert [a.entry.session for a in acts.admitted] == ["x"]


def test_kv_overload_stops_an_idle_admission() -> None:
    c = core()
    two_in_tools(c)
    c.on_request(1.3, "x", "t", FIRST)
    acts = c.tick(2.0, {"w0": cpu_bound(kv_usage=0.95, free_blocks=700)})
    ctl = c.controllers["w0"]
    assert ctl.kv_overloaded and ctl.idle_limit == ctl.effective_limit == 2
    assert not acts.admitted and "x" in c.queue


def test_a_request_admitted_by_the_idle_rule_says_so() -> None:
    # The shell needs to know: the store confirms an idle admission against the idle limit.
    c = core()
    assert c.on_request(0.5, "a", "t", FIRST).idle is False  # a plain admission
    c.on_response_end(0.6, "a", prompt_tokens=FIRST)
    c.on_request(1.0, "b", "t", FIRST)
    c.on_response_end(1.1, "b", prompt_tokens=FIRST)  # the fit is full, the worker idle
    c.tick(1.7, {"w0": sig(kv_usage=0.3, free_blocks=700)})
    d = c.on_request(1.7, "x", "t", FIRST)
    assert (d.kind, d.worker, d.idle) == (DecisionKind.ADMITTED, "w0", True)


def _config(flat: dict[str, Any]) -> AdmissionConfig:
    """``flat`` keys of both levels: the tuning ones go under ``tuning``."""
    tuned = {k: v for k, v in flat.items() if k in AdmissionTuning.model_fields}
    rest = {k: v for k, v in flat.items() if k not in tuned}
    return AdmissionConfig(**rest, tuning=AdmissionTuning(**tuned))
