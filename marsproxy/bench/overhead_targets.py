"""The processes of the overhead benchmark: the fast upstream, marsproxy (optionally with
emulated ``/mars/ui`` pages), the bare aiohttp relay, nginx and LiteLLM, each started, waited
for and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from marsproxy.bench.overhead_setup import Options, Target, pin, which
from marsproxy.bench.procs import free_port, http_status


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


def stop(proc: subprocess.Popen[bytes]) -> None:
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
        [*pin(opts.load_cpus), sys.executable, "-m", "marsproxy.bench.overhead_upstream",
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
        [*pin(opts.proxy_cpus), sys.executable, "-m", "marsproxy.cli", "serve",
         "--config", str(cfg), "--policy", policy, "--port", str(port), "--worker", upstream],
        opts.workdir / f"{name}.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/readyz", proc, 60)
    return Target(name, url, proc)


def start_pages(opts: Options, proxy: Target, pages: int = 5, events: bool = False) -> Target:
    """Emulated /mars/ui pages reading ``proxy``, on the load CPUs (they are clients): state
    polls only, as the page by default, or also the event stream (``events``)."""
    proc = _spawn(
        [*pin(opts.load_cpus), sys.executable, "-m", "marsproxy.bench.page_readers",
         "--url", proxy.url, "--pages", str(pages), *(["--events"] if events else [])],
        opts.workdir / f"{proxy.name}-pages.log",
    )
    return Target(f"{proxy.name} pages", proxy.url, proc)


def start_relay(opts: Options, upstream: str) -> Target:
    """The floor: a bare aiohttp relay on uvloop (marsproxy/bench/overhead_relay.py)."""
    port = free_port()
    proc = _spawn(
        [*pin(opts.proxy_cpus), sys.executable, "-m", "marsproxy.bench.overhead_relay",
         "--port", str(port), "--upstream", upstream],
        opts.workdir / "aiohttp-relay.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", proc, 30)
    return Target("aiohttp-relay", url, proc)


def start_nginx(opts: Options, upstream_port: int) -> Target:
    nginx = which("nginx")
    assert nginx is not None
    port = free_port()
    root = opts.workdir / "nginx"
    root.mkdir(parents=True, exist_ok=True)
    conf = _render(
        opts.config_dir / "nginx.conf.template", root / "nginx.conf",
        {"PORT": str(port), "UPSTREAM_PORT": str(upstream_port), "ROOT": str(root)},
    )
    proc = _spawn(
        [*pin(opts.proxy_cpus), nginx, "-c", str(conf), "-p", str(root)],
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
        [*pin(opts.proxy_cpus), str(litellm_bin(opts.litellm_venv)), "--config", str(conf),
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
    if "nginx" in opts.targets and which("nginx") is None:
        why["nginx"] = "nginx is not installed (apt-get install nginx, or run.py --install)"
    if "litellm" in opts.targets and not litellm_bin(opts.litellm_venv).exists():
        why["litellm"] = f"no LiteLLM proxy at {litellm_bin(opts.litellm_venv)} (run.py --install)"
    return why
