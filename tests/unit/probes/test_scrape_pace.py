"""ScrapePace: every period_s while a worker serves, every idle_period_s while it is idle."""

from __future__ import annotations

import pytest

from marsproxy.probes.scrape_pace import ScrapePace
from marsproxy.probes.vllm_metrics import WorkerMetrics

PACE = ScrapePace(period_s=0.2, idle_period_s=1.0)


def sample(running: int | None = 0, waiting: int | None = 0) -> WorkerMetrics:
    return WorkerMetrics(sampled_at=0.0, kv_usage=0.3, running=running, waiting=waiting)


def test_an_idle_worker_is_scraped_slowly() -> None:
    assert PACE.period(sample(), failing=False, busy=False) == 1.0
    # A page without the waiting gauge: what runs decides.
    assert PACE.period(sample(waiting=None), failing=False, busy=False) == 1.0


@pytest.mark.parametrize(
    ("latest", "failing", "busy", "why"),
    [
        (None, False, False, "nothing known yet"),
        (sample(), True, False, "its last scrape failed"),
        (sample(), False, True, "the proxy's calls run there, or sessions wait for it"),
        (sample(running=2), False, False, "someone else's calls run there"),
        (sample(waiting=3), False, False, "the engine queues requests"),
        (sample(running=None), False, False, "a page without the running gauge"),
    ],
)
def test_every_period_while_it_serves(
    latest: WorkerMetrics | None, failing: bool, busy: bool, why: str
) -> None:
    assert PACE.period(latest, failing=failing, busy=busy) == 0.2, why
