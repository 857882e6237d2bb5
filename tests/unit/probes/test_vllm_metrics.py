"""parse_vllm_metrics on realistic and broken pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from marsproxy.probes.vllm_metrics import (
    KV_USAGE,
    KV_USAGE_DEPRECATED,
    MetricsParseError,
    WorkerMetrics,
    parse_vllm_metrics,
)

HERE = Path(__file__).parent / "fixtures"
REAL = Path(__file__).parents[2] / "fixtures" / "vllm-0.32-metrics.txt"
REAL_IDLE = Path(__file__).parents[2] / "fixtures" / "vllm-0.32-metrics-idle.txt"


def load(name: str) -> str:
    return (HERE / name).read_text()


def test_single_engine_page() -> None:
    m = parse_vllm_metrics(load("vllm-like-single.txt"), now=12.5)
    assert m.sampled_at == 12.5
    assert m.engines == ("0",)
    assert m.kv_usage == pytest.approx(0.8125)
    assert m.kv_usage_source == KV_USAGE
    assert (m.running, m.waiting) == (3, 5)
    assert m.waiting_by_reason == {"capacity": 5, "deferred": 0}
    assert m.preemptions_total == 2
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (12000, 9000)
    assert m.prompt_tokens_total == 12000
    assert m.generation_tokens_total == 640
    assert m.admission_rejections_total == 5  # 4 + 1 over two reasons
    assert (m.block_size, m.num_gpu_blocks, m.kv_capacity_tokens) == (32, 160, 5120)
    assert m.ttft_count == 10
    assert m.ttft_sum_s == pytest.approx(1.9)
    assert m.prefill_time_sum_s == pytest.approx(0.4)
    assert m.request_prompt_tokens_sum == 12000
    assert m.process_start_time_s is not None


def test_old_metric_name_only() -> None:
    m = parse_vllm_metrics(load("vllm-like-old.txt"), now=0.0)
    assert m.kv_usage == pytest.approx(0.8125)
    assert m.kv_usage_source == KV_USAGE_DEPRECATED
    assert m.admission_rejections_total is None


def test_new_name_wins_over_old() -> None:
    text = 'vllm:gpu_cache_usage_perc{engine="0"} 0.9\nvllm:kv_cache_usage_perc{engine="0"} 0.1\n'
    m = parse_vllm_metrics(text, now=0.0)
    assert (m.kv_usage, m.kv_usage_source) == (0.1, KV_USAGE)


def test_two_engines_sum_counts_and_max_kv() -> None:
    m = parse_vllm_metrics(load("vllm-like-dp2.txt"), now=0.0)
    assert m.engines == ("0", "1")
    assert m.kv_usage == pytest.approx(0.8125)  # max of 0.8125 and 0.25, not the sum or mean
    assert (m.running, m.waiting) == (4, 5)
    assert m.preemptions_total == 3
    assert m.prefix_cache_hits_total == 9500
    assert m.admission_rejections_total == 6
    assert m.num_gpu_blocks == 360  # each rank has its own cache
    assert m.block_size == 32
    assert m.ttft_count == 12


def test_missing_metrics_are_none() -> None:
    text = '# HELP x\nvllm:engine_sleep_state{engine="0",sleep_state="awake"} 1.0\nother 2\n'
    m = parse_vllm_metrics(text, now=3.0)
    assert m == WorkerMetrics(sampled_at=3.0)
    assert m.kv_capacity_tokens is None


def test_nan_is_ignored() -> None:
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.3\n'
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_preemptions_total{engine="0"} NaN\n'
    )
    m = parse_vllm_metrics(text, now=0.0)
    assert m.kv_usage == 0.3
    assert m.running is None
    assert m.preemptions_total is None


@pytest.mark.parametrize("bad", ["+Inf", "-Inf", "-1", "1e400"])
def test_infinite_and_negative_values_are_ignored_like_nan(bad: str) -> None:
    # round(inf) raised OverflowError out of the parser (it is no MetricsParseError), which
    # ended the worker's scrape loop for good; a negative gauge read as an empty worker.
    text = (
        f'vllm:kv_cache_usage_perc{{engine="0"}} {bad}\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.3\n'
        f'vllm:num_requests_running{{engine="0"}} {bad}\n'
        f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} {bad}\n'
        f'vllm:num_preemptions_total{{engine="0"}} {bad}\n'
        f'vllm:cache_config_info{{block_size="{bad}",num_gpu_blocks="-5"}} 1.0\n'
    )
    m = parse_vllm_metrics(text, now=0.0)
    assert m.kv_usage == 0.3
    assert m.running is None and m.preemptions_total is None
    assert m.waiting_by_reason == {}
    assert (m.block_size, m.num_gpu_blocks) == (None, None)


def test_values_that_overflow_when_summed_are_unknown_and_kv_usage_is_capped() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 1e308\n'
        'vllm:num_requests_running{engine="1"} 1e308\n'
        'vllm:prompt_tokens_total{engine="0"} 1e308\n'
        'vllm:prompt_tokens_total{engine="1"} 1e308\n'
        'vllm:kv_cache_usage_perc{engine="0"} 1e308\n'
    )
    m = parse_vllm_metrics(text, now=0.0)
    assert m.running is None and m.prompt_tokens_total is None
    assert m.kv_usage == 1.0  # a fraction: more than full reads as full (fail closed)


def test_nan_only_kv_falls_back_to_old_name() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:gpu_cache_usage_perc{engine="0"} 0.4\n'
    m = parse_vllm_metrics(text, now=0.0)
    assert (m.kv_usage, m.kv_usage_source) == (0.4, KV_USAGE_DEPRECATED)


def test_cache_config_info_with_none_labels() -> None:
    text = 'vllm:cache_config_info{block_size="None",num_gpu_blocks="None",engine="0"} 1.0\n'
    m = parse_vllm_metrics(text, now=0.0)
    assert (m.block_size, m.num_gpu_blocks) == (None, None)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "<html><body><h1>502 Bad Gateway</h1></body></html>",
        '{"detail": "Not Found"}',
        'vllm:num_requests_running{engine="0" 3\n',
        'vllm:kv_cache_usage_perc{engine="0"} zero\n',
        "",  # a 200 with an empty body is not a vLLM page either
        "# HELP some_exporter\nsome_exporter_up 1\n",
    ],
)
def test_garbage_raises_parse_error(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics(text, now=0.0)


def test_parse_error_is_a_value_error() -> None:
    assert issubclass(MetricsParseError, ValueError)


def _grep_sum(text: str, name: str) -> float:
    """Independent oracle: sum a series' values by regex, without the Prometheus parser."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


@pytest.mark.skipif(not REAL.exists(), reason=f"{REAL} not captured yet")
def test_real_vllm_032_page() -> None:
    text = REAL.read_text()
    m = parse_vllm_metrics(text, now=0.0)
    assert m.kv_usage_source == KV_USAGE
    assert m.kv_usage is not None and 0.0 <= m.kv_usage <= 1.0
    assert m.engines == ("0",)  # one engine without data parallelism
    assert m.running == _grep_sum(text, "vllm:num_requests_running")
    assert m.waiting == _grep_sum(text, "vllm:num_requests_waiting")
    assert set(m.waiting_by_reason) == {"capacity", "deferred"}
    for field, name in [
        ("preemptions_total", "vllm:num_preemptions_total"),
        ("prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("admission_rejections_total", "vllm:admission_rejections_total"),
        ("ttft_sum_s", "vllm:time_to_first_token_seconds_sum"),
        ("ttft_count", "vllm:time_to_first_token_seconds_count"),
        ("prefill_time_sum_s", "vllm:request_prefill_time_seconds_sum"),
        ("request_prompt_tokens_sum", "vllm:request_prompt_tokens_sum"),
        ("prefill_computed_tokens_sum", "vllm:request_prefill_kv_computed_tokens_sum"),
    ]:
        assert getattr(m, field) == pytest.approx(_grep_sum(text, name)), field
    assert m.prompt_tokens_total is not None and m.prompt_tokens_total > 0  # traffic was sent
    assert m.ttft_count is not None and m.ttft_count > 0
    # block_size × num_gpu_blocks must agree with the server's own kv_cache_size_tokens label.
    size = re.search(r'kv_cache_size_tokens="(\d+)"', text)
    assert size is not None
    assert m.kv_capacity_tokens == int(size.group(1))
    assert m.block_size is not None and m.block_size % 32 == 0  # CPU builds need multiples of 32
    assert m.process_start_time_s is not None


@pytest.mark.skipif(not REAL_IDLE.exists(), reason=f"{REAL_IDLE} not captured yet")
def test_real_vllm_032_idle_page() -> None:
    m = parse_vllm_metrics(REAL_IDLE.read_text(), now=0.0)
    assert m.kv_usage == 0.0
    assert (m.running, m.waiting) == (0, 0)


def test_every_summed_series_reaches_its_field() -> None:
    # Guards the name → field table against a field that is declared but never filled.
    from marsproxy.probes.vllm_metrics import _SUMMED

    lines = [f'{name}{{engine="0"}} {i + 1}.0' for i, name in enumerate(_SUMMED)]
    lines += [f'{name}{{engine="1"}} {i + 1}.0' for i, name in enumerate(_SUMMED)]
    m = parse_vllm_metrics("\n".join(lines) + "\n", now=0.0)
    for i, field in enumerate(_SUMMED.values()):
        assert getattr(m, field) == 2 * (i + 1), field


def test_lines_not_read_are_not_validated() -> None:
    # Only the series read here go through the parser (a real page costs ~15x less this way).
    text = (
        'vllm:num_requests_running{engine="0"} 2.0\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3" 1.0\n'
        "unrelated garbage line\n"
    )
    assert parse_vllm_metrics(text, now=0.0).running == 2


def test_known_cache_config_skips_the_info_line() -> None:
    if not REAL.exists():
        pytest.skip("real vLLM fixture absent")
    text = REAL.read_text()
    full = parse_vllm_metrics(text, 1.0)
    assert full.block_size is not None and full.num_gpu_blocks is not None
    fast = parse_vllm_metrics(text, 1.0, known_cache_config=(full.block_size, full.num_gpu_blocks))
    assert fast == full
    # The known values are what is reported: the line really is not read.
    other = parse_vllm_metrics(text, 1.0, known_cache_config=(64, 7))
    assert (other.block_size, other.num_gpu_blocks) == (64, 7)
