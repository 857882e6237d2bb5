"""The emulator's /metrics page against vLLM 0.32's: same families, types and label names."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.emulator.engine import Engine
from marsproxy.emulator.metrics import EmulatorMetrics
from marsproxy.emulator.profiles import get_profile

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32-metrics.txt"
# Labels a histogram/summary adds to its samples; not part of the family's label names.
_SAMPLE_LABELS = {"le", "quantile"}

# As a real vLLM 0.32 on CPU exports them (parser family names: counters lose "_total").
NOTE_FAMILIES = {
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:cache_config_info": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_num_preemptions": "histogram",
}


def _families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels: set[str] = set()
        for sample in fam.samples:
            labels.update(k for k in sample.labels if k not in _SAMPLE_LABELS)
        out[fam.name] = (fam.type, frozenset(labels))
    return out


def _emulator_page() -> str:
    profile = get_profile("tiny")
    eng = Engine(profile)
    metrics = EmulatorMetrics(profile)
    eng.add_request("r", list(range(40)), max_tokens=3, ignore_eos=True)
    now = 0.0
    while eng.has_work():  # drive real observations so every series has samples
        res = eng.step(now)
        now += res.duration
        metrics.record_step(res, eng.stats(), (0, 0))
    return metrics.render().decode()


def test_emulator_emits_the_families_the_note_lists() -> None:
    fams = _families(_emulator_page())
    for name, kind in NOTE_FAMILIES.items():
        assert name in fams, name
        assert fams[name][0] == kind, name
    for name, (_kind, labels) in fams.items():
        assert name.startswith("vllm:"), name
        assert "engine" in labels, name
        if name != "vllm:cache_config_info":  # vLLM's info gauge carries config labels only
            assert "model_name" in labels, name
    assert fams["vllm:request_success"][1] >= {"finished_reason"}
    assert fams["vllm:num_requests_waiting_by_reason"][1] >= {"reason"}
    assert fams["vllm:cache_config_info"][1] >= {
        "block_size",
        "num_gpu_blocks",
        "enable_prefix_caching",
    }


def test_families_match_real_vllm_page() -> None:
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE} (a captured real vLLM 0.32 /metrics page) is not there yet")
    real = _families(FIXTURE.read_text())
    ours = _families(_emulator_page())
    problems = []
    for name, (kind, labels) in sorted(ours.items()):
        if name not in real:
            problems.append(f"{name}: not on the real page")
        elif real[name][0] != kind:
            problems.append(f"{name}: type {kind}, real {real[name][0]}")
        elif real[name][1] != labels:
            problems.append(f"{name}: labels {sorted(labels)}, real {sorted(real[name][1])}")
    assert not problems, "\n".join(problems)
