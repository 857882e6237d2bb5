"""The overhead clock: what ``x-marsproxy-overhead-ms`` and the overhead histogram count."""

from __future__ import annotations

import time

import pytest
from aiohttp import web

from marsproxy.gateway.shells.outcome import OVERHEAD_HEADER, Clock


class Ticks:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Ticks:
    t = Ticks()
    monkeypatch.setattr(time, "perf_counter", t)
    return t


def test_a_response_not_sent_yet_is_stamped_with_everything(ticks: Ticks) -> None:
    clock = Clock()
    ticks.now += 0.010
    clock.upstream_s += 0.007  # the worker
    clock.held_s += 0.002  # a wait for an admission slot
    resp = web.Response(body=b"{}", headers=clock.header())
    assert resp.headers[OVERHEAD_HEADER] == "1.000"
    clock.tail_begins()
    ticks.now += 0.0005  # the session ends, the release, the accounting
    assert clock.stamp(resp) == pytest.approx(0.0015)
    assert resp.headers[OVERHEAD_HEADER] == "1.500"


def test_a_stream_keeps_its_header_and_the_histogram_adds_the_after_work(ticks: Ticks) -> None:
    clock = Clock()
    ticks.now += 0.001
    headers = clock.header()  # sent with the stream's head
    assert headers[OVERHEAD_HEADER] == "1.000"
    ticks.now += 2.0  # the body streams: the worker's time, not counted
    clock.tail_begins()
    ticks.now += 0.0003
    assert clock.total_s() == pytest.approx(0.0013)
    assert clock.overhead_s() == pytest.approx(0.001)  # what the header said


def test_a_request_that_ended_without_a_response_counts_all_but_waits(ticks: Ticks) -> None:
    clock = Clock()
    ticks.now += 0.004
    clock.upstream_s = 0.003
    clock.tail_begins()
    ticks.now += 0.001
    assert clock.stamp(None) == pytest.approx(0.002)
