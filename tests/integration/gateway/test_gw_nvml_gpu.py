"""A real GPU's memory and load reach ``/mars/v1/state`` and ``/metrics`` through the gateway.

Skipped where NVML sees no GPU (CI); the fake-library version of this path runs everywhere
(``test_gw_state.py``).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.config import load_config
from marsproxy.gateway.http.app import start

pytestmark = pytest.mark.gpu


def _smi_memory_frac() -> float:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi is not installed")
    out = subprocess.run(
        [exe, "-i", "0", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    used, total = (float(v) for v in out.split(","))
    return used / total


async def test_gpu_of_a_worker_reaches_state_and_metrics(fake: Any) -> None:
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": fake.url, "name": "g0"}],
        "server": {"port": 0},
        "probes": {"nvml": {"gpus_by_worker": {"g0": [0]}, "period_s": 0.1}},
    })
    proxy = await start(cfg)
    try:
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{proxy.port}"
            for _ in range(100):
                async with http.get(base + "/mars/v1/state") as r:
                    gpu = (await r.json())["workers"][0]["gpu"]
                if gpu["available"]:
                    break
                await asyncio.sleep(0.1)
            async with http.get(base + "/metrics") as r:
                text = await r.text()
    finally:
        await proxy.stop()
    assert gpu["available"], gpu
    assert gpu["memory_used_frac"] == pytest.approx(_smi_memory_frac(), abs=0.01)
    assert 0.0 <= gpu["utilization_pct"] <= 100.0
    samples = {
        s.name: s for f in text_string_to_metric_families(text) for s in f.samples
        if s.name.startswith("marsproxy_worker_gpu_")
    }
    mem = samples["marsproxy_worker_gpu_memory_used_ratio"]
    assert mem.labels == {"worker": "g0"}
    assert mem.value == pytest.approx(gpu["memory_used_frac"], abs=0.01)
    assert "marsproxy_worker_gpu_utilization_percent" in samples
