"""What the real-vLLM tests share: where the install is, when they run, and a server starter.

They need ``scripts/real-vllm/setup.sh`` (installs into ``$MARS_REAL_VLLM_HOME``, default
``~/.cache/marsproxy/real-vllm``) and ``MARS_REAL_VLLM_TESTS=1`` (they cost minutes; `.ci/run`
sets it); every test in this folder is skipped otherwise, saying which is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from marsproxy.bench.procs import free_port

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
