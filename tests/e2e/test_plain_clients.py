"""A plain client on an idle engine, on defaults: one-call sessions, each with its own session id
and no final flag (a batch of one-shot tasks through a stock OpenAI client). Every session is
served without waiting for another to end: there is no count ceiling at 30 sessions, and
sessions idle between calls hold no slot that blocks the next."""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest

from marsproxy.bench.procs import CLI, free_port, stop_all, wait_up

SESSIONS = 200


@pytest.fixture
def proxy_url() -> Iterator[str]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wport, pport = free_port(), free_port()
        worker = subprocess.Popen(
            [*CLI, "emulate", "--profile", "tiny", "--num-blocks", "512", "--port", str(wport)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(worker)
        wait_up(f"http://127.0.0.1:{wport}/health", worker)
        proxy = subprocess.Popen(  # no config file: the embedded defaults
            [*CLI, "serve", "--worker", f"http://127.0.0.1:{wport}", "--port", str(pport)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proxy)
        url = f"http://127.0.0.1:{pport}"
        wait_up(f"{url}/readyz", proxy)
        yield url
    finally:
        stop_all(procs)


def _call(url: str, session: str, i: int) -> float:
    body = json.dumps({"model": "tiny-emulated", "max_tokens": 4, "messages": [
        {"role": "user", "content": f"task {i}: fix the failing test in module {i}. " * 20}]})
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(), headers={
        "content-type": "application/json", "x-session-id": session})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        json.loads(r.read())
    return time.monotonic() - t0


def _state(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/mars/v1/state", timeout=10) as r:
        doc: dict[str, object] = json.loads(r.read())
    return doc


def test_one_shot_sessions_on_an_idle_engine_never_wait_for_a_slot(proxy_url: str) -> None:
    run = str(time.time())
    latencies = [_call(proxy_url, f"task-{i}-{run}", i) for i in range(SESSIONS)]
    adm = _state(proxy_url)["admission"]
    assert isinstance(adm, dict)
    (worker,) = adm["workers"].values()
    # None sent a final flag: each stays admitted until its idle timeout (60 s without tool
    # history), so far more than the old ceiling of 30 are admitted at once, and none waits.
    assert worker["admitted"] > 30
    assert adm["queue"]["length"] == 0 and adm["queue"]["pending"] == 0
    # Before, session 31 waited out the first idle timeout (57–60 s). Admission now takes at
    # most a control tick or two (printed: the figure the docs quote); the bound here is only
    # far above it, for a shared and noisy machine.
    worst = max(latencies)
    print(f"worst {worst:.3f} s, mean {sum(latencies) / SESSIONS:.3f} s over {SESSIONS}")
    assert worst < 10.0


def test_concurrent_one_shot_sessions_hold_no_kv_room_once_answered(proxy_url: str) -> None:
    # Eight at a time, as a batch client sends them. Each session stays open until its idle
    # timeout, but none has ever come back after its first call, so none holds KV room in the
    # forecast fit while away: the room stays what an empty worker has. (Before, each held its
    # forecast for kv_hold_min_s, 20 s: a few filled the 512 blocks, and the rest were let in
    # one at a time, whenever the engine went idle.)
    from concurrent.futures import ThreadPoolExecutor

    run = str(time.time())
    with ThreadPoolExecutor(8) as pool:
        latencies = list(pool.map(lambda i: _call(proxy_url, f"batch-{i}-{run}", i),
                                  range(SESSIONS)))
    assert len(latencies) == SESSIONS
    adm = _state(proxy_url)["admission"]
    assert isinstance(adm, dict)
    (worker,) = adm["workers"].values()
    assert worker["admitted"] > 30 and adm["queue"]["length"] == 0
    usable = 512 - math.ceil(0.1 * 512)  # less the default kv_reserve_frac
    # Nothing in a call and nothing held: the forecast fit's whole room (at growth 2, the
    # prior: no session has ended yet), or more where the cheap-preemption ceiling applies.
    assert adm["peak_growth"] == 2.0 and worker["peak_room_blocks"] >= usable // 2
    print(f"mean {sum(latencies) / SESSIONS:.3f} s, worst {max(latencies):.3f} s")
