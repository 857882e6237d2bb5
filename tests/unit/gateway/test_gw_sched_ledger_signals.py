"""The scheduler's KV ledger reaches the admission core: retained blocks in ``WorkerSignals``
lower the budget a new session may use (the current-usage budget: the forecast-peak fit is off
here, it has tests of its own)."""

from __future__ import annotations

from collections.abc import Mapping

from marsproxy.aimd.admission import AdmissionCore, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.gateway.shells.observations import observation
from marsproxy.policy.observe import admission_signals
from marsproxy.probes.tool_signal import ToolCpuSignals
from marsproxy.probes.vllm_metrics import WorkerMetrics
from marsproxy.probes.vllm_rates import WorkerRates
from marsproxy.probes.vllm_scraper import WorkerPressure

TOOLS = ToolCpuSignals()  # no tool phases


def all_signals(
    pressures: Mapping[str, WorkerPressure], healthy: Mapping[str, bool], tools: ToolCpuSignals,
    tool_cpus: float, retained: Mapping[str, int] | None = None,
    elsewhere: Mapping[str, int] | None = None,
) -> dict[str, WorkerSignals]:
    """Every worker's signals as the gateway's plane builds them from its scrapes."""
    return {w: admission_signals(observation(p, healthy=healthy[w]), tools, tool_cpus,
                                 retained_blocks=(retained or {}).get(w, 0),
                                 sessions_elsewhere=(elsewhere or {}).get(w, 0))
            for w, p in pressures.items()}


def test_retained_blocks_come_off_the_admission_budget() -> None:
    m = WorkerMetrics(sampled_at=0.0, kv_usage=0.0, block_size=16, num_gpu_blocks=1000)
    pressures = {"w0": WorkerPressure("w0", m, WorkerRates(), False, None, 0, None)}
    core = AdmissionCore(AdmissionConfig(tuning=AdmissionTuning(kv_fit_peak=False)), ["w0"])
    core.tick(0.0, all_signals(pressures, {"w0": True}, TOOLS, 4.0))
    free = core.budget("w0")
    core.tick(0.2, all_signals(pressures, {"w0": True}, TOOLS, 4.0,
                               retained={"w0": 300}))
    assert free is not None and core.budget("w0") == free - 300


def test_a_ledger_change_counts_before_the_next_tick() -> None:
    # 1000 blocks of 16 tokens, 10 % reserve: 900 usable. A retained prefix takes 600.
    m = WorkerMetrics(sampled_at=0.0, kv_usage=0.0, block_size=16, num_gpu_blocks=1000)
    pressures = {"w0": WorkerPressure("w0", m, WorkerRates(), False, None, 0, None)}
    core = AdmissionCore(AdmissionConfig(tuning=AdmissionTuning(kv_fit_peak=False)), ["w0"])
    core.tick(0.0, all_signals(pressures, {"w0": True}, TOOLS, 4.0))
    free = core.budget("w0")
    core.set_retained("w0", 600)
    assert free is not None and core.budget("w0") == free - 600
    # With one session running, 400 blocks' worth of prompt no longer fits: the session waits
    # instead of evicting the retained prefix; once the reservation goes, it is admitted.
    assert core.on_request(0.05, "small", "t", 16).kind.value == "admitted"
    held = core.on_request(0.1, "big", "t", 400 * 16)
    assert held.kind.value == "wait"
    core.set_retained("w0", 0)
    actions = core.tick(0.3, all_signals(pressures, {"w0": True}, TOOLS, 4.0))
    assert [(a.entry.session, a.forced) for a in actions.admitted] == [("big", False)]


def test_retained_blocks_reach_the_kv_overload_signal() -> None:
    # The gauge says 0.30 (dormant sessions' blocks count as free to vLLM); the ledger retains
    # 6,500 of 10,000 blocks: the controller sees 0.95 and stays KV-overloaded.
    m = WorkerMetrics(sampled_at=0.0, kv_usage=0.30, block_size=16, num_gpu_blocks=10_000)
    pressures = {"w0": WorkerPressure("w0", m, WorkerRates(), False, None, 0, None)}
    core = AdmissionCore(AdmissionConfig(), ["w0"])
    core.tick(0.0, all_signals(pressures, {"w0": True}, TOOLS, 4.0,
                               retained={"w0": 6_500}))
    assert core.kv_signal("w0") == 0.95
    assert core.controllers["w0"].kv_overloaded
    core.tick(0.2, all_signals(pressures, {"w0": True}, TOOLS, 4.0))
    assert core.kv_signal("w0") == 0.30
    assert not core.controllers["w0"].kv_overloaded


def test_sessions_of_other_replicas_reach_the_signals() -> None:
    m = WorkerMetrics(sampled_at=0.0, kv_usage=0.0, block_size=16, num_gpu_blocks=1000)
    pressures = {"w0": WorkerPressure("w0", m, WorkerRates(), False, None, 0, None)}
    sig = all_signals(pressures, {"w0": True}, TOOLS, 4.0, elsewhere={"w0": 3})
    assert sig["w0"].sessions_elsewhere == 3
    assert all_signals(pressures, {"w0": True}, TOOLS, 4.0)["w0"] \
        .sessions_elsewhere == 0
