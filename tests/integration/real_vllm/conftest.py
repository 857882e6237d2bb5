"""What the real-vLLM tests share: where the install is, when they run, and a server starter.

They need ``scripts/real-vllm/setup.sh`` (installs into ``$MARS_REAL_VLLM_HOME``, default
``~/.cache/marsproxy/real-vllm``) and ``MARS_REAL_VLLM_TESTS=1`` (they cost minutes; `.ci/run`
sets it); every test in this folder is skipped otherwise, saying which is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from marsproxy.bench.procs import free_port
from marsproxy.config import load_config
from marsproxy.gateway.http.app import Running, start

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts" / "real-vllm"
HOME = Path(os.environ.get("MARS_REAL_VLLM_HOME")
            or Path.home() / ".cache" / "marsproxy" / "real-vllm")
MODEL = HOME / "models" / "tiny"
INSTALLED = (HOME / "venv" / "bin" / "python").exists() and (MODEL / ".built").exists()
WANTED = os.environ.get("MARS_REAL_VLLM_TESTS") == "1"
HERE = Path(__file__).resolve().parent

StartVllm = Callable[..., contextlib.AbstractContextManager[str]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = None
    if not INSTALLED:
        skip = f"real vLLM not installed at {HOME} (run scripts/real-vllm/setup.sh tiny)"
    elif not WANTED:
        skip = ("real vLLM installed; set MARS_REAL_VLLM_TESTS=1 to run these (minutes;"
                " .ci/run does)")
    if skip is None:
        return
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.skip(reason=skip))


@contextlib.contextmanager
def _serve(policy: str, *extra: str, **env_extra: str) -> Iterator[str]:
    """A tiny-model server (``scripts/real-vllm/start.sh``) on a free port, stopped after."""
    port = free_port()
    env = {**os.environ, "SCHEDULING_POLICY": policy, "SERVED_MODEL_NAME": "tiny",
           "HEALTH_TIMEOUT": "150", **env_extra}
    subprocess.run([str(SCRIPTS / "start.sh"), str(MODEL), str(port), *extra], env=env,
                   check=True, timeout=180, stdout=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([str(SCRIPTS / "stop.sh"), str(port)], check=False, timeout=60,
                       stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def start_vllm() -> StartVllm:
    """``with start_vllm(policy, *vllm_args, **env) as url:`` runs a real server."""
    return _serve


@pytest.fixture(scope="session")
def vllm_dev(start_vllm: StartVllm) -> Iterator[str]:
    """One server for every module that can share it: ``--scheduling-policy priority``,
    ``--enable-prompt-tokens-details`` (cached tokens in usage), the dev routes
    (``VLLM_SERVER_DEV_MODE``: ``/reset_prefix_cache``) and the Responses API's store
    (``previous_response_id``)."""
    with start_vllm("priority", "--enable-prompt-tokens-details", VLLM_SERVER_DEV_MODE="1",
                    VLLM_ENABLE_RESPONSES_API_STORE="1") as url:
        yield url


@pytest.fixture
async def dev_proxy(vllm_dev: str) -> AsyncIterator[Running]:
    """The proxy on defaults in front of the shared server, marked ``priority: true``."""
    cfg = load_config(environ={}, overrides={
        "server": {"port": 0},
        "workers": [{"url": vllm_dev, "name": "vllm", "priority": True}],
        "probes": {"nvml": {"enabled": False}},
    })
    running = await start(cfg)
    try:
        yield running
    finally:
        await running.stop()


class LlmEnds:
    """The proxy's ``llm_end`` events as they come (``/mars/v1/events``)."""

    def __init__(self, base: str) -> None:
        self.events: list[dict[str, Any]] = []
        self._reader = asyncio.create_task(self._read(base))

    async def _read(self, base: str) -> None:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(
            f"{base}/mars/v1/events?format=ndjson&type=llm_end"
        ) as r:
            async for line in r.content:
                if line.strip():
                    self.events.append(json.loads(line))

    async def wait(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` events (a bounded poll)."""
        for _ in range(200):
            if len(self.events) >= n:
                break
            await asyncio.sleep(0.05)
        assert len(self.events) >= n, self.events
        return self.events

    def close(self) -> None:
        self._reader.cancel()


@pytest.fixture
async def llm_ends(dev_proxy: Running) -> AsyncIterator[LlmEnds]:
    """``dev_proxy``'s ``llm_end`` events, subscribed before the test's first call."""
    ends = LlmEnds(f"http://127.0.0.1:{dev_proxy.port}")
    await asyncio.sleep(0.2)
    try:
        yield ends
    finally:
        ends.close()


@pytest.fixture(scope="session")
def real_vllm_run_dir() -> Path:
    """Where start.sh writes each server's pid file (``vllm-PORT.pid``)."""
    return Path(os.environ.get("RUN_DIR") or HOME / "run")


# The KV-event modules' server: a small cache (evictions within a few prompts) that publishes
# its KV events (and keeps them for replay); each module starts its own, from a clean cache.
KV_BLOCK_SIZE, KV_NUM_BLOCKS = 32, 40


@pytest.fixture(scope="module")
def vllm_kv(start_vllm: StartVllm) -> Iterator[tuple[str, int, int]]:
    """(url, publisher port, replay port)."""
    pub, replay = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}
    with start_vllm("fcfs", "--kv-events-config", json.dumps(cfg),
                    "--enable-prompt-tokens-details", NUM_BLOCKS=str(KV_NUM_BLOCKS),
                    BLOCK_SIZE=str(KV_BLOCK_SIZE),
                    MAX_MODEL_LEN=str((KV_NUM_BLOCKS - 4) * KV_BLOCK_SIZE)) as url:
        yield url, pub, replay
