"""Helpers for running marsproxy commands as subprocesses (end-to-end tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

CLI = (sys.executable, "-m", "marsproxy.cli")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now. Bind-then-close can race with another process taking
    it; on a test machine that is rare, and :func:`wait_up` then fails clearly."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout_s: float = 2.0) -> int:
    """HTTP status of ``GET url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Wait until ``GET url`` answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if http_status(url) == 200:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout_s} s")


def _signal(proc: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, sig)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM every process still running (a paused one is resumed first), then wait for each;
    one that outlives ``timeout_s`` is killed."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass(frozen=True, slots=True)
class CpuMark:
    """CPU used so far: the host's busy seconds (all cores) and one process's, at ``wall``."""

    wall: float
    host_busy_s: float
    process_s: float | None


def _host_busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def cpu_mark(pid: int | None = None) -> CpuMark:
    """Where the host's and ``pid``'s CPU counters stand now (``pid`` ``None``: no process)."""
    proc_s = None
    if pid is not None:
        with contextlib.suppress(psutil.NoSuchProcess):  # gone: nothing to say about it
            c = psutil.Process(pid).cpu_times()
            proc_s = c.user + c.system
    return CpuMark(time.monotonic(), _host_busy_s(), proc_s)


def cpu_since(start: CpuMark, pid: int | None = None) -> dict[str, float | None]:
    """Cores kept busy on average since ``start``: the whole host's (of ``cores``) and
    ``pid``'s (``None`` without a process, or once it is gone)."""
    end = cpu_mark(pid)
    wall = max(1e-9, end.wall - start.wall)
    proc = (None if start.process_s is None or end.process_s is None
            else round((end.process_s - start.process_s) / wall, 3))
    cores = float(psutil.cpu_count() or 1)
    # The host's ticks (10 ms) can read a little over its cores on a fully busy host.
    busy = min(cores, (end.host_busy_s - start.host_busy_s) / wall)
    return {"wall_s": round(wall, 2), "cores": cores, "host_busy_cores": round(busy, 3),
            "process_cores": proc}


class Service:
    """A marsproxy subprocess (``serve`` or ``emulate``) on a port of its own, with its stderr
    in ``log_path``. Fault tests and the soak kill, pause and count it."""

    def __init__(self, args: list[str], port: int, ready_path: str, log_path: Path) -> None:
        self.args, self.port, self.ready_path, self.log_path = args, port, ready_path, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def emulator(
        cls, log_dir: Path, name: str, *, profile: str = "tiny", time_scale: float = 1.0,
        extra: tuple[str, ...] = (),
    ) -> Service:
        port = free_port()
        args = [*CLI, "emulate", "--profile", profile, "--port", str(port),
                "--time-scale", str(time_scale), *extra]
        return cls(args, port, "/health", log_dir / f"{name}.log")

    @classmethod
    def proxy(cls, log_dir: Path, name: str, config: Path) -> Service:
        port = free_port()
        args = [*CLI, "serve", "--config", str(config), "--port", str(port)]
        return cls(args, port, "/healthz", log_dir / f"{name}.log")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout_s: float = 30.0) -> Service:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log)
        wait_up(self.url + self.ready_path, self.proc, timeout_s)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash; nothing is cleaned up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nobody answers them."""
        _signal(self.proc, signal.SIGSTOP)

    def resume(self) -> None:
        _signal(self.proc, signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM: a graceful stop begins."""
        _signal(self.proc, signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_all([self.proc], timeout_s)

    def fds(self) -> int:
        """Open file descriptors of the process (Linux /proc)."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss_bytes(self) -> int:
        """Resident memory of the process (Linux /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class RedisServer:
    """A private redis-server (own port, own directory, no persistence) for the demo's replica
    mode, the end-to-end and fault tests and the soak: never the shared one. It may be killed
    (its data is gone, like a crashed pod), paused, slowed and started again on the same port.
    """

    def __init__(
        self, workdir: str | Path, *, host: str = "127.0.0.1", extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.host = host
        self.url = f"redis://{host}:{self.port}/0"
        self._dir = str(workdir)
        self._extra = extra  # more redis-server flags (fault tests: a replica, protected mode)
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, timeout_s: float = 5.0) -> None:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--dir", self._dir,
             # DEBUG SLEEP slows the server down on purpose (fault tests); off by default.
             *(["--enable-debug-command", "local"] if _redis_major() >= 7 else []),
             *self._extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            if self._proc.poll() is not None:
                break
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        """SIGKILL: the data is gone (no persistence), like a crashed Redis pod."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def pause(self) -> None:
        _signal(self._proc, signal.SIGSTOP)

    def resume(self) -> None:
        _signal(self._proc, signal.SIGCONT)


def _redis_major() -> int:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"v=(\d+)\.", out)
    return int(m.group(1)) if m else 0
