"""/metrics under load: usage while requests run, KV exhaustion causing waiting and preemption;
and the ``marsproxy emulate`` command as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.emulator.server import RUNNER_KEY

StartEmulator = Callable[..., Awaitable[TestServer]]


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Sample values by name, summed over label sets (enough for these checks)."""
    async with http.get(url) as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def test_metrics_move_while_requests_run(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(time_scale=2.0)
    url = str(server.make_url("/metrics"))
    before = await _metrics(http, url)
    assert before["vllm:kv_cache_usage_perc"] == 0.0
    resp = await http.post(
        server.make_url("/v1/completions"),
        json={"prompt": "x" * 400, "max_tokens": 300, "ignore_eos": True, "stream": True},
    )
    await resp.content.readline()  # first token is out: the request is running
    during = await _metrics(http, url)
    assert during["vllm:kv_cache_usage_perc"] > 0.0
    assert during["vllm:num_requests_running"] == 1.0
    resp.close()


async def test_metrics_slash_renders_only_the_named_series_as_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # vLLM 0.32 serves prometheus_client's app at /metrics/ (name[] filters the page) and the
    # instrumentator's whole page at /metrics (name[] ignored); the emulator does the same.
    server = await start_emulator()
    names = [("name[]", "vllm:kv_cache_usage_perc"), ("name[]", "vllm:num_requests_running")]
    filtered = await _metrics(http, str(server.make_url("/metrics/").with_query(names)))
    assert set(filtered) == {"vllm:kv_cache_usage_perc", "vllm:num_requests_running"}
    whole = await _metrics(http, str(server.make_url("/metrics").with_query(names)))
    assert len(whole) > 20 and "vllm:num_preemptions_total" in whole
    assert (await _metrics(http, str(server.make_url("/metrics/")))).keys() == whole.keys()


async def test_small_kv_cache_fills_and_preempts(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # 64 blocks x 16 = 1,024 tokens; each session needs ~(150 + 60) tokens = 14 blocks.
    server = await start_emulator(num_blocks=64, time_scale=0.5)
    engine = server.app[RUNNER_KEY].engine
    url = str(server.make_url("/metrics"))
    sessions = 24
    peak = {"waiting": 0.0, "usage": 0.0}
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            m = await _metrics(http, url)
            peak["waiting"] = max(peak["waiting"], m["vllm:num_requests_waiting"])
            peak["usage"] = max(peak["usage"], m["vllm:kv_cache_usage_perc"])
            await asyncio.sleep(0.01)

    async def session(i: int) -> int:
        body = {
            "messages": [{"role": "user", "content": f"session {i:03d} " + "y" * 560}],
            "max_tokens": 60,
            "ignore_eos": True,
        }
        async with http.post(server.make_url("/v1/chat/completions"), json=body) as resp:
            assert resp.status == 200
            data = await resp.json()
            return int(data["usage"]["completion_tokens"])

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(session(i) for i in range(sessions)))
    done.set()
    await watcher
    assert results == [60] * sessions
    assert peak["waiting"] > 0 and peak["usage"] > 0.8
    assert engine.num_preemptions > 0
    final = await _metrics(http, url)
    # vLLM 0.32 reports a preemption when the request resumes; all resumed by now.
    assert final["vllm:num_preemptions_total"] == engine.num_preemptions
    assert final["vllm:request_success_total"] == sessions
    assert final["vllm:kv_cache_usage_perc"] == 0.0
    assert final["vllm:generation_tokens_total"] == 60 * sessions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_cli_emulate_subprocess(http: aiohttp.ClientSession) -> None:
    port = _free_port()
    exe = Path(sys.executable).with_name("marsproxy")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "marsproxy.cli"]
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        "emulate",
        "--profile",
        "tiny",
        "--port",
        str(port),
        "--num-blocks",
        "128",
        # vLLM's own switch for the Responses store, read from the environment as vLLM does.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                async with http.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("emulator did not become healthy")
        async with http.post(
            f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 3}
        ) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 3
        m = await _metrics(http, f"{base}/metrics")
        assert m["vllm:cache_config_info"] == 1.0
        async with http.post(f"{base}/v1/responses", json={"input": "hi"}) as resp:
            first = (await resp.json())["id"]
        async with http.post(f"{base}/v1/responses", json={
                "input": "go on", "previous_response_id": first}) as resp:
            assert resp.status == 200, await resp.text()  # kept: the store is on
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0  # clean shutdown on SIGTERM
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
