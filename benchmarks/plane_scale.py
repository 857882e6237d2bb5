"""The control plane's CPU per one-call session as open sessions pile up: prints numbers only.

    .venv/bin/python benchmarks/plane_scale.py [--open 0,3000,10000] [--sessions 2000]

A plain client that sends no final flag leaves every finished task open until its idle
timeout, so one replica may know thousands of dormant sessions. A new session's admission must
not walk them all. For each count N this drives one ``ControlPlane`` (the mars preset, one
worker, virtual time) directly, without HTTP: N sessions each make one call and go dormant,
past their KV hold; then ``--sessions`` one-call sessions (request, confirmation, call start,
call end, session end) run one after another, with a control tick every 200 of them. It
prints the CPU (``time.process_time``) per one-call session. Flat across N is the goal.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from marsproxy.config import load_config
from marsproxy.core.session_record import EndReason
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import ControlPlane

WORKER = "w0"


class _Run:
    def __init__(self) -> None:
        # A short KV hold, so the open sessions are past it when the measurement starts.
        cfg = load_config(None, environ={}, overrides={
            "workers": [{"url": "http://127.0.0.1:9", "name": WORKER}],
            "admission": {"tuning": {"kv_hold_min_s": 1.0}},
        })
        self.plane = ControlPlane(cfg, [WORKER], tool_cpus=2.0)
        self.now = 0.0

    def tick(self) -> None:
        seen = WorkerObservation(healthy=True, stale=False, kv_usage=0.1, total_blocks=100_000,
                                 block_size=16, running=0, preemptions_total=0.0,
                                 prefill_tokens_per_s=5000.0, sampled_at=self.now)
        self.plane.tick(self.now, {WORKER: seen}, at=self.now, cpu=None)

    def session(self, key: str, final: bool) -> None:
        p = self.plane
        ans = p.request(self.now, key, "anon", chars=400, final=final)
        p.confirm(self.now, key)
        ticket = p.call_start(self.now, key, WORKER, chars=400)
        self.now += 0.001
        p.call_end(self.now, key, ticket, incarnation=ans.incarnation, ok=True, admitted=True,
                   prompt_tokens=100, completion_tokens=10, continues=not final)
        if final:
            p.session_end(self.now, key, EndReason.FINAL)


def measure(open_sessions: int, sessions: int) -> float:
    """CPU µs per one-call session with ``open_sessions`` dormant ones known."""
    run = _Run()
    run.tick()
    for i in range(open_sessions):
        run.session(f"anon/id/open-{i}", final=False)
    run.now += 5.0  # past their KV hold
    run.tick()
    t0 = time.process_time()
    for i in range(sessions):
        run.session(f"anon/id/one-{i}", final=True)
        if i % 200 == 0:
            run.now += 0.2
            run.tick()
    return (time.process_time() - t0) / sessions * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open", default="0,3000,10000",
                    help="comma-separated counts of open, dormant sessions")
    ap.add_argument("--sessions", type=int, default=2000,
                    help="one-call sessions measured per count")
    args = ap.parse_args(argv)
    print("| open sessions | CPU µs per one-call session |")
    print("|---:|---:|")
    for n in (int(x) for x in args.open.split(",")):
        print(f"| {n:,} | {measure(n, args.sessions):.0f} |")


if __name__ == "__main__":
    main()
