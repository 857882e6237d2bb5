"""Against a real vLLM 0.32 (CPU build, tiny random model): the proxy's priority reaches the
engine and changes completion order, and the ``priority: auto`` probe tells a server run with
``--scheduling-policy priority`` from one without it (which accepts ``priority`` silently).

Needs ``scripts/real-vllm/setup.sh`` (installs into ``$MARS_REAL_VLLM_HOME``, default
``~/.cache/marsproxy/real-vllm``) and ``MARS_REAL_VLLM_TESTS=1``; skipped otherwise, saying
which is missing. Each server takes 20-60 s to start on
2 cores; the module starts two (priority, fcfs), one after the other.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.bench.procs import free_port
from marsproxy.config import load_config
from marsproxy.gateway.app import Running, start

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "scripts" / "real-vllm"
HOME = Path(os.environ.get("MARS_REAL_VLLM_HOME")
            or Path.home() / ".cache" / "marsproxy" / "real-vllm")
MODEL = HOME / "models" / "tiny"

INSTALLED = (HOME / "venv" / "bin" / "python").exists() and (MODEL / ".built").exists()
# They cost minutes (two server starts), so the plain suite leaves them to .ci/run, which runs
# them on their own with their time printed.
WANTED = os.environ.get("MARS_REAL_VLLM_TESTS") == "1"

pytestmark = [
    pytest.mark.skipif(
        not INSTALLED,
        reason=f"real vLLM not installed at {HOME} (run scripts/real-vllm/setup.sh tiny)",
    ),
    pytest.mark.skipif(
        INSTALLED and not WANTED,
        reason="real vLLM installed; set MARS_REAL_VLLM_TESTS=1 to run these (2-3 min;"
        " .ci/run does)",
    ),
]


def _server(policy: str, *extra: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "SCHEDULING_POLICY": policy, "SERVED_MODEL_NAME": "tiny",
           "HEALTH_TIMEOUT": "150"}
    subprocess.run([str(SCRIPTS / "start.sh"), str(MODEL), str(port), *extra], env=env,
                   check=True, timeout=180, stdout=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([str(SCRIPTS / "stop.sh"), str(port)], check=False, timeout=60,
                       stdout=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def vllm_priority() -> Iterator[str]:
    # One sequence at a time: everything after the blocker waits in the engine's own queue,
    # where --scheduling-policy priority orders it by the body's priority.
    yield from _server("priority", "--max-num-seqs", "1", "--max-num-batched-tokens", "512")


@pytest.fixture(scope="module")
def vllm_fcfs() -> Iterator[str]:
    yield from _server("fcfs", "--max-num-batched-tokens", "512")


async def _proxy(url: str, policy: str, priority: bool | str) -> Running:
    cfg = load_config(environ={}, overrides={
        "policy": policy, "server": {"port": 0},
        "workers": [{"url": url, "name": "vllm", "priority": priority}],
        "probes": {"nvml": {"enabled": False}},
    })
    return await start(cfg)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


async def _complete(http: aiohttp.ClientSession, base: str, session: str, prompt: list[int],
                    max_tokens: int, done: list[str]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    async with http.post(f"{base}/v1/completions", json=body,
                         headers={"x-session-id": session}) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
    done.append(session)
    return out


async def _blocker(http: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int,
                   done: list[str], running: asyncio.Event) -> None:
    """A streamed decode: its first token proves the engine runs it (its gauges may be stale)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with http.post(f"{base}/v1/completions", json=body,
                         headers={"x-session-id": "blocker"}) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content:
            running.set()
    done.append("blocker")


async def _engine_queue(http: aiohttp.ClientSession, engine: str) -> tuple[float, float]:
    """(running, waiting) requests as the engine's own /metrics reports them."""
    async with http.get(f"{engine}/metrics") as r:
        text = await r.text()
    found: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found[fam.name] = sum(s.value for s in fam.samples)
    return found.get("vllm:num_requests_running", 0.0), found.get("vllm:num_requests_waiting", 0.0)


async def _until_queued(http: aiohttp.ClientSession, engine: str, waiting: int,
                        blocker: asyncio.Task[Any]) -> bool:
    """Wait until the engine runs one request and holds ``waiting`` in its queue; False if the
    blocker finished first (then the engine never had to choose, and the run tells nothing)."""
    while not blocker.done():
        if await _engine_queue(http, engine) == (1.0, float(waiting)):
            return True
        await asyncio.sleep(0.02)
    return False


async def _order(http: aiohttp.ClientSession, base: str, engine: str) -> list[str]:
    """A blocker (a long decode) holds the engine's only slot; a long cold prompt (3000 tokens:
    level 1) queues behind it, then three short ones (level 0). Returns the completion order.

    The engine's own queue is watched, so the order is only read once all four waited while the
    blocker ran; if the blocker finished too soon (a fast or idle machine) it runs again with a
    longer decode instead of reporting an order the engine never chose.
    """
    rng = random.Random()

    def ids(n: int) -> list[int]:  # fresh ids: no prefix-cache hit shortens anything
        return [rng.randrange(100, 1000) for _ in range(n)]

    for decode in (1500, 3000, 3900):  # 8 + 3900 tokens still fit max_model_len 4096
        done: list[str] = []
        running = asyncio.Event()
        blocker = asyncio.create_task(_blocker(http, base, ids(8), decode, done, running))
        long = shorts = None
        try:
            started = asyncio.create_task(running.wait())
            await asyncio.wait([started, blocker], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            long = asyncio.create_task(_complete(http, base, "long", ids(3000), 1, done))
            if not await _until_queued(http, engine, 1, blocker):
                continue
            shorts = [asyncio.create_task(_complete(http, base, f"short{i}", ids(10), 2, done))
                      for i in range(3)]
            if not await _until_queued(http, engine, 4, blocker):
                continue
        finally:
            await asyncio.gather(blocker, *([long] if long else []), *(shorts or []))
        return done
    raise AssertionError(f"the blocker's decode ended before four requests queued behind it,"
                         f" even at {decode} tokens")


async def test_proxy_priority_reaches_the_engine_and_changes_completion_order(
    vllm_priority: str, http: aiohttp.ClientSession
) -> None:
    proxy = await _proxy(vllm_priority, "mars-no-admission", True)
    try:
        order = await _order(http, f"http://127.0.0.1:{proxy.port}", vllm_priority)
    finally:
        await proxy.stop()
    assert order[0] == "blocker" and order[-1] == "long", order
    # The same server and traffic through the fcfs preset (no priority in the body): the
    # engine serves in arrival order.
    proxy = await _proxy(vllm_priority, "fcfs", True)
    try:
        order = await _order(http, f"http://127.0.0.1:{proxy.port}", vllm_priority)
    finally:
        await proxy.stop()
    assert order[:2] == ["blocker", "long"], order


async def _probed(url: str) -> tuple[str, str]:
    proxy = await _proxy(url, "mars-no-admission", "auto")
    try:
        shell = proxy.gateway.scheduler
        for _ in range(600):
            if not shell.mode_reason["vllm"].startswith("auto: probe pending"):
                break
            await asyncio.sleep(0.1)
        return shell.core.modes["vllm"], shell.mode_reason["vllm"]
    finally:
        await proxy.stop()


async def test_auto_probe_finds_priority_on_a_priority_server(vllm_priority: str) -> None:
    mode, reason = await _probed(vllm_priority)
    assert mode == "priority", reason


async def test_auto_probe_finds_no_priority_on_a_default_server(vllm_fcfs: str) -> None:
    mode, reason = await _probed(vllm_fcfs)
    assert mode == "gated", reason
    assert "no priority ordering" in reason
