"""The overhead benchmark: what a proxy adds to a request, measured side by side in one run.

Targets, each its own process on loopback in front of the same fast upstream
(:mod:`marsproxy.bench.overhead_upstream`):

- ``direct``: the client talks to the upstream itself (the reference);
- ``aiohttp-relay``: a bare aiohttp relay on uvloop (:mod:`marsproxy.bench.overhead_relay`),
  what marsproxy's HTTP stack costs without any of marsproxy's own work;
- ``marsproxy-fcfs`` / ``marsproxy-mars``: ``marsproxy serve --policy fcfs|mars``;
- ``nginx``: Debian's nginx as a plain reverse proxy (keep-alive upstream, buffering off);
- ``litellm``: LiteLLM's proxy from its own virtualenv (see ``benchmarks/overhead/``);
- ``marsproxy-<policy>+pages`` (opt-in): the same proxy with five emulated ``/mars/ui`` pages
  polling its state throughout, as the page does by default
  (:mod:`marsproxy.bench.page_readers`); ``marsproxy-<policy>+pages-events``: the pages also
  read the event stream (their "live events" turned on).

The load generator is ``wrk`` (Debian) with ``benchmarks/overhead/wrk.lua``, one thread, in
its own process. With ``taskset`` and two or more CPUs the proxy under test is pinned to one
core (``--proxy-cpus``) and the upstream and ``wrk`` to another (``--load-cpus``), so client
CPU stays out of the measured process and "requests per second on one core" means the proxy's
core. Proxy CPU is read from ``/proc/<pid>/stat`` (utime + stime of the process and its
children, e.g. nginx's worker) before and after each measurement.

Load points are either a rate (each of ``conns`` connections waits ``conns / rate`` between its
requests; the achieved rate is reported) or closed loop (rate 0: as fast as the connections go,
which gives the maximum sustained throughput). Rounds repeat every (point, target) pair with the
targets' order rotated, so that drift on a shared machine hurts them alike; tables show medians
over rounds, and added latency is taken against ``direct`` within each round.

Nothing here asserts on time: the script writes a JSON result file and a Markdown table, and
says which of issue 9's goals the run met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from marsproxy.bench.overhead_load import measure
from marsproxy.bench.overhead_report import Measurement, fmt, goals, markdown, summarize
from marsproxy.bench.overhead_setup import POINT_SETS, TARGETS, Options, Target, pin, which
from marsproxy.bench.overhead_targets import (
    litellm_bin,
    start_litellm,
    start_marsproxy,
    start_nginx,
    start_pages,
    start_relay,
    start_upstream,
    stop,
    unavailable,
)


def _version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
    return text[0] if text else "unknown"


def machine(opts: Options) -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "pinning": {"proxy": opts.proxy_cpus, "load": opts.load_cpus}
        if pin(opts.proxy_cpus) else "none",
        "wrk": _version(["wrk", "--version"]),
    }
    for mod in ("aiohttp", "uvloop", "orjson"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if "nginx" in opts.targets and which("nginx"):
        info["nginx"] = _version([str(which("nginx")), "-v"])
    if "litellm" in opts.targets and litellm_bin(opts.litellm_venv).exists():
        info["litellm"] = _version([str(opts.litellm_venv / "bin" / "python"), "-c",
                                    "import importlib.metadata as m; print(m.version('litellm'))"])
    info["git"] = _version(["git", "-C", str(opts.config_dir), "describe", "--always", "--dirty"])
    return info


def run(opts: Options) -> dict[str, Any]:
    if which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk (or run.py --install)")
    opts.workdir.mkdir(parents=True, exist_ok=True)
    skipped = unavailable(opts)
    names = [t for t in opts.targets if t not in skipped]
    started: list[Target] = []
    info = machine(opts)
    t_start = time.time()
    try:
        upstream = start_upstream(opts)
        started.append(upstream)
        up_port = int(upstream.url.rsplit(":", 1)[1])
        targets: list[Target] = []
        for name in names:
            if name == "direct":
                t = Target("direct", upstream.url, None)
            elif name == "aiohttp-relay":
                t = start_relay(opts, upstream.url)
            elif name.startswith("marsproxy-") and name.endswith(("+pages", "+pages-events")):
                t = start_marsproxy(opts, name[len("marsproxy-"):name.index("+pages")],
                                    upstream.url, name)
            elif name.startswith("marsproxy-"):
                t = start_marsproxy(opts, name.split("-", 1)[1], upstream.url)
            elif name == "nginx":
                t = start_nginx(opts, up_port)
            elif name == "litellm":
                t = start_litellm(opts, up_port)
            else:
                raise SystemExit(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
            targets.append(t)
            if t.proc is not None:
                started.append(t)
            if name.endswith(("+pages", "+pages-events")):  # after its proxy: stopped first
                started.append(start_pages(opts, t, events=name.endswith("-events")))
        rows: list[Measurement] = []
        for rnd in range(opts.rounds):
            for point in opts.points:
                shift = rnd % len(targets)
                for target in targets[shift:] + targets[:shift]:
                    m = measure(opts, target, upstream, point, rnd)
                    rows.append(m)
                    print(
                        f"round {rnd} {point.name:>14} {target.name:>15}: {m.rps:8.1f} req/s "
                        f"p50 {m.latency_ms['p50']:7.3f} ms p99 {m.latency_ms['p99']:8.3f} ms "
                        f"cpu/1000 {fmt(m.proxy_cpu_s_per_1000)} s errors {m.errors}",
                        flush=True,
                    )
    finally:
        for t in reversed(started):
            if t.proc is not None:
                stop(t.proc)
    summary = summarize(rows, opts.chunks)
    info["loadavg_end"] = os.getloadavg()
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "machine": info,
        "options": {
            "targets": list(opts.targets), "duration_s": opts.duration_s,
            "warmup_s": opts.warmup_s, "rounds": opts.rounds, "sessions": opts.sessions,
            "chunks": opts.chunks, "points": [asdict(p) for p in opts.points],
        },
        "skipped": skipped,
        "measurements": [asdict(m) for m in rows],
        "summary": summary,
        "goals": goals(summary),
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1) + "\n")
    opts.out.with_suffix(".md").write_text(markdown(result))
    return result


# -- installing the comparison proxies -------------------------------------------------------------


def install(config_dir: Path, venv: Path) -> None:
    """wrk and nginx from Debian (as root), LiteLLM's proxy into its own virtualenv."""
    missing = [p for p in ("wrk", "nginx") if which(p) is None]
    if missing:
        if os.geteuid() != 0:
            raise SystemExit(f"install {' '.join(missing)} with apt-get (needs root)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)
    if not litellm_bin(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "-r", str(config_dir / "litellm-requirements.txt")], check=True)


def main(argv: Sequence[str] | None = None, *, config_dir: Path) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(
        description="Per-request overhead of marsproxy against direct, nginx and LiteLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    work = config_dir / ".work"
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated, from {', '.join(TARGETS)}")
    p.add_argument("--points", default="default", choices=sorted(POINT_SETS))
    p.add_argument("--duration", type=int, default=6, help="seconds per measurement")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16,
                   help="x-session-id values the requests rotate over (0: none)")
    p.add_argument("--chunks", type=int, default=100, help="content events per streamed reply")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (a .md table is written beside it); default: "
                   "benchmarks/overhead/results/<UTC time>.json")
    p.add_argument("--workdir", type=Path, default=work / "run", help="logs, rendered configs")
    p.add_argument("--litellm-venv", type=Path, default=work / "litellm-venv")
    p.add_argument("--marsproxy-config", type=Path, default=None,
                   help="marsproxy config (default: benchmarks/overhead/marsproxy.yaml)")
    p.add_argument("--proxy-cpus", default="0", help="taskset CPU list of the proxy under test")
    p.add_argument("--load-cpus", default="1", help="taskset CPU list of upstream and wrk")
    p.add_argument("--install", action="store_true",
                   help="install wrk and nginx (apt-get) and the LiteLLM venv, then exit")
    args = p.parse_args(argv)
    if args.install:
        install(config_dir, args.litellm_venv)
        return None
    out = args.out or config_dir / "results" / time.strftime("%Y%m%dT%H%M%SZ.json", time.gmtime())
    opts = Options(
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        points=POINT_SETS[args.points],
        duration_s=args.duration,
        warmup_s=args.warmup,
        rounds=args.rounds,
        sessions=args.sessions,
        chunks=args.chunks,
        out=out,
        config_dir=config_dir,
        workdir=args.workdir,
        litellm_venv=args.litellm_venv,
        proxy_cpus=args.proxy_cpus,
        load_cpus=args.load_cpus,
        marsproxy_config=args.marsproxy_config,
    )
    result = run(opts)
    sys.stdout.write("\n" + markdown(result))
    sys.stdout.write(f"\nresult: {out}\n")
    return result
