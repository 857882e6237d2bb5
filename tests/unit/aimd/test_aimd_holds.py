"""KV holds of dormant sessions in the admission core: how long a dormant session's forecast
keeps its room, and whether it keeps any after its first call (core/returns.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.core.session_record import EndReason


def _fit_only(**tuning: Any) -> AdmissionConfig:
    """Admission by the strict forecast fit alone: no free sessions, no overcommit, no idle
    admission."""
    return AdmissionConfig(tuning=AdmissionTuning(
        peak_free_sessions=0, peak_overcommit_max=1.0, idle_admit=False, **tuning))


def _one_shot_core(one_shot: str, returning: str | None = None) -> AdmissionCore:
    """A core on one idle worker of 400 blocks whose tenant ``one_shot`` is known one-shot
    (its latest 4 first gaps did not come back) and ``returning``'s sessions come back."""
    cfg = _fit_only(return_history=4)
    core = AdmissionCore(cfg, ["w0"])
    for _ in range(4):
        core.sessions.returns.record(one_shot, False)
    if returning is not None:
        core.sessions.returns.record(returning, True)
    core.tick(0.0, {"w0": WorkerSignals(kv_usage=0.0, free_blocks=400, total_blocks=400,
                                        block_size=16)})
    return core


def test_a_dormant_session_past_its_hold_stops_holding_kv_room() -> None:
    # Sessions of a tenant whose sessions come back: while they are dormant within their hold
    # their forecasts fill the fit; once past it (factor 4 × a usual tool time of 1 s, at least
    # kv_hold_min_s 2 s) they stay admitted but no longer hold room, and one that comes back
    # counts again.
    cfg = _fit_only(kv_hold_min_s=2.0)
    core = AdmissionCore(cfg, ["w0"])
    core.sessions.returns.record("t", True)
    sig = WorkerSignals(kv_usage=0.0, free_blocks=200, total_blocks=200, block_size=16)
    core.tick(0.0, {"w0": sig})
    for i in range(2):  # 2 × 640 tokens × growth 2.0 = 160 of 180 usable blocks: full
        assert core.on_request(0.0, f"s{i}", "t", 640).kind is DecisionKind.ADMITTED
        core.on_response_end(0.1, f"s{i}", prompt_tokens=640, usual_tool_s=1.0)
    assert core.on_request(0.2, "late", "t", 640).kind is DecisionKind.WAIT
    core.tick(4.0, {"w0": sig})  # 4 × 1 s after its call: still held
    assert core.queue.get("late") is not None
    acts = core.tick(4.2, {"w0": sig})  # past 0.1 + 4 s: both released, "late" fits
    assert [a.entry.session for a in acts.admitted] == ["late"]
    assert core.sessions.admitted_on("w0") == 3 and not core.sessions.get("s0").kv_held
    assert core.on_request(5.0, "s0", "t", 700).kind is DecisionKind.ADMITTED
    assert core.sessions.get("s0").kv_held
    assert core.peaks.committed_tokens("w0") == 2 * 1280  # s0 and "late" count, s1 not


@pytest.mark.parametrize(("speed", "released_at"), [(3200.0, 0.9), (64.0, 20.1)])
def test_a_hold_is_no_longer_than_rebuilding_the_prefix_is_worth(
    speed: float, released_at: float
) -> None:
    # Two sessions with short tool phases (usual 0.05 s) fill the fit. Their prompts of 640
    # tokens re-prefill in 0.2 s at 3200 tokens/s: the hold's floor falls from kv_hold_min_s
    # (20 s) to 4 × 0.2 s, so "late" gets their room 0.8 s after their calls; at 64 tokens/s
    # rebuilding takes 10 s, and the floor stays 20 s.
    cfg = _fit_only()
    assert cfg.tuning.kv_hold_min_s == 20.0 and cfg.tuning.kv_hold_reprefill_factor == 4.0
    core = AdmissionCore(cfg, ["w0"])
    core.sessions.returns.record("t", True)
    sig = WorkerSignals(kv_usage=0.0, free_blocks=200, total_blocks=200, block_size=16,
                        prefill_tokens_per_s=speed)
    core.tick(0.0, {"w0": sig})
    for i in range(2):
        assert core.on_request(0.0, f"s{i}", "t", 640).kind is DecisionKind.ADMITTED
        core.on_response_end(0.1, f"s{i}", prompt_tokens=640, usual_tool_s=0.05)
    assert core.on_request(0.2, "late", "t", 640).kind is DecisionKind.WAIT
    assert not core.tick(released_at - 0.2, {"w0": sig}).admitted
    acts = core.tick(released_at, {"w0": sig})
    assert [a.entry.session for a in acts.admitted] == ["late"]


@pytest.mark.parametrize("agents", [False, True])
def test_one_shot_sessions_that_never_come_back_hold_no_kv_room(agents: bool) -> None:
    # A plain client's one-shot tasks (each its own session, no final flag) one after another:
    # each is forecast at 2 × 40 blocks while in its call, and 2 of them fill the 180 usable.
    # Dormant ones hold no room while nothing says sessions of their tenant come back, so
    # every next one is admitted; where its sessions do come back, their holds fill the fit.
    cfg = _fit_only()
    core = AdmissionCore(cfg, ["w0"])
    if agents:
        core.sessions.returns.record("t", True)
    core.tick(0.0, {"w0": WorkerSignals(kv_usage=0.0, free_blocks=200, total_blocks=200,
                                        block_size=16)})
    kinds = []
    for i in range(10):
        kinds.append(core.on_request(1.0 + i, f"s{i}", "t", 640).kind)
        core.on_response_end(1.5 + i, f"s{i}", prompt_tokens=640)
    if agents:
        assert kinds[:2] == [DecisionKind.ADMITTED] * 2 and kinds[2] is DecisionKind.WAIT
    else:
        assert kinds == [DecisionKind.ADMITTED] * 10
        assert core.sessions.admitted_on("w0") == 10 and core.sessions.held_on("w0") == 0
        assert core.peaks.committed_tokens("w0") == 0


def test_a_tenant_whose_sessions_never_return_is_forecast_without_growth() -> None:
    # Once a tenant's whole history (4) of first gaps did not come back, its sessions are
    # forecast at their first prompt (40 blocks), not at 2 × it, are not fitted, and are left
    # out of the others' fit (their KV is their call's). 360 usable blocks: at 2 × 40, 4 in a
    # call at once fill the fit; once one-shot, 8 go beside an agent's session (2 × 40).
    cfg = _fit_only(return_history=4)
    core = AdmissionCore(cfg, ["w0"])
    sig = WorkerSignals(kv_usage=0.0, free_blocks=400, total_blocks=400, block_size=16)
    core.tick(0.0, {"w0": sig})
    first = [core.on_request(1.0, f"s{i}", "t", 640).kind for i in range(5)]
    assert first == [DecisionKind.ADMITTED] * 4 + [DecisionKind.WAIT]
    core.on_session_end(1.0, "s4", EndReason.ABANDONED)
    for i in range(4):
        core.on_response_end(1.5, f"s{i}", prompt_tokens=640)
    core.tick(30.0, {"w0": sig})  # past their holds: none came back
    assert core.sessions.returns.one_shot("t")
    assert core.on_request(31.0, "agent", "u", 640).kind is DecisionKind.ADMITTED
    kinds = [core.on_request(31.0, f"n{i}", "t", 640).kind for i in range(8)]
    assert kinds == [DecisionKind.ADMITTED] * 8
    assert core.peaks.flat_tokens("w0") == 8 * 640
    assert core.peaks.committed_tokens("w0") == 2 * 640


@pytest.mark.parametrize("agent", [False, True])
def test_one_shot_tasks_alone_on_a_worker_wait_in_its_queue_not_the_proxys(agent: bool) -> None:
    # A batch client's one-shot tasks go to the engine as they come, without the KV fit: what
    # the cache cannot take waits in the engine's queue, as with no proxy. Alone on a worker,
    # nothing there returns for its KV, so a full cache cuts no window either; a session that
    # returns (an agent's) on the worker turns the window's KV signal back on.
    core = _one_shot_core(one_shot="batch", returning="agents")
    first, tenant = ("a", "agents") if agent else ("n0", "batch")
    assert core.on_request(0.1, first, tenant, 640).kind is DecisionKind.ADMITTED
    full = WorkerSignals(kv_usage=0.97, free_blocks=8, total_blocks=400, block_size=16)
    core.tick(1.0, {"w0": full})
    assert core.controllers["w0"].kv_overloaded is agent
    limit = core.controllers["w0"].effective_limit
    kinds = [core.on_request(1.1, f"n{i}", "batch", 640).kind for i in range(1, 9)]
    # No KV room for a first prompt (8 free blocks): only the window holds them back.
    admitted = kinds.count(DecisionKind.ADMITTED)
    assert admitted == (limit - 1 if agent else 8)
    assert kinds == [DecisionKind.ADMITTED] * admitted + [DecisionKind.WAIT] * (8 - admitted)


def test_one_shot_tasks_in_their_call_are_not_the_kv_pressure_of_sessions_that_return() -> None:
    # An agent's session (40 blocks) and 8 one-shot tasks in their call (40 blocks each) on 400
    # blocks, the gauge at 0.97: the window reads the agents' KV alone (0.97 - 320 / 400), so a
    # cache full of tasks, which the engine's queue serves as with no proxy, cuts no window. Once
    # the tasks' calls are over, the same gauge is the agents' and cuts it.
    core = _one_shot_core(one_shot="batch", returning="agents")
    assert core.on_request(0.1, "a", "agents", 640).kind is DecisionKind.ADMITTED
    kinds = {core.on_request(0.2, f"n{i}", "batch", 640).kind for i in range(8)}
    assert kinds == {DecisionKind.ADMITTED}
    full = WorkerSignals(kv_usage=0.97, free_blocks=12, total_blocks=400, block_size=16)
    core.tick(1.0, {"w0": full})
    assert core.kv_signal("w0") == pytest.approx(0.97 - 320 / 400)
    assert not core.controllers["w0"].kv_overloaded
    seen: list[bool] = []  # and the overlap's reading is told the tasks run (overlap.py)
    observe = core.overlaps.observe
    core.overlaps.observe = lambda *a, **kw: (seen.append(kw["tasks"]), observe(*a, **kw))[1]
    core.tick(1.2, {"w0": full})
    for i in range(8):
        core.on_response_end(1.5, f"n{i}", prompt_tokens=640)
    core.tick(2.0, {"w0": full})
    assert seen == [True, False]
    assert core.kv_signal("w0") == pytest.approx(0.97)
    assert core.controllers["w0"].kv_overloaded


def test_a_session_of_a_key_taken_for_one_shot_grows_once_it_comes_back() -> None:
    # A key misread as one-shot (its first sessions all in long first tools): a session that
    # sends another call is no one-shot task, whatever the record said when it was admitted.
    core = _one_shot_core(one_shot="t")
    assert core.on_request(0.1, "s", "t", 640).kind is DecisionKind.ADMITTED
    assert core.peaks.one_shot("s") and core.peaks.flat_tokens("w0") == 640
    core.on_response_end(0.5, "s", prompt_tokens=640)
    assert core.on_request(1.0, "s", "t", 700).kind is DecisionKind.ADMITTED
    assert not core.peaks.one_shot("s") and core.peaks.flat_tokens("w0") == 0
    assert core.peaks.committed_tokens("w0") == 2 * 640  # its growth forecast again


def test_a_crowd_of_tasks_not_back_is_forecast_without_growth_before_any_hold_passes() -> None:
    # A batch client: tasks one after another, none back. At 2 × 40 blocks, 4 in a call at once
    # fill the 360 usable blocks; once 4 sit in their first gap (one_shot_crowd) with none back,
    # the tenant is one-shot a second in, not after the 20 s its first holds take.
    cfg = _fit_only(one_shot_crowd=4)
    core = AdmissionCore(cfg, ["w0"])
    core.tick(0.0, {"w0": WorkerSignals(kv_usage=0.0, free_blocks=400, total_blocks=400,
                                        block_size=16)})
    first = [core.on_request(0.1, f"s{i}", "t", 640).kind for i in range(5)]
    assert first == [DecisionKind.ADMITTED] * 4 + [DecisionKind.WAIT]
    acts = core.on_response_end(0.5, "s0", prompt_tokens=640)
    assert [a.entry.session for a in acts.admitted] == ["s4"]  # s0 holds no room
    for i in range(1, 3):
        core.on_response_end(0.5, f"s{i}", prompt_tokens=640)
    assert not core.sessions.returns.one_shot("t")  # 3 in their first gap: not yet
    core.on_response_end(0.6, "s3", prompt_tokens=640)
    assert core.sessions.returns.one_shot("t")
    kinds = [core.on_request(0.7, f"n{i}", "t", 640).kind for i in range(9)]
    # s4 was forecast at 2 × 640 when it arrived; the next are not fitted (at 640 each, 7
    # would fill the 5,760 tokens beside it) and the fit leaves them out.
    assert kinds == [DecisionKind.ADMITTED] * 9
    assert core.peaks.committed_tokens("w0") == 2 * 640
    assert core.peaks.flat_tokens("w0") == 9 * 640


def test_sessions_that_hold_no_room_hold_no_slot_in_the_window() -> None:
    # Ten tasks of a tenant whose sessions are known not to return, each dormant after its call
    # and holding no room, then the engine's KV runs over the high mark (a tokenizer denser
    # than the estimate): the window walks down to window_min and the budget is spent, yet with
    # nothing holding a slot the next task gets in (the engine will have room for it). Had the
    # ten counted, nothing would be admitted until their idle timeout. Nor do they grow the
    # window while nothing holds a slot.
    cfg = AdmissionConfig(window_init=8, window_min=2, tuning=AdmissionTuning(
        peak_free_sessions=0, peak_overcommit_max=1.0, idle_admit=False, return_history=2))
    core = AdmissionCore(cfg, ["w0"])
    for _ in range(2):
        core.sessions.returns.record("t", False)
    calm = WorkerSignals(kv_usage=0.1, free_blocks=10_000, total_blocks=10_000, block_size=16)
    core.tick(0.0, {"w0": calm})
    for i in range(10):
        assert core.on_request(0.1 * i, f"s{i}", "t", 640).kind is DecisionKind.ADMITTED
        core.on_response_end(0.1 * i + 0.05, f"s{i}", prompt_tokens=640)
    assert core.sessions.admitted_on("w0") == 10 and core.sessions.slotless_on("w0") == 10
    for k in range(1, 6):
        core.tick(1.0 + 0.2 * k, {"w0": calm})
    assert core.controllers["w0"].window == 8  # app-limited: nothing holds a slot
    full = WorkerSignals(kv_usage=0.95, free_blocks=500, total_blocks=10_000, block_size=16)
    for k in range(6):
        core.tick(3.0 + 0.2 * k, {"w0": full})
    assert core.controllers["w0"].effective_limit == 2
    assert core.on_request(4.5, "new", "t", 640).kind is DecisionKind.ADMITTED
    # The budget is spent, but only one-shot tasks hold KV there now: the next one waits in the
    # engine's queue, not the proxy's (the test below).
    assert core.on_request(4.6, "next", "t", 640).kind is DecisionKind.ADMITTED


def test_a_keys_tasks_after_their_call_are_no_part_of_its_share_of_the_sessions() -> None:
    # A batch key's one-shot tasks stay admitted (dormant) until their idle timeout, but hold
    # no slot and no KV once their call is over. Counted in the tenants' shares, 20 of them made
    # every agent tenant light beside them: the heavy agents' tenant, 3 sessions beside the
    # light tenant's 1, stopped yielding to it. Not counted, heavy is over its share again, and
    # a task that sends another call counts from then on.
    core = _one_shot_core(one_shot="batch", returning="heavy")
    core.sessions.returns.record("light", True)
    for i in range(3):
        assert core.on_request(0.1, f"h{i}", "heavy", 64).kind is DecisionKind.ADMITTED
    assert core.on_request(0.1, "l0", "light", 64).kind is DecisionKind.ADMITTED
    assert core.yields.yields("h0") and not core.yields.yields("l0")
    for i in range(20):
        assert core.on_request(0.2, f"t{i}", "batch", 64).kind is DecisionKind.ADMITTED
        core.on_response_end(0.3, f"t{i}", prompt_tokens=64)
    assert core.sessions.get("t0") is not None  # dormant, still admitted
    assert core.yields.yields("h0") and not core.yields.yields("l0")
    for i in range(4, 20):  # back: 17 batch sessions in a call, each a tenant's demand again
        assert core.on_request(0.4, f"t{i}", "batch", 64).kind is DecisionKind.ADMITTED
    assert not core.yields.over_share("heavy") and core.yields.over_share("batch")


@pytest.mark.parametrize("enabled", [True, False])
def test_equally_loaded_workers_take_new_sessions_in_turn(enabled: bool) -> None:
    # One-call sessions (the final flag) one after another on three idle workers: each one is
    # over before the next arrives, so every worker holds nothing each time. They go round, as
    # round robin spreads them without a proxy, instead of all to the first worker.
    cfg = AdmissionConfig(enabled=enabled, tuning=AdmissionTuning(idle_admit=False))
    core = AdmissionCore(cfg, ["w0", "w1", "w2"])
    sig = WorkerSignals(kv_usage=0.0, free_blocks=400, total_blocks=400, block_size=16)
    core.tick(0.0, {w: sig for w in core.workers})
    placed = []
    for i in range(6):
        d = core.on_request(float(i), f"s{i}", "t", 640, final=True)
        assert d.kind is DecisionKind.ADMITTED
        placed.append(d.worker)
        core.on_response_end(i + 0.5, f"s{i}", prompt_tokens=640)
    assert placed == ["w0", "w1", "w2"] * 2


def test_a_first_call_that_holds_no_room_lets_in_who_waits_at_its_end() -> None:
    # Nothing yet says whether the tenant's sessions come back, so one dormant after its first
    # call holds no room (its slot is kept, to see). Two in a call fill the fit (2 × 2 × 40 of
    # 180 usable blocks); when the first call ends, the room it freed goes to the one waiting
    # then, not at the next control tick: a burst of one-shot tasks went in once per tick.
    cfg = _fit_only()
    core = AdmissionCore(cfg, ["w0"])
    core.tick(0.0, {"w0": WorkerSignals(kv_usage=0.0, free_blocks=200, total_blocks=200,
                                        block_size=16)})
    kinds = [core.on_request(0.0, f"s{i}", "t", 640).kind for i in range(3)]
    assert kinds == [DecisionKind.ADMITTED] * 2 + [DecisionKind.WAIT]
    acts = core.on_response_end(0.05, "s0", prompt_tokens=640)
    assert [a.entry.session for a in acts.admitted] == ["s2"]


def test_sessions_dormant_past_their_hold_do_not_count_against_an_overloaded_limit() -> None:
    # A plain agent client (no final flag): six sessions did their calls and went quiet. Their
    # KV hold ends 0.8 s on (4 × a 0.2 s re-prefill), their slots only at kv_hold_min_s (20 s).
    # The tools then overload the one tool CPU (backlog 6): the CPU cap is 4 sessions. The six
    # hold neither KV room nor a tool, so a new session is admitted; four sessions back in
    # their calls count again, and the cap holds the next one back.
    cfg = _fit_only()
    core = AdmissionCore(cfg, ["w0"])
    core.sessions.returns.record("t", True)
    sig = WorkerSignals(kv_usage=0.0, free_blocks=4000, total_blocks=4000, block_size=16,
                        prefill_tokens_per_s=3200.0)
    core.tick(0.0, {"w0": sig})
    for i in range(6):
        assert core.on_request(0.0, f"s{i}", "t", 640).kind is DecisionKind.ADMITTED
        core.on_response_end(0.1, f"s{i}", prompt_tokens=640, usual_tool_s=0.05)
    busy = replace(sig, tools_in_flight=6, backlog_ratio=6.0, tool_cpus=1.0)
    core.tick(2.0, {"w0": busy})
    ctl = core.controllers["w0"]
    assert ctl.cpu_overloaded and ctl.effective_limit == 4
    assert core.sessions.load_on("w0") == 6 and core.sessions.held_on("w0") == 0
    assert core.on_request(2.1, "new", "t", 640).kind is DecisionKind.ADMITTED
    for i in range(4):  # back in a call: they may add tool work again
        assert core.on_request(2.2, f"s{i}", "t", 700).kind is DecisionKind.ADMITTED
    assert core.on_request(2.3, "next", "t", 640).kind is DecisionKind.WAIT
