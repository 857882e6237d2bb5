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
    g.ended("c", "w0", started_at=0.5, now=1.2, blocks=20)  # no reading yet: nothing known
    assert g.freed_on("w0", used_blocks=100) == 0
    g.read("w0", 2.0)  # c ended before this reading: it shows c's blocks free
    g.ended("a", "w0", started_at=1.0, now=2.5, blocks=30)  # counted, ended since
    g.ended("b", "w0", started_at=2.2, now=2.6, blocks=40)  # began after it
    assert g.freed_on("w0", used_blocks=100) == 30
    g.ended("d", "w0", started_at=1.5, now=2.8, blocks=20)
    assert g.freed_on("w0", used_blocks=100) == 50
    assert g.freed_on("w0", used_blocks=35) == 35  # at most what the reading counted as used
    g.resumed("a")  # a's next call takes its blocks again
    assert g.freed_on("w0", used_blocks=100) == 20
    g.read("w0", 2.9)  # a newer reading shows b's and d's ends
    assert g.freed_on("w0", used_blocks=100) == 0
    g.ended("d", "w0", started_at=2.85, now=3.0, blocks=25)
    g.read("w0", None)  # nothing known of the worker: nothing to add back
    assert g.freed_on("w0", used_blocks=100) == 0


def test_a_reading_applied_after_calls_it_counted_ended() -> None:
    # A scrape reaches the control tick some time after it was taken: calls that ran at the
    # sample and ended before the tick are in it as used, and free now.
    g = GaugeLag(["w0"])
    g.read("w0", 1.0)
    g.ended("a", "w0", started_at=1.1, now=1.25, blocks=30)  # after the latest reading ...
    g.ended("b", "w0", started_at=1.3, now=1.4, blocks=10)
    assert g.freed_on("w0", used_blocks=100) == 0
    g.read("w0", 1.2)  # ... but the next one, sampled while a ran, arrives only now
    assert g.freed_on("w0", used_blocks=100) == 30  # b began after the sample: not in it
    g.read("w0", 1.3)  # sampled after a's end, while b ran
    assert g.freed_on("w0", used_blocks=100) == 10
    g.resumed("b")
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


def test_a_late_reading_counts_the_calls_it_saw_end_as_free() -> None:
    core = _core()
    assert core.on_request(0.1, "a", "t", 1600).kind is DecisionKind.ADMITTED  # 100 blocks
    core.on_response_end(0.3, "a", prompt_tokens=1584, completion_tokens=16)
    assert core.free_budget("w0") == 200 - 20  # the reading at 0.0 never saw a running
    _read(core, 0.4, free=100, at=0.2)  # sampled while a ran, applied after its end
    assert core.free_budget("w0") == 100 - 20 + 100
