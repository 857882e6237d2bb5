"""The KV overload signal counts the ledger's retained blocks as used.

A scripted trace of one worker: sessions run (vLLM's usage gauge high), then go into tool
phases (the gauge drops: their cached blocks count as free to vLLM) while the scheduler's
ledger retains their prefixes. Read alone, the gauge lets the window grow back within seconds;
with the ledger the worker stays overloaded until the retained prefixes are really free.
"""

from __future__ import annotations

from marsproxy.aimd.admission import AdmissionCore, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig

TOTAL = 10_000


def sig(usage: float, retained: int) -> WorkerSignals:
    free = round((1 - usage) * TOTAL)
    return WorkerSignals(kv_usage=usage, free_blocks=free, total_blocks=TOTAL, block_size=16,
                         retained_blocks=retained)


# (seconds, vLLM usage, retained blocks): a busy phase, 20 s of tool phases with the prefixes
# retained (gauge 0.30; ledger 5,800 blocks: 0.88 effective, above kv_leave, and the budget,
# 7,000 free − 1,000 reserve − 5,800, still positive), then the reservations expire.
TRACE = [(t / 5, 0.95, 0) for t in range(0, 10)] + \
        [(2 + t / 5, 0.30, 5_800) for t in range(0, 100)] + \
        [(22 + t / 5, 0.30, 0) for t in range(0, 100)]


def run(trace: list[tuple[float, float, int]] = TRACE
        ) -> tuple[AdmissionCore, list[tuple[float, int, bool]]]:
    c = AdmissionCore(AdmissionConfig(window_init=30, window_min=4, window_max=30), ["w0"])
    for i in range(30):  # the window is used (the app-limited guard lets it grow)
        c.on_request(0.0, f"s{i}", "t", 16)
    c.tick(0.0, {"w0": sig(0.95, 0)})
    windows = []
    for t, usage, retained in trace:
        c.tick(t, {"w0": sig(usage, retained)})
        ctl = c.controllers["w0"]
        windows.append((t, ctl.window, ctl.kv_overloaded))
    return c, windows


def window_at(windows: list[tuple[float, int, bool]], t: float) -> int:
    return [w for s, w, _ in windows if s <= t + 1e-9][-1]


def test_dormant_retained_sessions_keep_the_worker_overloaded() -> None:
    c, windows = run()
    assert window_at(windows, 1.8) == 4  # busy: shrunk to window_min
    # Tool phases: the gauge says 0.30, gauge + ledger 0.88 > kv_leave: still overloaded.
    tool = [(w, over) for t, w, over in windows if 2 <= t < 22]
    assert all(w == 4 and over for w, over in tool)
    assert c.kv_signal("w0") == 0.30  # after the reservations went, the gauge alone again
    # Reservations gone: the window grows back, one per tick.
    assert window_at(windows, 30.0) == 30


def test_without_retained_prefixes_the_window_grows_back_during_tool_phases() -> None:
    # The same trace with nothing retained: the gauge alone rules, and it reads 0.30.
    _, windows = run([(t, usage, 0) for t, usage, _ in TRACE])
    assert window_at(windows, 1.8) == 4
    assert window_at(windows, 8.0) == 30  # 26 ticks of additive increase: back to the top
    assert not any(over for t, _, over in windows if 2 <= t < 22)


def test_effective_usage_is_the_larger_of_gauge_and_ledger() -> None:
    c = AdmissionCore(AdmissionConfig(), ["w0"])
    c.tick(0.0, {"w0": sig(0.30, 2_000)})
    assert c.kv_signal("w0") == 0.5  # (3,000 used + 2,000 retained) / 10,000
    c.tick(0.2, {"w0": sig(0.30, 9_000)})
    assert c.kv_signal("w0") == 1.0  # capped at full
    c.tick(0.4, {"w0": sig(0.30, 0)})
    assert c.kv_signal("w0") == 0.30
    c.tick(0.6, {"w0": WorkerSignals(stale=True, retained_blocks=500)})
    assert c.kv_signal("w0") is None  # unknown stays unknown (the controller fails closed)
    # The KV cap follows the effective usage too: at the high mark it is the floor.
    c.tick(0.8, {"w0": sig(0.30, 6_000)})  # 0.9 effective
    assert c.controllers["w0"].kv_cap == c.cfg.window_min
