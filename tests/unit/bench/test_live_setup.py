"""``bench live`` against real workers that publish KV events: the flag's entries reach the
proxy's worker config as ``workers[].kv_events``."""

from __future__ import annotations

from pathlib import Path

import pytest

from marsproxy.bench.live import vllm_kv_events
from marsproxy.bench.live_setup import LiveSetup, start_workers
from marsproxy.config import MarsConfig


def test_endpoint_and_replay_become_the_workers_kv_events_entry() -> None:
    entries = vllm_kv_events(["tcp://127.0.0.1:8742, tcp://127.0.0.1:8743"], urls=1)
    assert entries == ({"endpoint": "tcp://127.0.0.1:8742", "topic": "kv",
                        "replay_endpoint": "tcp://127.0.0.1:8743"},)
    cfg = MarsConfig.model_validate(
        {"workers": [{"url": "http://127.0.0.1:8741", "kv_events": entries[0]}]})
    kv = cfg.workers[0].kv_events
    assert kv is not None
    assert (kv.endpoint, kv.replay_endpoint, kv.topic) == (
        "tcp://127.0.0.1:8742", "tcp://127.0.0.1:8743", "kv")


def test_replay_is_optional() -> None:
    assert vllm_kv_events(["tcp://10.0.0.2:5557"], urls=2) == (
        {"endpoint": "tcp://10.0.0.2:5557", "topic": "kv"},)


@pytest.mark.parametrize("values, urls", [
    (["127.0.0.1:5557"], 1),  # no scheme
    (["tcp://a:1,tcp://a:2,tcp://a:3"], 1),  # three endpoints
    (["tcp://a:1", "tcp://b:1"], 1),  # more than the workers
])
def test_bad_values_are_refused_with_the_flag_named(values: list[str], urls: int) -> None:
    with pytest.raises(ValueError, match="--vllm-kv-events"):
        vllm_kv_events(values, urls)


def test_real_workers_hand_their_entries_to_the_proxy_in_url_order(tmp_path: Path) -> None:
    entries = vllm_kv_events(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], urls=2)
    setup = LiveSetup(vllm_urls=("http://a:1", "http://b:1"), vllm_kv_events=entries)
    kv: dict[str, dict[str, str]] = {}
    with start_workers(setup, False, tmp_path, kv) as workers:
        assert workers == ["http://a:1", "http://b:1"]
    assert kv == {"http://a:1": entries[0], "http://b:1": entries[1]}


def test_real_workers_without_the_flag_subscribe_to_nothing(tmp_path: Path) -> None:
    kv: dict[str, dict[str, str]] = {}
    with start_workers(LiveSetup(vllm_urls=("http://a:1",)), False, tmp_path, kv):
        pass
    assert kv == {}
