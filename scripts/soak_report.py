"""What scripts/soak.py measures and what it concludes: the samples of the proxies, the
sessions' tally, and the report with its pass/fail checks printed at the end of a run.

Kept apart from soak.py so that neither file is over 400 lines; run the soak through soak.py.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from dataclasses import dataclass, field

MiB = 1 << 20


@dataclass
class Sample:
    t: float
    fds: int
    rss: int
    tasks: int
    in_flight: int
    admitted: int
    queued: int
    sessions: int
    ledger_blocks: int = 0  # KV blocks reserved in the scheduler's ledger (retained sessions)
    dispatch_queued: int = 0  # continuations held in the gated dispatch queues


@dataclass
class Tally:
    completed: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    requests: int = 0


def report(
    args: argparse.Namespace, tally: Tally, baseline: Sample, samples: list[Sample], end: Sample,
    upstream: float, leftovers: dict[str, int], run_s: float,
) -> int:
    warm = [s for s in samples if s.t >= run_s * args.warmup_frac] or samples[-1:]
    after_warm = warm[0]
    peak_rss = max(s.rss for s in warm)
    mins = max(1e-9, (warm[-1].t - warm[0].t) / 60)
    slope = (warm[-1].rss - warm[0].rss) / MiB / mins if len(warm) > 1 else 0.0
    print()
    print(f"run: {run_s:.0f} s, {tally.requests} requests, "
          f"{tally.requests / run_s:.1f} req/s, {args.sessions / run_s:.1f} sessions/s")
    print(f"sessions: {tally.completed} completed, {sum(tally.refused.values())} refused "
          f"({dict(tally.refused) or 'none'}), {len(tally.lost)} lost")
    for line in tally.lost[:10]:
        print(f"  lost: {line}")
    print()
    print(f"{'':24}{'baseline':>12}{'after warm-up':>15}{'peak':>12}{'end':>12}")
    rows = [
        ("open fds", baseline.fds, after_warm.fds, max(s.fds for s in warm), end.fds, 1),
        ("event-loop tasks", baseline.tasks, after_warm.tasks, max(s.tasks for s in warm),
         end.tasks, 1),
        ("RSS (MiB)", baseline.rss, after_warm.rss, peak_rss, end.rss, MiB),
        ("requests in flight", baseline.in_flight, after_warm.in_flight,
         max(s.in_flight for s in warm), end.in_flight, 1),
        ("admitted sessions", baseline.admitted, after_warm.admitted,
         max(s.admitted for s in warm), end.admitted, 1),
        ("queued sessions", baseline.queued, after_warm.queued, max(s.queued for s in warm),
         end.queued, 1),
        ("session records", baseline.sessions, after_warm.sessions,
         max(s.sessions for s in warm), end.sessions, 1),
        ("KV ledger blocks", baseline.ledger_blocks, after_warm.ledger_blocks,
         max(s.ledger_blocks for s in warm), end.ledger_blocks, 1),
        ("dispatch queued", baseline.dispatch_queued, after_warm.dispatch_queued,
         max(s.dispatch_queued for s in warm), end.dispatch_queued, 1),
    ]
    for name, b, a, pk, e, unit in rows:
        print(f"{name:24}{b / unit:>12.0f}{a / unit:>15.0f}{pk / unit:>12.0f}{e / unit:>12.0f}")
    print()
    print("over time (every ~minute; all replicas together):")
    print(f"{'t (s)':>8}{'fds':>6}{'tasks':>7}{'RSS MiB':>9}{'in flight':>11}{'admitted':>10}"
          f"{'queued':>8}")
    step = max(1, round(60 / args.sample_every_s))
    for smp in [*samples[::step], end]:
        print(f"{smp.t:>8.0f}{smp.fds:>6}{smp.tasks:>7}{smp.rss / MiB:>9.1f}{smp.in_flight:>11}"
              f"{smp.admitted:>10}{smp.queued:>8}")
    print(f"RSS slope after warm-up: {slope:+.2f} MiB/min; "
          f"median {statistics.median(s.rss for s in warm) / MiB:.0f} MiB")
    print(f"workers: {upstream:.0f} requests running or waiting at the end")
    if leftovers:
        print(f"redis: {leftovers}")

    checks = {
        "no session lost": not tally.lost,
        "every session accounted": tally.completed + sum(tally.refused.values())
        + len(tally.lost) == args.sessions,
        "admitted back to 0": end.admitted == 0,
        "queue empty": end.queued == 0 and end.dispatch_queued == 0,
        "KV ledger empty": end.ledger_blocks == 0,
        "session tables empty": end.sessions == 0,
        "nothing in flight": end.in_flight == 0 and upstream == 0,
        "fds back at warm-up level": end.fds <= after_warm.fds + 4 * args.replicas,
        "tasks back at warm-up level": end.tasks <= baseline.tasks + 2 * args.replicas,
        "RSS flat after warm-up": end.rss - after_warm.rss < max(32 * MiB, after_warm.rss // 10),
        "no leases or queue entries in Redis": all(
            leftovers.get(k, 0) == 0 for k in ("leases", "lease_entries", "owner_entries",
                                               "queue")),
    }
    print()
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1
