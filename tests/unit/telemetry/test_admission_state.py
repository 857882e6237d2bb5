"""The admission core's part of the state document, built from the core alone."""

from __future__ import annotations

from typing import Any, cast

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.controller import NO_CEILING
from marsproxy.telemetry.admission_state import binding_cap, core_state, queue_why
from marsproxy.telemetry.state import AdmissionWorkerState


def test_core_state_shows_who_is_admitted_who_waits_and_why() -> None:
    # Window 2 on one worker: the third session waits, and the forecast-peak fit has room for
    # one more first prompt (1000 blocks, 10 % reserve, two forecasts of 100 × 2 blocks).
    cfg = AdmissionConfig(window_init=2, window_min=2, window_max=2, kv_reserve_frac=0.1,
        tuning=AdmissionTuning(peak_growth_prior=2.0, peak_free_sessions=0))
    core = AdmissionCore(cfg, ["w0"])
    core.tick(0.0, {"w0": WorkerSignals(kv_usage=0.0, free_blocks=1000, total_blocks=1000,
                                        block_size=16, running=0)})
    kinds = [core.on_request(1.0, s, "t", 100 * 16).kind for s in ("a", "b", "c")]
    assert kinds == [DecisionKind.ADMITTED, DecisionKind.ADMITTED, DecisionKind.WAIT]

    doc = core_state(core, 1.5, show_id=str.upper)
    w = doc["workers"]["w0"]
    assert (w["window"], w["effective_limit"], w["admitted"]) == (2, 2, 2)
    assert sorted(w["sessions"]) == ["A", "B"]
    # 900 usable blocks less two forecasts of 200: room for a first prompt of 250 blocks
    assert w["peak_room_blocks"] == 250
    assert doc["queue"]["length"] == 1 and doc["queue"]["order"] == ["C"]
    assert doc["peak_growth"] == 2.0


def test_binding_cap_names_the_smallest_bound() -> None:
    assert binding_cap(8, 30, 30, 8) == "window"
    assert binding_cap(8, 8, 30, 8) == "window"  # a tie: the caps bind only below the window
    assert binding_cap(8, 5, 6, 5) == "kv_cap"
    assert binding_cap(8, 6, 5, 5) == "cpu_cap"
    # Not overloaded: the window does not bind; no count bound at all, or window_max.
    assert binding_cap(8, NO_CEILING, NO_CEILING, NO_CEILING) == "none"
    assert binding_cap(40, 30, 30, 30) == "kv_cap"
    assert binding_cap(8, 12, 16, 10) == "window_max"


def _aw(**kw: Any) -> AdmissionWorkerState:
    base: dict[str, Any] = {
        "window": 2, "effective_limit": 2, "kv_cap": 30, "cpu_cap": 30, "kv_overloaded": False,
        "cpu_overloaded": False, "stale": False, "budget_blocks": None,
        "peak_room_blocks": None, "peak_overlap": 1.0, "peak_overcommit": 1.0,
        "reprefill_s": None, "idle_s": None, "admitted": 2, "held": 2, "sessions": [],
        "limit": 2,
        "admitted_store": 2, "binds": "window",
    }
    return cast(AdmissionWorkerState, base | kw)


def test_queue_why_says_what_holds_each_worker() -> None:
    workers = {
        "w0": _aw(),
        "w1": _aw(kv_cap=1, effective_limit=1, limit=1, admitted=1, held=1, admitted_store=1,
                  binds="kv_cap"),
        "w2": _aw(stale=True),
        "w3": _aw(admitted=0, held=0, admitted_store=0, peak_room_blocks=0),
    }
    assert queue_why(workers, 0) == ""
    assert queue_why(workers, 3) == (
        "w0: full 2/2 (window); w1: full 1/1 (kv cap); "
        "w2: stale pressure, nothing placed (fail closed); "
        "w3: no KV room for another forecast peak"
    )


def test_queue_why_names_a_budget_below_the_smallest_waiting_prompt() -> None:
    # Room for 78 blocks of first prompt, the smallest waiting one needs 84: it waits, and
    # "room (next pass)" would mislead (a 2 Dec real-vLLM run sat 30 s under that message).
    workers = {"w0": _aw(admitted=3, admitted_store=3, limit=NO_CEILING,
                         effective_limit=NO_CEILING, budget_blocks=78, peak_room_blocks=78,
                         binds="none")}
    assert queue_why(workers, 6, {"w0": 84}) == (
        "w0: KV room for a first prompt of 78 blocks, the smallest waiting has 84")
    assert queue_why(workers, 6, {"w0": 78}) == "w0: room (next pass)"
    assert queue_why(workers, 6) == "w0: room (next pass)"
