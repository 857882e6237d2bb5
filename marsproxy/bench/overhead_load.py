"""One measurement of the overhead benchmark: the request body, a ``wrk`` run, and the CPU the
proxy's process tree (and the upstream's) used meanwhile, read from ``/proc``."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from marsproxy.bench.overhead_report import Measurement
from marsproxy.bench.overhead_setup import MARKER, Options, Point, Target, pin


def _stat_cpu(pid: int) -> tuple[int, float]:
    """(parent pid, utime + stime in seconds) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2:].split()
    # After the command: state(0) ppid(1) ... utime(11) stime(12), in clock ticks.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants (nginx's workers)."""
    total = 0.0
    for p in _tree(pid):
        try:
            total += _stat_cpu(p)[1]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total


def tree_cpu_wait_s(pid: int) -> float:
    """Seconds ``pid`` and its child processes spent runnable but waiting for a CPU so far
    (``/proc/<pid>/schedstat``): on a shared machine, the part of the latency that is other
    processes' doing."""
    total = 0.0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/schedstat") as f:
                total += int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return total


def _tree(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = _stat_cpu(int(entry))[0]
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return tree


def request_body(point: Point) -> bytes:
    """A small chat request (a coding agent's turn); ``prompt_bytes`` of filler on top."""
    user = "Fix the failing test in tests/test_parser.py and explain the change."
    if point.prompt_bytes:
        user += " " + ("lorem ipsum " * (point.prompt_bytes // 12 + 1))[: point.prompt_bytes]
    return json.dumps({
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": user},
        ],
        "max_tokens": 100,
        "temperature": 0,
        "stream": point.stream,
    }).encode()


def run_wrk(opts: Options, url: str, point: Point, duration_s: float) -> dict[str, Any]:
    """One wrk run; its summary as printed by wrk.lua's ``done``."""
    body = opts.workdir / f"body-{point.name}.json"
    if not body.exists():
        body.write_bytes(request_body(point))
    seconds = max(1, round(duration_s))
    argv = [
        *pin(opts.load_cpus), "wrk", "-t1", f"-c{point.conns}", f"-d{seconds}s",
        "--timeout", "30s", "-s", str(opts.config_dir / "wrk.lua"),
        url + "/v1/chat/completions", "--", str(body), str(point.delay_ms()),
        "one-call" if point.one_call else str(opts.sessions),
    ]
    done = subprocess.run(argv, capture_output=True, timeout=seconds + 60, check=False)
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith(MARKER):
            result: dict[str, Any] = json.loads(line[len(MARKER):])
            return result
    raise RuntimeError(
        f"wrk printed no result (exit {done.returncode}): {done.stderr.decode()[-500:]}"
    )


def measure(
    opts: Options, target: Target, upstream: Target, point: Point, rnd: int
) -> Measurement:
    if opts.warmup_s > 0:
        run_wrk(opts, target.url, point, opts.warmup_s)
    assert upstream.proc is not None
    proxy_pid = None if target.proc is None else target.proc.pid
    cpu0 = None if proxy_pid is None else tree_cpu_s(proxy_pid)
    wait0 = None if proxy_pid is None else tree_cpu_wait_s(proxy_pid)
    up0 = tree_cpu_s(upstream.proc.pid)
    res = run_wrk(opts, target.url, point, opts.duration_s)
    up1 = tree_cpu_s(upstream.proc.pid)
    cpu1 = None if proxy_pid is None else tree_cpu_s(proxy_pid)
    wait1 = None if proxy_pid is None else tree_cpu_wait_s(proxy_pid)
    n = int(res["requests"])
    dur = res["duration_us"] / 1e6
    per_k = 1000 / n if n else 0.0
    proxy_cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    rps = n / dur if dur else 0.0
    errors = {k: int(v) for k, v in res["errors"].items() if v}
    return Measurement(
        round=rnd,
        target=target.name,
        point=point.name,
        stream=point.stream,
        offered_rate=point.rate,
        conns=point.conns,
        requests=n,
        errors=sum(errors.values()),
        error_kinds=errors,
        duration_s=round(dur, 3),
        rps=round(rps, 1),
        latency_ms={k: round(v / 1000, 3) for k, v in res["latency_us"].items()},
        proxy_cpu_s=None if proxy_cpu is None else round(proxy_cpu, 3),
        proxy_cpu_s_per_1000=None if proxy_cpu is None else round(proxy_cpu * per_k, 3),
        upstream_cpu_s_per_1000=round((up1 - up0) * per_k, 3),
        proxy_cpu_wait_ms_per_request=None if wait0 is None or wait1 is None or not n
        else round((wait1 - wait0) * 1000 / n, 3),
        chunks_per_s=round(rps * opts.chunks, 0) if point.stream else None,
    )
