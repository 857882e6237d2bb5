"""What a worker's free-block gauge does not show yet (aimd/gauge.py), and the budget with it."""

from __future__ import annotations

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.gauge import GaugeLag


def test_promises_until_settled() -> None:
    g = GaugeLag(["w0", "w1"])
    g.promise("a", "w0", 10)
    g.promise("b", "w0", 5)
    g.promise("a", "w1", 10)  # moved: its promise with it
    assert (g.promised_on("w0"), g.promised_on("w1"), g.promised()) == (5, 10, (2, 15))
    g.settle("a")
    g.settle("a")
    assert g.promised() == (1, 5) and not g.is_promised("a") and g.is_promised("b")


def test_calls_the_reading_counted_that_ended_since_are_freed() -> None:
    g = GaugeLag(["w0"])
    g.ended("a", "w0", started_at=1.0, now=2.5, blocks=30, read_at=2.0)  # counted, ended since
    g.ended("b", "w0", started_at=2.2, now=2.6, blocks=40, read_at=2.0)  # began after it
    g.ended("c", "w0", started_at=0.5, now=2.7, blocks=20, read_at=None)  # no reading
    assert g.freed_on("w0", used_blocks=100) == 30
    g.ended("d", "w0", started_at=1.5, now=2.8, blocks=20, read_at=2.0)
    assert g.freed_on("w0", used_blocks=100) == 50
    assert g.freed_on("w0", used_blocks=35) == 35  # at most what the reading counted as used
    g.resumed("a")  # a's next call takes its blocks again
    assert g.freed_on("w0", used_blocks=100) == 20
    g.read("w0", 2.9)  # a newer reading shows d's end
    assert g.freed_on("w0", used_blocks=100) == 0
    g.ended("d", "w0", started_at=2.85, now=3.0, blocks=25, read_at=2.9)
    g.read("w0", None)  # nothing known of the worker: nothing to add back
    assert g.freed_on("w0", used_blocks=100) == 0


def _core() -> AdmissionCore:
    # 200 blocks, 10 % reserved; the forecast fit off: the free-block budget alone.
    cfg = AdmissionConfig(tuning=AdmissionTuning(kv_fit_peak=False, idle_admit=False))
    core = AdmissionCore(cfg, ["w0"])
    core.tick(0.0, {"w0": WorkerSignals(kv_usage=0.0, free_blocks=200, total_blocks=200,
                                        block_size=16, sampled_at=0.0)})
    return core


def _read(core: AdmissionCore, now: float, free: int, at: float) -> None:
    core.tick(now, {"w0": WorkerSignals(kv_usage=1 - free / 200, free_blocks=free,
                                        total_blocks=200, block_size=16, sampled_at=at)})


def test_the_budget_adds_back_what_ended_since_the_gauge_was_read() -> None:
    core = _core()
    assert core.on_request(0.1, "a", "t", 1600).kind is DecisionKind.ADMITTED  # 100 blocks
    _read(core, 0.6, free=100, at=0.5)  # a runs with its 100 blocks; its promise stands
    assert core.free_budget("w0") == 100 - 20 - 100
    core.on_response_end(0.7, "a", prompt_tokens=1584, completion_tokens=16)  # 100 blocks
    assert core.free_budget("w0") == 100 - 20 + 100  # settled, and its blocks free again
    core.on_request(0.8, "a", "t", 1700)  # a is back: its blocks are its own again
    assert core.free_budget("w0") == 100 - 20
    core.on_response_end(0.9, "a", prompt_tokens=1684, completion_tokens=16)
    assert core.free_budget("w0") == 100 - 20  # that call began after the reading: not in it
    core.on_request(1.1, "a", "t", 1800)
    _read(core, 1.2, free=100, at=1.15)  # the next reading caught a's third call running ...
    core.on_response_end(1.3, "a", prompt_tokens=1784, completion_tokens=16)
    assert core.free_budget("w0") == 100 - 20 + 100
    _read(core, 1.5, free=200, at=1.4)  # ... and a newer one shows it free: nothing added back
    assert core.free_budget("w0") == 200 - 20
