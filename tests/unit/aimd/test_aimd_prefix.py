"""Prefix placement (aimd/prefix.py), waiting for the worker holding the prefix at saturation,
the peak fit from resident blocks (KV events), and sessions bound to one worker (a Responses
reply only that worker keeps): placed there and nowhere else, admission on or off."""

from __future__ import annotations

from typing import Any

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, PlacementConfig
from marsproxy.aimd.peak import PeakForecast
from marsproxy.aimd.prefix import prefer_prefix, waits_for_prefix
from marsproxy.aimd.queue import WorkerView
from marsproxy.core.session_record import EndReason

W = ("w0", "w1", "w2")


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.1, free_blocks=10_000, total_blocks=10_000,
                                block_size=16)
    base.update(kw)
    return WorkerSignals(**base)


def core(enabled: bool = True, window: int = 8, **placement: Any) -> AdmissionCore:
    placement.setdefault("min_prefix_tokens", 1)  # any block counts here, unless said
    c = AdmissionCore(AdmissionConfig(enabled=enabled, window_min=1, window_init=window,
                                      window_max=window), W, PlacementConfig(**placement))
    c.tick(0.0, {w: sig() for w in W})
    return c


def admit(c: AdmissionCore, key: str, prefix: dict[str, int] | None) -> str | None:
    """A new session, admitted; its first call ends at once (it sits in a tool phase), so the
    next placement compares sessions held, not calls in flight (``max_call_gap``)."""
    d = c.on_request(0.0, key, "t", 100, prefix=prefix)
    assert d.kind is DecisionKind.ADMITTED
    c.on_response_end(0.0, key)
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


# -- at saturation: waiting for the worker that holds the prefix --------------------------------

HOT = {"w0": 4096, "w1": 0}


def full_core(policy: str = "prefix", max_bypass: int = 64) -> AdmissionCore:
    """Two workers of one slot each, both taken: w0 by a session of the hot prefix, w1 by one
    without; what arrives next waits (idle admission off: a pass alone decides)."""
    cfg = AdmissionConfig(window_min=1, window_init=1, window_max=1,
                          tuning={"max_bypass": max_bypass, "idle_admit": False})
    c = AdmissionCore(cfg, ("w0", "w1"), PlacementConfig(policy=policy, min_prefix_tokens=256))
    c.tick(0.0, {w: sig() for w in ("w0", "w1")})
    assert c.on_request(0.0, "a", "t", 100, prefix=HOT).worker == "w0"
    assert c.on_request(0.0, "b", "t", 100).worker == "w1"
    return c


def queue(c: AdmissionCore, key: str, prefix: dict[str, int] | None = None) -> None:
    assert c.on_request(1.0, key, "t", 100, prefix=prefix).kind is DecisionKind.WAIT


def ended(c: AdmissionCore, key: str, now: float = 2.0) -> dict[str, str]:
    """The sessions the end of ``key`` admitted, with their workers."""
    return {a.entry.session: a.worker
            for a in c.on_session_end(now, key, EndReason.FINAL).admitted}


def test_a_waiting_session_lets_the_next_take_a_slot_away_from_its_prefix() -> None:
    c = full_core()
    queue(c, "c", HOT)  # first in line; its prefix is on w0, which is full
    queue(c, "d")
    assert ended(c, "b") == {"d": "w1"}  # c lets d have w1 and keeps waiting for w0
    assert "c" in c.queue and c.queue.bypasses("c") == 1
    assert ended(c, "a", 3.0) == {"c": "w0"}  # w0 frees: c goes where its prefix is


def test_a_slot_nobody_else_takes_is_the_waiting_sessions_own() -> None:
    c = full_core()
    queue(c, "c", HOT)
    queue(c, "d", HOT)  # waits for w0 too
    assert ended(c, "b") == {"c": "w1"}  # nobody takes w1 instead: the first in line does
    c = full_core()
    queue(c, "c", HOT)
    assert ended(c, "b") == {"c": "w1"}  # alone in the queue: nobody to let go first


def test_waiting_for_a_prefix_is_bounded_by_max_bypass() -> None:
    c = full_core(max_bypass=1)
    queue(c, "c", HOT)
    queue(c, "d")
    queue(c, "e")
    assert ended(c, "b") == {"d": "w1"}  # the one bypass c allows
    assert ended(c, "d", 3.0) == {"c": "w1"}  # due now: it takes the slot it is offered


def test_least_loaded_and_sessions_without_a_map_never_wait() -> None:
    c = full_core(policy="least_loaded")
    queue(c, "c", HOT)
    queue(c, "d")
    assert ended(c, "b") == {"c": "w1"}
    c = full_core()
    queue(c, "c")
    queue(c, "d", HOT)
    assert ended(c, "b") == {"c": "w1"}  # c has no prefix anywhere: it takes the slot


def test_waits_for_prefix_needs_a_full_worker_within_the_load_guard() -> None:
    cfg = PlacementConfig(min_prefix_tokens=256, max_load_gap=1)
    free = [WorkerView("w0", admitted=1, limit=2), WorkerView("w1", admitted=0, limit=2)]
    full = [WorkerView("w0", admitted=2, limit=2), WorkerView("w1", admitted=1, limit=2)]
    far = [WorkerView("w0", admitted=2, limit=2), WorkerView("w1", admitted=0, limit=2)]
    assert waits_for_prefix(cfg, full, HOT, "w1", 100)
    assert not waits_for_prefix(cfg, free, HOT, "w1", 100)  # w0 has room: the move does it
    assert not waits_for_prefix(cfg, far, HOT, "w1", 100)  # w0 two ahead: the guard says no
    assert not waits_for_prefix(cfg, full, {"w0": 200}, "w1", 100)  # under min_prefix_tokens
    assert not waits_for_prefix(cfg, full, HOT, "w0", 100)  # already where its prefix is
    assert not waits_for_prefix(PlacementConfig(policy="least_loaded"), full, HOT, "w1", 100)


def test_a_worker_busier_with_calls_does_not_pull_a_session_for_its_prefix() -> None:
    # At light load the queue's choice may be idle while the prefix's worker still prefills the
    # prefix for another session: there the new call would wait behind it (FCFS engines).
    cfg = PlacementConfig(min_prefix_tokens=64)  # max_call_gap 0
    quiet = WorkerView("w0", admitted=1, limit=4, in_call=0)
    busy = WorkerView("w1", admitted=1, limit=4, in_call=1)
    assert prefer_prefix(cfg, [quiet, busy], {"w1": 640}, "w0", 16, counted=False) is None
    calm = WorkerView("w1", admitted=1, limit=4, in_call=0)
    assert prefer_prefix(cfg, [quiet, calm], {"w1": 640}, "w0", 16, counted=False) == "w1"
    loose = PlacementConfig(min_prefix_tokens=64, max_call_gap=1)
    assert prefer_prefix(loose, [quiet, busy], {"w1": 640}, "w0", 16, counted=False) == "w1"
    c = core()
    d = c.on_request(0.0, "a", "t", 100, prefix={"w0": 0, "w1": 0, "w2": 0})
    assert d.worker == "w0"  # and in its first call there
    assert admit(c, "b", {"w0": 512, "w1": 0, "w2": 0}) == "w1"  # w0 is busier: no move
    c.on_response_end(0.5, "a")
    assert admit(c, "c", {"w0": 512, "w1": 0, "w2": 0}) == "w0"  # a's call ended: w0 calm


def test_a_bound_session_goes_to_its_worker_not_the_least_loaded() -> None:
    for enabled in (True, False):
        c = core(enabled)
        assert c.on_request(0.0, "a", "t", 100).worker == "w0"
        # Least loaded is w1 (and a cached prefix says w2): bound to w0, it goes there.
        d = c.on_request(0.0, "b", "t", 100, bound="w0", prefix={"w2": 4096})
        assert (d.kind, d.worker) == (DecisionKind.ADMITTED, "w0"), enabled
        assert c.on_request(0.0, "c", "t", 100).worker == "w1"  # the others as before


def test_a_bound_session_waits_for_its_worker_while_others_have_room() -> None:
    c = core(window=1)
    assert c.on_request(0.0, "a", "t", 100).worker == "w0"
    d = c.on_request(0.0, "b", "t", 100, bound="w0")
    assert d.kind is DecisionKind.WAIT  # w1 and w2 are free, but do not keep its reply
    assert c.on_request(0.0, "c", "t", 100).worker == "w1"  # nobody waits behind it
    c.on_response_end(0.1, "a")
    acts = c.on_session_end(0.2, "a", EndReason.FINAL)
    assert [(a.entry.session, a.worker) for a in acts.admitted] == [("b", "w0")]
    # Served there: never moved to another replica's free slot.
    assert c.relocate(0.3, "b", ["w2"]) is None
    # Its end forgets the binding: the id's next session is placed as any (w0 and w2 hold
    # none; w2 was given fewer so far).
    c.on_response_end(0.4, "b")
    c.on_session_end(0.5, "b", EndReason.FINAL)
    assert c.on_request(0.6, "b", "t", 100).worker == "w2"
