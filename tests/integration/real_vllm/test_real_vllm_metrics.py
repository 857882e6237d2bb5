"""The scraper against a real vLLM 0.32 (CPU build, tiny model): it reads the filtered
``/metrics/`` page (only the series the proxy parses, a fraction of the CPU of the whole page)
and gets the same sample as from the whole page; it reads the server's ``max_model_len``. Needs
the real-vLLM install and ``MARS_REAL_VLLM_TESTS=1``; shares the ``vllm_dev`` server (conftest.py).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from urllib.parse import urlencode

import aiohttp

from marsproxy.probes.vllm_metrics import READ_NAMES, parse_vllm_metrics
from marsproxy.probes.vllm_scraper import VllmScraper


async def test_the_filtered_page_gives_the_whole_pages_sample(vllm_dev: str) -> None:
    async with aiohttp.ClientSession() as http:
        scraper = VllmScraper([("w", vllm_dev)], http, timeout_s=10.0)
        assert await scraper.scrape_once("w")
        sample = scraper.snapshot("w").metrics
        assert sample is not None
        async with http.get(vllm_dev.rstrip("/") + "/metrics") as r:
            whole = await r.text()
        query = urlencode([("name[]", n) for n in READ_NAMES])
        async with http.get(vllm_dev.rstrip("/") + "/metrics/?" + query) as r:
            filtered = await r.text()
    assert scraper.reads_filtered("w") is True
    # The longest context it serves, read from its /v1/models (start.sh's --max-model-len).
    assert scraper.snapshot("w").max_model_len == int(os.environ.get("MAX_MODEL_LEN") or 4096)
    # The server filtered it: a small part of the whole page.
    assert 0 < len(filtered) < len(whole) / 4
    # An idle server (nothing runs between the two reads): the same sample, field by field.
    reference = parse_vllm_metrics(whole, sample.sampled_at)
    assert asdict(sample) == asdict(reference)
    assert sample.kv_usage is not None and sample.num_gpu_blocks is not None
    assert sample.process_start_time_s is not None and sample.prefix_cache_queries_total is not None
