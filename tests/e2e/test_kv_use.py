"""The KV index in use, end to end (real processes, real ZMQ, real HTTP): three
``marsproxy emulate --kv-events-config`` workers behind ``marsproxy serve``. A new session whose
first prompt starts with a prefix one worker holds goes to that worker (``placement.policy:
prefix``), one with an unseen prompt goes to the least loaded; every call's cached tokens are
predicted and counted in ``marsproxy_kv_predictions_total``. With ``least_loaded`` the same
sessions spread as without KV events."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from marsproxy.bench.procs import Service, free_port
from tests.e2e.http_calls import chat, get, until


def _chat(url: str, session: str, messages: list[dict[str, str]]) -> None:
    chat(url, session, messages, max_tokens=4)


def _stack(tmp_path: Path, policy: str) -> Iterator[Service]:
    started: list[Service] = []
    try:
        workers = []
        for i in range(3):
            pub, replay = free_port(), free_port()
            flag = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                               "endpoint": f"tcp://*:{pub}",
                               "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})
            emu = Service.emulator(tmp_path, f"w{i}", time_scale=0.01,
                                   extra=("--num-blocks", "512", "--kv-events-config", flag))
            started.append(emu.start())
            workers.append({"url": emu.url, "name": f"w{i}", "kv_events": {
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}})
        cfg = {"workers": workers, "placement": {"policy": policy}}
        path = tmp_path / "marsproxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proxy = Service.proxy(tmp_path, "proxy", path)
        started.append(proxy.start())
        yield proxy
    finally:
        for s in reversed(started):
            s.stop()


@pytest.fixture
def prefix_proxy(tmp_path: Path) -> Iterator[Service]:
    yield from _stack(tmp_path, "prefix")


@pytest.fixture
def least_loaded_proxy(tmp_path: Path) -> Iterator[Service]:
    yield from _stack(tmp_path, "least_loaded")


def _state(url: str) -> dict[str, Any]:
    return json.loads(get(f"{url}/mars/v1/state?sessions=1"))  # type: ignore[no-any-return]


def _worker_of(url: str, session: str) -> str:
    rows = _state(url)["sessions"]["details"]
    return next(str(r["worker"]) for r in rows if r["id"] == session)


def _usable(url: str) -> bool:
    """Every worker scraped (else it is not placeable yet) and its index in sequence."""
    st = _state(url)
    # The plane's own view (its last control tick), not only the scraper's.
    scraped = all(not w["stale"] for w in st["admission"]["workers"].values())
    return scraped and all(st["kv_index"][w]["usable"] for w in ("w0", "w1", "w2"))


_SHARED = [{"role": "system", "content": "You are a careful coding agent. " * 60},
           {"role": "user", "content": "The repository's context: " + "module x; " * 80}]


def _place_group(url: str) -> dict[str, str]:
    until("usable indexes", lambda: _usable(url))
    _chat(url, "seed", [*_SHARED, {"role": "user", "content": "task seed"}])
    seed = _worker_of(url, "seed")
    until("the seed's blocks in the index",
           lambda: _state(url)["kv_index"][seed]["blocks"].get("GPU"))
    _chat(url, "same", [*_SHARED, {"role": "user", "content": "task two"}])
    _chat(url, "other", [{"role": "user", "content": "an unrelated prompt " * 50}])
    return {"seed": seed, "same": _worker_of(url, "same"), "other": _worker_of(url, "other")}


def _predictions(url: str) -> dict[str, float]:
    text = get(f"{url}/metrics").decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'marsproxy_kv_predictions_total\{outcome="(\w+)",worker="\w+"\} '
                         r'([0-9.e+]+)', text):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_prefix_placement_and_predictions(prefix_proxy: Service) -> None:
    url = prefix_proxy.url
    placed = _place_group(url)
    assert placed["same"] == placed["seed"]  # its first prompt's prefix is cached there
    assert placed["other"] != placed["seed"]  # nothing cached anywhere: least loaded
    # A second call of the seed session: its whole history is resident, predicted exactly.
    _chat(url, "seed", [*_SHARED, {"role": "user", "content": "task seed"},
                        {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": "go on"}])
    counts = _predictions(url)
    assert sum(counts.values()) >= 4  # every call was predicted and compared
    assert counts.get("off", 0) == 0
    assert counts.get("exact", 0) >= 3


def test_least_loaded_ignores_the_prefix(least_loaded_proxy: Service) -> None:
    placed = _place_group(least_loaded_proxy.url)
    assert len(set(placed.values())) == 3  # one session per worker, as without KV events
