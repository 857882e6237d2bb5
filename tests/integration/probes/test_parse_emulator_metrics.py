"""The vLLM parser on pages served by the emulated worker (the other half of the fixtures)."""

from __future__ import annotations

import aiohttp

from marsproxy.bench.local import start_local
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.probes.vllm_metrics import parse_vllm_metrics
from marsproxy.probes.vllm_rates import MetricsTracker


async def test_emulator_metrics_parse_and_move() -> None:
    server = await start_local(create_app(EmulatorOptions(profile="tiny", time_scale=0.05)))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/metrics") as r:
                idle = parse_vllm_metrics(await r.text(), 1.0)
            async with http.get(f"{server.url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            body = {"model": model, "prompt": "x" * 4000, "max_tokens": 4, "ignore_eos": True}
            for _ in range(2):  # the second call hits the prefix cache
                async with http.post(f"{server.url}/v1/completions", json=body) as r:
                    assert r.status == 200
            async with http.get(f"{server.url}/metrics") as r:
                busy = parse_vllm_metrics(await r.text(), 2.0)
    finally:
        await server.stop()
    assert idle.engines == ("0",) and idle.kv_usage_source == "vllm:kv_cache_usage_perc"
    assert (idle.block_size, idle.num_gpu_blocks) == (16, 512)
    assert idle.running == 0 and idle.waiting == 0 and idle.kv_usage == 0.0
    assert busy.prompt_tokens_total == 2000  # two 1000-token prompts (4 bytes per token)
    assert busy.prefix_cache_queries_total == 2000
    assert busy.prefix_cache_hits_total is not None and busy.prefix_cache_hits_total >= 992
    assert busy.ttft_count == 2
    tracker = MetricsTracker()
    tracker.update(idle)
    rates = tracker.update(busy)
    assert rates.prefix_cache_hit_rate is not None and 0.45 < rates.prefix_cache_hit_rate < 0.55
