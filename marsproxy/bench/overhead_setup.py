"""What an overhead run measures and with what: the load points, the options, a target (a
process under test), where the system tools are and how to pin a process to CPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

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
    # Every request a session of its own: a new x-session-id and ``x-session-final: true``
    # (a one-call session), instead of rotating over the run's agent sessions.
    one_call: bool = False

    def delay_ms(self) -> int:
        """Pause between one connection's requests that offers ``rate`` over all of them."""
        return 0 if self.rate <= 0 else round(self.conns * 1000 / self.rate)


POINT_SETS: dict[str, tuple[Point, ...]] = {
    "default": (
        Point("ns-r100-c2", False, 100, 2),
        Point("ns-r200-c4", False, 200, 4),
        Point("ns-1call-r100-c1", False, 100, 1, one_call=True),
        Point("ns-r400-c8", False, 400, 8),
        Point("ns-max-c16", False, 0, 16),
        Point("ns64k-r100-c2", False, 100, 2, prompt_bytes=64 * 1024),
        Point("sse-r10-c2", True, 10, 2),
        Point("sse-max-c8", True, 0, 8),
    ),
    # For the test that keeps the script from rotting: the goal point, serial one-call
    # sessions and one closed-loop SSE.
    "tiny": (
        Point("ns-r200-c4", False, 200, 4),
        Point("ns-1call-r100-c1", False, 100, 1, one_call=True),
        Point("sse-max-c2", True, 0, 2),
    ),
    # The request path against the bare relay: agent sessions under load, serial one-call
    # sessions with the final flag.
    "sessions": (
        Point("ns-r200-c4", False, 200, 4),
        Point("ns-1call-r100-c1", False, 100, 1, one_call=True),
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


def which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(_SBIN)
    return shutil.which(name, path=path)


def pin(cpus: str) -> list[str]:
    """``taskset -c cpus`` when it can mean something (taskset present, two or more CPUs)."""
    if not cpus or (os.cpu_count() or 1) < 2 or which("taskset") is None:
        return []
    return ["taskset", "-c", cpus]
