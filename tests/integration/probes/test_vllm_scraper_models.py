"""The scraper's read of ``/v1/models``: the longest context a worker serves (the forecasts'
cap in admission), once per server process, from the emulated worker and from scripted ones."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from marsproxy.bench.local import start_local
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.probes.vllm_scraper import VllmScraper, longest_context

PAGE = '''# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.25
'''


def test_longest_context_of_a_models_answer() -> None:
    two = {"object": "list", "data": [{"id": "m", "max_model_len": 4096},
                                      {"id": "lora", "max_model_len": 8192}]}
    assert longest_context(two) == 8192
    assert longest_context({"data": [{"id": "m"}]}) is None  # an OpenAI-style server
    for odd in (None, [], {"data": "x"}, {"data": [{"max_model_len": "4096"}]},
                {"data": [{"max_model_len": 0}, 7]}, {"data": [{"max_model_len": True}]}):
        assert longest_context(odd) is None


async def test_read_from_the_emulated_worker() -> None:
    opts = EmulatorOptions(profile="tiny", time_scale=0.05, num_blocks=256)
    server = await start_local(create_app(opts))
    try:
        async with aiohttp.ClientSession() as http:
            scraper = VllmScraper([("w", server.url)], http)
            assert scraper.snapshot("w").max_model_len is None
            assert await scraper.scrape_once("w")
            # tiny serves 8192, clamped to what 256 blocks of 16 hold.
            assert scraper.snapshot("w").max_model_len == 4096
    finally:
        await server.stop()


async def test_read_once_tried_again_after_an_error_and_after_a_restart() -> None:
    answers: list[tuple[int, Any]] = [(503, None), (200, {"data": [{"max_model_len": 2048}]})]
    hits = {"models": 0}
    start = {"t": 1.0}

    async def metrics(_: web.Request) -> web.Response:
        started = f"process_start_time_seconds {start['t']}\n"  # a new value: a restart
        return web.Response(text=PAGE + started, content_type="text/plain")

    async def models(_: web.Request) -> web.Response:
        hits["models"] += 1
        status, doc = answers[min(hits["models"], len(answers)) - 1]
        return web.json_response(doc, status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/", metrics)
    app.router.add_get("/v1/models", models)
    server = await start_local(app)
    try:
        async with aiohttp.ClientSession() as http:
            scraper = VllmScraper([("w", server.url)], http)
            assert await scraper.scrape_once("w")
            assert scraper.snapshot("w").max_model_len is None  # a 503: tried again
            assert await scraper.scrape_once("w")
            assert scraper.snapshot("w").max_model_len == 2048
            assert await scraper.scrape_once("w")
            assert hits["models"] == 2  # read, not read again
            answers[:] = [(404, None)]  # restarted without the route
            start["t"] = 2.0
            hits["models"] = 0
            assert await scraper.scrape_once("w")
            assert scraper.snapshot("w").max_model_len is None
            assert await scraper.scrape_once("w")
            assert hits["models"] == 1  # no route: not asked again until the next restart
    finally:
        await server.stop()
