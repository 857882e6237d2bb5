"""A session bound to one worker (it continues a Responses reply only that worker keeps): the
admission core places it there and nowhere else, whatever the load, the prefix map or a full
window elsewhere, with admission on or off."""

from __future__ import annotations

from typing import Any

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, PlacementConfig
from marsproxy.core.session_record import EndReason

W = ("w0", "w1", "w2")


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.1, free_blocks=10_000, total_blocks=10_000,
                                block_size=16)
    base.update(kw)
    return WorkerSignals(**base)


def core(enabled: bool = True, window: int = 8) -> AdmissionCore:
    c = AdmissionCore(AdmissionConfig(enabled=enabled, window_min=1, window_init=window,
                                      window_max=window),
                      W, PlacementConfig(min_prefix_tokens=1))
    c.tick(0.0, {w: sig() for w in W})
    return c


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
