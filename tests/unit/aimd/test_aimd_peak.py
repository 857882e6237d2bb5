"""Forecast-peak KV-fit: growth learnt from finished sessions, every admitted session budgeted
at its forecast peak, and the admission core holding back what would overflow later."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.peak import PeakForecast
from marsproxy.core.session_record import EndReason


def test_prior_until_enough_sessions_finished_then_ratio_of_sums() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=2)
    assert p.growth() == 2.0
    p.admit("a", "w0", 1000)
    p.observe("a", 1000, 100)
    p.observe("a", 3000, 100)  # context 3100
    p.end("a", finished=True)
    assert p.growth() == 2.0  # one sample: still the prior
    p.admit("b", "w0", 9000)
    p.observe("b", 9000, 0)
    p.observe("b", 10_900, 100)  # context 11000
    p.end("b", finished=True)
    # Σ peak / Σ first = (3100 + 11000) / (1000 + 9000), not the mean of 3.1 and 1.22.
    assert p.growth() == pytest.approx(1.41)


def test_unfinished_or_unobserved_sessions_teach_nothing() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=1)
    p.admit("gone", "w0", 1000)
    p.observe("gone", 1000, 9000)
    p.end("gone", finished=False)  # abandoned: its context is no peak
    p.admit("silent", "w0", 1000)
    p.end("silent", finished=True)  # never served: nothing observed
    assert p.growth() == 2.0 and len(p) == 0


def test_history_is_a_sliding_window() -> None:
    p = PeakForecast(prior_growth=2.0, history=2, min_samples=1)
    for i, peak in enumerate((5000, 1000, 1000)):
        p.admit(f"s{i}", "w0", 1000)
        p.observe(f"s{i}", 1000, peak - 1000)
        p.end(f"s{i}", finished=True)
    assert p.growth() == 1.0  # the 5× session fell out of the window of 2


def test_forecast_is_the_larger_of_context_and_growth() -> None:
    p = PeakForecast(prior_growth=3.0, history=8, min_samples=4)
    p.admit("a", "w0", 1200)  # estimate before the worker reports
    assert p.forecast("a") == 3600
    p.observe("a", 1000, 50)  # the real first prompt replaces the estimate
    assert p.forecast("a") == 3000
    p.observe("a", 4000, 500)  # grew past the forecast: its context is the floor
    assert p.forecast("a") == 4500
    assert p.forecast("unknown") == 0


def test_a_session_known_not_to_return_is_forecast_without_growth() -> None:
    p = PeakForecast(prior_growth=3.0, history=8, min_samples=4)
    p.admit("a", "w0", 1000, grows=False)
    p.admit("b", "w0", 1200)
    assert (p.forecast("a"), p.forecast("b")) == (1000, 3600)
    # A one-shot task's KV is its call's: the fit of the sessions that return leaves it out.
    assert p.committed_tokens("w0") == 3600 and p.flat_tokens("w0") == 1000
    p.observe("a", 1000, 250)
    assert p.forecast("a") == 1250  # its context: the one call's prompt and reply
    assert p.resident_committed_tokens("w0", {"a": 79, "b": 0}, 16) == 3600


def test_room_counts_every_admitted_session_on_the_worker() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=4)
    p.admit("a", "w0", 160)  # forecast 320 tokens = 20 blocks of 16
    p.admit("b", "w1", 1600)  # another worker: not counted on w0
    # 110 blocks, 10 % reserve (11) → 99 usable; 99 − 20 = 79 blocks of peak; ÷ 2 → 39.
    assert p.room_blocks(p.committed_tokens("w0"), 110, 16, 0.10) == 39
    # Overcommit 1.5: ⌊1.5 · 99⌋ = 148; (148 − 20) / 2 = 64.
    assert p.room_blocks(p.committed_tokens("w0"), 110, 16, 0.10, overcommit=1.5) == 64
    p.move("a", "w1")
    assert p.room_blocks(p.committed_tokens("w0"), 110, 16, 0.10) == 49


def test_no_forecast_outgrows_the_longest_context_the_worker_serves() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=4)
    p.admit("a", "w0", 3000)
    p.admit("b", "w1", 3000)
    assert p.committed_tokens("w0") == 6000  # no limit known: first prompt × G
    p.limit("w0", 4096)
    assert (p.forecast("a"), p.forecast("b")) == (4096, 6000)  # w1 reports none
    assert p.committed_tokens("w0") == 4096 and p.committed_tokens("w1") == 6000
    assert p.resident_committed_tokens("w0", {"a": 0}, 16) == 4096
    # 1000 blocks of 16, 10 % reserve: 900 usable, 256 committed (not 375): (900 − 256) ÷ 2.
    assert p.room_blocks(p.committed_tokens("w0"), 1000, 16, 0.10) == 322
    p.observe("a", 4000, 96)  # its context is the floor, as always
    assert p.forecast("a") == 4096
    p.limit("w0", None)  # no longer reported (a restarted server that does not say)
    assert p.forecast("a") == 8000


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.0, free_blocks=1000, total_blocks=1000, block_size=16)
    base.update(kw)
    return WorkerSignals(**base)


def core(**cfg: Any) -> AdmissionCore:
    # Idle admission off: these tests are about the fit it overrides (test_aimd_idle_admit).
    base: dict[str, Any] = dict(window_init=8, window_min=2, window_max=8, kv_reserve_frac=0.1,
                                peak_growth_prior=3.0, peak_min_samples=1, peak_free_sessions=0,
                                idle_admit=False)
    base.update(cfg)
    c = AdmissionCore(_config(base), ["w0"])
    # Agents: tenant t's sessions come back after a call, so dormant ones hold KV room.
    c.sessions.returns.record("t", True)
    c.tick(0.0, {"w0": sig()})
    return c


def test_admission_holds_a_session_whose_forecast_peak_would_not_fit() -> None:
    # 900 usable blocks; first prompts of 100 blocks forecast 300 each: three fit, the fourth
    # waits although the free-block gauge shows room for it (vLLM's usage is still 0).
    c = core()
    kinds = [c.on_request(1.0, f"s{i}", "t", 100 * 16).kind for i in range(4)]
    assert kinds == [DecisionKind.ADMITTED] * 3 + [DecisionKind.WAIT]
    for i in range(3):  # every prompt served: nothing pending, the gauge shows 300 used
        c.on_response_end(2.0, f"s{i}", prompt_tokens=100 * 16, completion_tokens=0)
    c.tick(2.2, {"w0": sig(kv_usage=0.3, free_blocks=700)})
    assert c.budget("w0") == 0 and "s3" in c.queue
    # The same with the first-prompt fit only: the gauge's 700 free blocks admit it.
    old = core(kv_fit_peak=False)
    assert all(old.on_request(1.0, f"s{i}", "t", 100 * 16).kind is DecisionKind.ADMITTED
               for i in range(4))


def test_the_worker_s_longest_context_caps_the_admitted_forecasts() -> None:
    # First prompts of 100 blocks, forecast 300 each at G = 3: three fit in 900 usable blocks.
    # Contexts of at most 200 blocks cap each admitted forecast at 200: after three, 300 blocks
    # are left for a fourth first prompt of 100 (its own forecast, 300, is checked uncapped).
    c = core()
    c.tick(0.2, {"w0": sig(max_model_len=200 * 16)})
    kinds = [c.on_request(1.0, f"s{i}", "t", 100 * 16).kind for i in range(5)]
    assert kinds == [DecisionKind.ADMITTED] * 4 + [DecisionKind.WAIT]
    assert c.peaks.forecast("s0") == 200 * 16
    c.tick(1.2, {"w0": sig()})  # no longer reported: the forecasts are uncapped again
    assert c.peaks.forecast("s0") == 300 * 16 and c.peak_room("w0") < 0


def test_a_finished_session_frees_its_forecast_and_teaches_the_growth() -> None:
    c = core()
    for i in range(4):
        c.on_request(1.0, f"s{i}", "t", 100 * 16)
    c.on_response_end(2.0, "s0", prompt_tokens=1600, completion_tokens=0)
    c.on_request(3.0, "s0", "t", 2000 * 16, final=True)
    # The final call ends s0 with a context of 2 × its first prompt: growth 2 from now on,
    # so s1, s2 (forecast 200 blocks each) leave room for s3.
    acts = c.on_response_end(4.0, "s0", prompt_tokens=3000, completion_tokens=200)
    assert c.peaks.growth() == 2.0
    assert [a.entry.session for a in acts.admitted] == ["s3"]


@pytest.mark.parametrize(
    ("reason", "learns"),
    [(EndReason.IDLE_TIMEOUT, True), (EndReason.DELETED, True), (EndReason.ABANDONED, False)],
)
def test_which_endings_teach_the_growth(reason: EndReason, learns: bool) -> None:
    c = core()
    c.on_request(1.0, "a", "t", 100 * 16)
    c.on_response_end(2.0, "a", prompt_tokens=1000, completion_tokens=4000)
    c.on_session_end(3.0, "a", reason)
    assert c.peaks.growth() == (5.0 if learns else 3.0)


def test_window_does_not_grow_without_peak_room() -> None:
    c = core(window_init=2, window_min=1)
    for i in range(2):
        c.on_request(1.0, f"s{i}", "t", 150 * 16)  # 2 × 450 forecast blocks = the 900 usable
    before = c.controllers["w0"].window
    c.tick(1.2, {"w0": sig()})  # KV idle, window used, but no peak room: hold
    assert c.peak_room("w0") == 0 and c.controllers["w0"].window == before
    assert core(kv_fit_peak=False).peak_room("w0") is None


def test_the_first_sessions_on_a_worker_need_only_the_first_prompt_fit() -> None:
    # Forecasts of 450 blocks each: with the fit from the first session on, only two fit the
    # 900 usable blocks; with peak_free_sessions 3 the third is admitted on its first prompt
    # (the worker held fewer than 3), the fourth meets the fit (room 900 − 3 · 450 < 0).
    strict, free = core(), core(peak_free_sessions=3)
    kinds = [strict.on_request(1.0, f"s{i}", "t", 150 * 16).kind for i in range(4)]
    assert kinds == [DecisionKind.ADMITTED] * 2 + [DecisionKind.WAIT] * 2
    kinds = [free.on_request(1.0, f"s{i}", "t", 150 * 16).kind for i in range(4)]
    assert kinds == [DecisionKind.ADMITTED] * 3 + [DecisionKind.WAIT]
    assert free.peak_room("w0") is not None and free.peak_room("w0") < 0


def test_sessions_other_replicas_hold_count_at_the_typical_forecast() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=4)
    assert p.committed_tokens("w0", elsewhere=3) == 0  # nothing known: no guess
    p.admit("a", "w0", 100)  # forecasts 200 and 400: typical 300
    p.admit("b", "w0", 200)
    assert p.committed_tokens("w0") == 600
    assert p.committed_tokens("w0", elsewhere=2) == 1200
    p.admit("c", "w1", 1000)
    p.observe("c", 1000, 500)
    p.end("c", finished=True)  # the mean finished peak (1500) stands in where none is ours
    assert p.committed_tokens("w1", elsewhere=2) == 3000


def test_the_core_budgets_sessions_of_other_replicas() -> None:
    c = core()
    c.on_request(1.0, "s0", "t", 100 * 16)  # forecast 300 blocks
    assert c.peak_room("w0") == (900 - 300) // 3
    c.tick(0.2 + 1.0, {"w0": sig(sessions_elsewhere=2)})  # two more like it elsewhere
    assert c.peak_room("w0") == 0
    assert c.on_request(1.5, "s1", "t", 100 * 16).kind is DecisionKind.WAIT


def _two_in_tools(c: AdmissionCore) -> None:
    # Two sessions of forecast 450 blocks (150 × growth 3) fill the 900 usable blocks; both
    # finish their call and sit in tool phases.
    for i in range(2):
        c.on_request(1.0, f"s{i}", "t", 150 * 16)
        c.on_response_end(1.5, f"s{i}", prompt_tokens=150 * 16)


def _cheap_core(speed: float | None, **cfg: Any) -> AdmissionCore:
    c = core(peak_free_sessions=2, peak_cheap_sessions=2, peak_overcommit_max=3.0, **cfg)
    c.tick(0.5, {"w0": sig(prefill_tokens_per_s=speed)})
    return c


def test_cheap_preemption_overcommits_while_few_sessions_are_in_a_call() -> None:
    # Re-prefilling a 7200-token forecast at 72k tokens/s takes 0.1 s, within the 1 s default:
    # with both sessions in tools the fit uses peak_overcommit_max (3 × 900 − 900 committed,
    # ÷ growth 3 = 600 first-prompt blocks of room), so the third goes in on its forecast.
    c = _cheap_core(72_000.0)
    _two_in_tools(c)
    assert c.reprefill_s("w0") == pytest.approx(0.1)
    assert c.peak_factor("w0") == 3.0 and c.peak_room("w0") == 600
    assert c.on_request(2.0, "x", "t", 150 * 16).kind is DecisionKind.ADMITTED
    for i in range(2):
        c.on_request(3.0, f"s{i}", "t", 200 * 16)  # back from their tools: three in a call
    assert c.sessions.active_on("w0") == 3
    assert c.peak_factor("w0") == 1.0  # the strict fit again
    assert c.on_request(3.0, "y", "t", 10 * 16).kind is DecisionKind.WAIT


def test_the_cheap_ceiling_lets_in_only_enough_to_fill_its_calls() -> None:
    # Four sessions wait while both admitted ones are in a call (strict fit, no room). Once
    # both sit in tools the ceiling's room (600 first-prompt blocks) would take all four in one
    # pass; it takes two, which bring the sessions in a call back to peak_cheap_sessions, and
    # the strict fit has no room for the others.
    c = _cheap_core(72_000.0)
    for i in range(2):
        c.on_request(1.0, f"s{i}", "t", 150 * 16)
    assert c.peak_factor("w0") == 1.0
    waiting = [f"x{i}" for i in range(4)]
    for k in waiting:
        assert c.on_request(1.1, k, "t", 150 * 16).kind is DecisionKind.WAIT
    for i in range(2):
        c.on_response_end(1.5, f"s{i}", prompt_tokens=150 * 16)
    assert c.peak_factor("w0") == 3.0 and c.peak_room("w0") == 600
    assert c.cheap_slots("w0") == 2
    actions = c.tick(2.0, {"w0": sig(prefill_tokens_per_s=72_000.0)})
    assert [a.entry.session for a in actions.admitted] == waiting[:2]
    assert c.sessions.active_on("w0") == 2 and c.cheap_slots("w0") == 0
    assert c.peak_factor("w0") == 1.0  # the strict fit again for the other two


def test_a_pass_the_cheap_ceiling_capped_still_takes_what_the_strict_fit_allows() -> None:
    # Small sessions: the strict fit has room for all four waiting (held back by a full cache
    # until the tick). The ceiling's two go first; the strict fit takes the other two at once.
    c = _cheap_core(72_000.0)
    for i in range(2):
        c.on_request(0.6, f"s{i}", "t", 50 * 16)  # forecasts 150 blocks each
    c.tick(0.8, {"w0": sig(prefill_tokens_per_s=72_000.0, free_blocks=100)})
    waiting = [f"x{i}" for i in range(4)]
    for k in waiting:
        assert c.on_request(0.9, k, "t", 20 * 16).kind is DecisionKind.WAIT
    for i in range(2):
        c.on_response_end(1.0, f"s{i}", prompt_tokens=50 * 16)
    assert c.cheap_slots("w0") == 2
    actions = c.tick(1.2, {"w0": sig(prefill_tokens_per_s=72_000.0)})
    assert [a.entry.session for a in actions.admitted] == waiting
    assert c.peak_factor("w0") == 1.0 and c.peak_room("w0") >= 0


@pytest.mark.parametrize(("speed", "cfg"), [
    (1_000.0, {}),  # 7.2 s to re-prefill a forecast: a preemption is dear, the fit holds
    (8_000.0, {}),  # 0.9 s, what the real vLLM on a 2-core CPU takes: dear too
    (None, {}),  # no speed measured yet: nothing says it is cheap
    (72_000.0, {"peak_cheap_reprefill_s": 0.0}),  # the rule is off
])
def test_dear_or_unknown_preemption_keeps_the_strict_fit(
    speed: float | None, cfg: dict[str, Any],
) -> None:
    c = _cheap_core(speed, **cfg)
    _two_in_tools(c)
    assert c.peak_factor("w0") == 1.0
    assert c.on_request(2.0, "x", "t", 150 * 16).kind is DecisionKind.WAIT


def test_other_replicas_sessions_count_as_in_a_call() -> None:
    # This replica cannot see whether the sessions other replicas hold are in a call: two of
    # them there keep the strict fit although its own sessions sit in tools.
    c = _cheap_core(72_000.0)
    _two_in_tools(c)
    c.tick(1.6, {"w0": sig(prefill_tokens_per_s=72_000.0, sessions_elsewhere=2)})
    assert c.peak_factor("w0") == 1.0


def _config(flat: dict[str, Any]) -> AdmissionConfig:
    """``flat`` keys of both levels: the tuning ones go under ``tuning``."""
    tuned = {k: v for k, v in flat.items() if k in AdmissionTuning.model_fields}
    rest = {k: v for k, v in flat.items() if k not in tuned}
    return AdmissionConfig(**rest, tuning=AdmissionTuning(**tuned))


def test_committed_without_the_sessions_that_yield() -> None:
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=4)
    p.admit("i", "w0", 160)  # forecast 20 blocks
    p.admit("b", "w0", 1600)  # forecast 200 blocks
    p.admit("x", "w1", 1600)
    assert sorted(p.held_on("w0")) == ["b", "i"]
    assert p.committed_tokens("w0") == 320 + 3200
    assert p.committed_tokens("w0", without=lambda k: k == "b") == 320


def test_a_first_class_session_is_admitted_into_kv_batch_holds() -> None:
    c = core(peak_free_sessions=2)
    for i in range(3):  # batch forecasts 300 blocks each: 900 usable, full
        assert c.on_request(1.0, f"b{i}", "t", 100 * 16, cls="batch").kind is \
            DecisionKind.ADMITTED
    assert c.on_request(1.5, "b3", "t", 100 * 16, cls="batch").kind is DecisionKind.WAIT
    assert c.protected_room("w0") == 900  # nobody to protect yet: no growth asked
    assert c.on_request(2.0, "i0", "t", 100 * 16, cls="interactive").kind is \
        DecisionKind.ADMITTED
    assert c.protected_room("w0") == 900 - 300  # beside i0's forecast
    assert c.on_request(2.0, "i1", "t", 100 * 16, cls="interactive").kind is \
        DecisionKind.ADMITTED
    # Two protected sessions: the forecast fit of their own, growth 3.
    assert c.protected_room("w0") == (900 - 600) // 3
    assert "b3" in c.queue  # batch still waits: nothing came free for it


def test_a_light_tenants_session_is_admitted_into_kv_a_heavy_one_holds() -> None:
    c = core(peak_free_sessions=2)
    for i in range(3):
        assert c.on_request(1.0, f"h{i}", "heavy", 100 * 16).kind is DecisionKind.ADMITTED
    assert c.protected_room("w0") is None  # one tenant: nobody yields
    assert c.on_request(1.5, "h3", "heavy", 100 * 16).kind is DecisionKind.WAIT
    assert c.on_request(2.0, "l0", "light", 100 * 16).kind is DecisionKind.ADMITTED
    assert c.yields.yields("h0") and not c.yields.yields("l0")  # heavy holds 3 of 4
    assert "h3" in c.queue


def test_no_later_class_no_budget_of_its_own() -> None:
    c = core()
    assert c.on_request(1.0, "i0", "t", 100 * 16, cls="interactive").kind is \
        DecisionKind.ADMITTED
    assert c.protected_room("w0") is None  # nobody yields: the common budget


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from(["admit", "observe", "release", "hold", "move", "end"]),
    st.integers(0, 6), st.sampled_from(["w0", "w1"]), st.integers(1, 5000),
), max_size=80))
def test_held_index_matches_a_full_scan(ops: list[tuple[str, int, str, int]]) -> None:
    # The forecasts' sums walk an index of held sessions per worker; a scan of every session
    # (as the fit once did) is the reference.
    p = PeakForecast(prior_growth=2.0, history=8, min_samples=2)
    for kind, n, worker, tokens in ops:
        key = f"s{n}"
        if kind == "admit":
            p.admit(key, worker, tokens)
        elif kind == "observe":
            p.observe(key, tokens, tokens // 10)
        elif kind == "release":
            p.release(key)
        elif kind == "hold":
            p.hold(key)
        elif kind == "move":
            p.move(key, worker)
        else:
            p.end(key, finished=True)
        g = p.growth()
        for w in ("w0", "w1"):
            held = {k: s for k, s in p._sessions.items() if s.worker == w and s.held}
            assert sorted(p.held_on(w)) == sorted(held)
            assert p.committed_tokens(w) == sum(max(s.context, math.ceil(s.first * g))
                                                for s in held.values())
            assert p.resident_committed_tokens(w, dict.fromkeys(held, 2), 16) == sum(
                (2 * 16 + max(s.context, math.ceil(s.first * g)) - s.context) if s.observed
                else max(s.context, math.ceil(s.first * g)) for s in held.values())
