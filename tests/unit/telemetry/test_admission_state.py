"""The admission core's part of the state document, built from the core alone."""

from __future__ import annotations

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig
from marsproxy.telemetry.admission_state import core_state


def test_core_state_shows_who_is_admitted_who_waits_and_why() -> None:
    # Window 2 on one worker: the third session waits, and the forecast-peak fit has room for
    # one more first prompt (1000 blocks, 10 % reserve, two forecasts of 100 × 2 blocks).
    cfg = AdmissionConfig(window_init=2, window_min=2, window_max=2, kv_reserve_frac=0.1,
                          peak_growth_prior=2.0, peak_free_sessions=0)
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
