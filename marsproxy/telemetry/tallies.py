"""Counters and histograms of the request path: plain numbers, exposed at scrape time.

``prometheus_client``'s metrics take a lock and run checks on every update: about 1.3 µs per
counter increment and 4 µs per histogram observation here, and a request makes a dozen such
updates (plus 14 µs for an uncached ``labels()``). The gateway updates its request-path metrics
from the event loop's thread only, so they need no lock: a tally is a float, a histogram child
a list of bucket counts and a sum. A collector hands them to ``prometheus_client`` as metric
families when ``/metrics`` is scraped; the exposition (names, help, labels, ``_total``,
``_bucket``/``_count``/``_sum``, ``_created``) is the same as that of the library's own
``Counter`` and ``Histogram`` (a unit test compares them).

Not thread-safe: update only from the event loop's thread (the relay's handlers).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

INF = float("inf")


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds  # ascending, +Inf last
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bound >= amount: Prometheus buckets are "less than or equal".
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class _Family:
    """A labelled metric: its children by label values (bounded sets, see gateway.metrics)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)

    def _check(self, values: tuple[str, ...]) -> None:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")


class Tally(_Family):
    """A labelled counter (``<name>_total`` and ``<name>_created`` at scrape time)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__(name, documentation, labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            self._check(values)
            child = self._children[values] = CounterChild()
        return child

    def collect(self) -> Metric:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            fam.add_metric(values, child.value, created=child.created)
        return fam


class Distribution(_Family):
    """A labelled histogram with fixed buckets (``+Inf`` added, as the library does)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Iterable[float]
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        self._bounds = tuple(bounds)
        self._le = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self._children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            self._check(values)
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def collect(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative, buckets = 0, []
            for le, n in zip(self._le, child.counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            fam.add_metric(values, buckets, child.sum)
            fam.add_sample(
                self.name + "_created", dict(zip(self.labelnames, values, strict=True)),
                child.created,
            )
        return fam


class Level:
    """A gauge the request path moves up and down (read by a ``set_function`` gauge)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class TallyCollector(Collector):
    """Exposes tallies and distributions through a ``CollectorRegistry``."""

    def __init__(self, families: Sequence[Tally | Distribution]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return [f.collect() for f in self._families]

    def describe(self) -> Iterable[Metric]:
        # Names only, so the registry can refuse a duplicate at registration.
        return [
            CounterMetricFamily(f.name, f.documentation, labels=f.labelnames)
            if isinstance(f, Tally)
            else HistogramMetricFamily(f.name, f.documentation, labels=f.labelnames)
            for f in self._families
        ]

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)
