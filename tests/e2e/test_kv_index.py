"""The proxy's KV index against emulated workers, end to end (real processes, real ZMQ):
``marsproxy emulate --kv-events-config`` publishes, ``marsproxy serve`` subscribes, and the
state document and /metrics show what each worker holds. A worker restart starts its index
over; a worker whose publisher is dead is served exactly as without one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from marsproxy.bench.procs import Service, free_port
from tests.e2e.http_calls import chat, get, until


def _kv_flag(pub: int, replay: int) -> tuple[str, ...]:
    return ("--num-blocks", "64", "--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}))


def _chat(url: str, session: str, text: str) -> None:
    chat(url, session, [{"role": "user", "content": text}], max_tokens=3)


def _healthy(proxy: Service, name: str) -> bool:
    """Whether the proxy's health check has seen worker ``name`` up: until it has, new
    sessions all go to the other worker and nothing reaches this one."""
    workers = json.loads(get(f"{proxy.url}/mars/v1/state"))["workers"]
    return bool(next(w["healthy"] for w in workers if w["name"] == name))


def _until_blocks(proxy: Service, index: Any, life: str) -> int:
    """New sessions, one at a time, until the worker's index shows blocks of one of them.
    Placement spreads new sessions over both workers, by what each holds at that moment,
    so which of them reach the worker with the publisher depends on timing."""
    for i in range(24):
        _chat(proxy.url, f"{life}{i}", f"{life} life {i} " * 30)
        try:
            return int(until("blocks", lambda: index()["blocks"].get("GPU"), timeout_s=1.0))
        except AssertionError:
            continue
    raise AssertionError(f"no blocks in the index after 24 {life} sessions")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Service, Service]]:
    """The worker with a live publisher and the proxy (a second worker's publisher is dead)."""
    pub, replay, dead = free_port(), free_port(), free_port()
    kv = Service.emulator(tmp_path, "kv", time_scale=0.01, extra=_kv_flag(pub, replay))
    plain = Service.emulator(tmp_path, "plain", time_scale=0.01)
    started: list[Service] = []
    try:
        started += [kv.start(), plain.start()]
        cfg = {"workers": [
            {"url": kv.url, "name": "kv", "kv_events": {
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}},
            # a publisher nobody runs: no index, the worker serves as without kv_events
            {"url": plain.url, "name": "plain", "kv_events": {
                "endpoint": f"tcp://127.0.0.1:{dead}", "topic": "kv"}},
        ], "admission": {"enabled": False}}
        path = tmp_path / "marsproxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proxy = Service.proxy(tmp_path, "proxy", path)
        started.append(proxy.start())
        yield kv, proxy
    finally:
        for s in reversed(started):
            s.stop()


def test_state_and_metrics_show_each_workers_index(stack: tuple[Service, Service]) -> None:
    _kv, proxy = stack

    def index() -> dict[str, Any]:
        doc = json.loads(get(f"{proxy.url}/mars/v1/state"))
        return doc["kv_index"]  # type: ignore[no-any-return]

    until("a connection to the live publisher", lambda: index()["kv"]["connected"])
    until("both workers healthy", lambda: _healthy(proxy, "kv") and _healthy(proxy, "plain"))
    shared = "You are a careful coding agent working in a large repository. " * 8
    for i in range(8):  # sessions spread over both workers; placement keeps each on one
        _chat(proxy.url, f"s{i}", shared + f"task {i}")
    state = until("events in the index",
                   lambda: index()["kv"] if index()["kv"]["blocks"].get("GPU") else None)
    assert state["usable"] and state["block_size"] == 16 and state["events_total"] > 0
    assert state["resyncs_total"] == 0 and state["bad_frames_total"] == 0
    assert state["sessions"] >= 1  # the proxy put its session key in each body's session_id
    dead = index()["plain"]
    assert not dead["connected"] and not dead["usable"] and dead["blocks"] == {}

    metrics = get(f"{proxy.url}/metrics").decode()
    assert 'marsproxy_kv_index_blocks{medium="GPU",worker="kv"}' in metrics
    assert 'marsproxy_kv_events_total{worker="kv"}' in metrics
    assert 'marsproxy_kv_index_resyncs_total{worker="kv"} 0.0' in metrics
    assert 'marsproxy_kv_index_usable{worker="plain"} 0.0' in metrics


def test_a_restarted_worker_starts_its_index_over(stack: tuple[Service, Service]) -> None:
    kv, proxy = stack

    def kv_state() -> dict[str, Any]:
        return json.loads(get(f"{proxy.url}/mars/v1/state"))["kv_index"]["kv"]  # type: ignore[no-any-return]

    until("a connection", lambda: kv_state()["connected"])
    until("both workers healthy", lambda: _healthy(proxy, "kv") and _healthy(proxy, "plain"))
    before = _until_blocks(proxy, kv_state, "first")
    kv.kill()
    until("the disconnect", lambda: not kv_state()["connected"])
    assert not kv_state()["usable"]
    kv.start()  # the same ports: a new process, its sequence numbers from 0 again
    until("the reconnect", lambda: kv_state()["connects_total"] >= 2)
    state = until("the new index", lambda: kv_state() if kv_state()["usable"] else None,
                   timeout_s=30)
    assert state["blocks"].get("GPU", 0) == 0 < before  # the old process's blocks are gone
    until("the worker healthy again", lambda: _healthy(proxy, "kv"))
    _until_blocks(proxy, kv_state, "second")
