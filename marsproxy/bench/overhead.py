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
  reading its state and event stream throughout (:mod:`marsproxy.bench.page_readers`).

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
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from marsproxy.bench.overhead_report import Measurement, fmt, goals, markdown, summarize
from marsproxy.bench.procs import free_port, http_status

TARGETS = ("direct", "aiohttp-relay", "nginx", "marsproxy-fcfs", "marsproxy-mars", "litellm")
MARKER = "OVERHEAD-JSON "
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


@dataclass(frozen=True)
class Point:
    """One load setting. ``rate`` 0: closed loop (maximum throughput)."""

    name: str
    stream: bool
    rate: float
    conns: int
    prompt_bytes: int = 0  # filler added to the user message

    def delay_ms(self) -> int:
        """Pause between one connection's requests that offers ``rate`` over all of them."""
        return 0 if self.rate <= 0 else round(self.conns * 1000 / self.rate)


POINT_SETS: dict[str, tuple[Point, ...]] = {
    "default": (
        Point("ns-r100-c2", False, 100, 2),
        Point("ns-r200-c4", False, 200, 4),
        Point("ns-r400-c8", False, 400, 8),
        Point("ns-max-c16", False, 0, 16),
        Point("ns64k-r100-c2", False, 100, 2, prompt_bytes=64 * 1024),
        Point("sse-r10-c2", True, 10, 2),
        Point("sse-max-c8", True, 0, 8),
    ),
    # For the test that keeps the script from rotting: the goal point and one closed-loop SSE.
    "tiny": (
        Point("ns-r200-c4", False, 200, 4),
        Point("sse-max-c2", True, 0, 2),
    ),
}


@dataclass
class Options:
    targets: tuple[str, ...]
    points: tuple[Point, ...]
    duration_s: int
    warmup_s: float
    rounds: int
    sessions: int
    chunks: int
    out: Path
    config_dir: Path
    workdir: Path
    litellm_venv: Path
    proxy_cpus: str
    load_cpus: str
    marsproxy_config: Path | None = None


@dataclass
class Target:
    name: str
    url: str  # base URL the client sends to
    proc: subprocess.Popen[bytes] | None  # None for direct


# -- processes -----------------------------------------------------------------------------------


def _which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(_SBIN)
    return shutil.which(name, path=path)


def _pin(cpus: str) -> list[str]:
    """``taskset -c cpus`` when it can mean something (taskset present, two or more CPUs)."""
    if not cpus or (os.cpu_count() or 1) < 2 or _which("taskset") is None:
        return []
    return ["taskset", "-c", cpus]


def _wait(url: str, proc: subprocess.Popen[bytes], timeout_s: float, ok: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if http_status(url, timeout_s=1.0) == ok:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer {ok} within {timeout_s} s")


def _spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=None if env is None else {**os.environ, **env},
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _render(template: Path, dest: Path, values: dict[str, str]) -> Path:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    dest.write_text(text)
    return dest


def start_upstream(opts: Options) -> Target:
    port = free_port()
    proc = _spawn(
        [*_pin(opts.load_cpus), sys.executable, "-m", "marsproxy.bench.overhead_upstream",
         "--port", str(port), "--chunks", str(opts.chunks)],
        opts.workdir / "upstream.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", proc, 30)
    return Target("upstream", url, proc)


def start_marsproxy(opts: Options, policy: str, upstream: str, name: str = "") -> Target:
    name = name or f"marsproxy-{policy}"
    port = free_port()
    cfg = opts.marsproxy_config or opts.config_dir / "marsproxy.yaml"
    proc = _spawn(
        [*_pin(opts.proxy_cpus), sys.executable, "-m", "marsproxy.cli", "serve",
         "--config", str(cfg), "--policy", policy, "--port", str(port), "--worker", upstream],
        opts.workdir / f"{name}.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/readyz", proc, 60)
    return Target(name, url, proc)


def start_pages(opts: Options, proxy: Target, pages: int = 5) -> Target:
    """Emulated /mars/ui pages reading ``proxy``, on the load CPUs (they are clients)."""
    proc = _spawn(
        [*_pin(opts.load_cpus), sys.executable, "-m", "marsproxy.bench.page_readers",
         "--url", proxy.url, "--pages", str(pages)],
        opts.workdir / f"{proxy.name}-pages.log",
    )
    return Target(f"{proxy.name} pages", proxy.url, proc)


def start_relay(opts: Options, upstream: str) -> Target:
    """The floor: a bare aiohttp relay on uvloop (marsproxy/bench/overhead_relay.py)."""
    port = free_port()
    proc = _spawn(
        [*_pin(opts.proxy_cpus), sys.executable, "-m", "marsproxy.bench.overhead_relay",
         "--port", str(port), "--upstream", upstream],
        opts.workdir / "aiohttp-relay.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", proc, 30)
    return Target("aiohttp-relay", url, proc)


def start_nginx(opts: Options, upstream_port: int) -> Target:
    nginx = _which("nginx")
    assert nginx is not None
    port = free_port()
    root = opts.workdir / "nginx"
    root.mkdir(parents=True, exist_ok=True)
    conf = _render(
        opts.config_dir / "nginx.conf.template", root / "nginx.conf",
        {"PORT": str(port), "UPSTREAM_PORT": str(upstream_port), "ROOT": str(root)},
    )
    proc = _spawn(
        [*_pin(opts.proxy_cpus), nginx, "-c", str(conf), "-p", str(root)],
        opts.workdir / "nginx.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", proc, 30)
    return Target("nginx", url, proc)


def litellm_bin(venv: Path) -> Path:
    return venv / "bin" / "litellm"


def start_litellm(opts: Options, upstream_port: int) -> Target:
    port = free_port()
    conf = _render(
        opts.config_dir / "litellm.yaml.template", opts.workdir / "litellm.yaml",
        {"UPSTREAM_PORT": str(upstream_port)},
    )
    proc = _spawn(
        [*_pin(opts.proxy_cpus), str(litellm_bin(opts.litellm_venv)), "--config", str(conf),
         "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        opts.workdir / "litellm.log",
        # No fetch of the model price map at start (there is no network), quiet logs.
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
             "LITELLM_TELEMETRY": "False"},
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health/liveliness", proc, 180)
    return Target("litellm", url, proc)


def unavailable(opts: Options) -> dict[str, str]:
    """Targets asked for that cannot run here, and why."""
    why: dict[str, str] = {}
    if "nginx" in opts.targets and _which("nginx") is None:
        why["nginx"] = "nginx is not installed (apt-get install nginx, or run.py --install)"
    if "litellm" in opts.targets and not litellm_bin(opts.litellm_venv).exists():
        why["litellm"] = f"no LiteLLM proxy at {litellm_bin(opts.litellm_venv)} (run.py --install)"
    return why


# -- measuring -----------------------------------------------------------------------------------


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
        *_pin(opts.load_cpus), "wrk", "-t1", f"-c{point.conns}", f"-d{seconds}s",
        "--timeout", "30s", "-s", str(opts.config_dir / "wrk.lua"),
        url + "/v1/chat/completions", "--", str(body), str(point.delay_ms()), str(opts.sessions),
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
        if _pin(opts.proxy_cpus) else "none",
        "wrk": _version(["wrk", "--version"]),
    }
    for mod in ("aiohttp", "uvloop", "orjson"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if "nginx" in opts.targets and _which("nginx"):
        info["nginx"] = _version([str(_which("nginx")), "-v"])
    if "litellm" in opts.targets and litellm_bin(opts.litellm_venv).exists():
        info["litellm"] = _version([str(opts.litellm_venv / "bin" / "python"), "-c",
                                    "import importlib.metadata as m; print(m.version('litellm'))"])
    info["git"] = _version(["git", "-C", str(opts.config_dir), "describe", "--always", "--dirty"])
    return info


def run(opts: Options) -> dict[str, Any]:
    if _which("wrk") is None:
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
            elif name.startswith("marsproxy-") and name.endswith("+pages"):
                t = start_marsproxy(opts, name[len("marsproxy-"):-len("+pages")], upstream.url,
                                    name)
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
            if name.endswith("+pages"):  # after its proxy: stopped before it
                started.append(start_pages(opts, t))
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
                _stop(t.proc)
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
    missing = [p for p in ("wrk", "nginx") if _which(p) is None]
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
