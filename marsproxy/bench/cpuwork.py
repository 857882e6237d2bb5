"""Tool phases as real CPU work on this host.

Each tool phase runs a subprocess that burns ``seconds`` of its own CPU time (not wall time), so
when more tools run than there are cores they contend and stretch, as real test runs and builds
do. The interpreter starts without site packages to keep its own start-up small. Starting it
still costs tens of milliseconds of CPU, more than most reads and greps take, so tool phases
shorter than ``min_cpu_s`` are waits instead (the benchmark's ``--min-tool-cpu``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

_BURN = (
    "import sys, time\n"
    "need = float(sys.argv[1])\n"
    "start = time.process_time()\n"
    "x = 0\n"
    "while time.process_time() - start < need:\n"
    "    for i in range(2000):\n"
    "        x += i * i\n"
)


def tool_runner(min_cpu_s: float) -> Callable[[float, str], Awaitable[None]]:
    """The replay's tool phase: CPU work from ``min_cpu_s`` seconds on, a wait below."""

    async def run(seconds: float, kind: str) -> None:
        if seconds < min_cpu_s:
            await asyncio.sleep(seconds)
        else:
            await burn_cpu(seconds, kind)

    return run


async def burn_cpu(seconds: float, kind: str = "") -> None:
    """Burn ``seconds`` of CPU in a child process; returns when it exits."""
    if seconds <= 0:
        return
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-S", "-c", _BURN, f"{seconds:.6f}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        rc = await proc.wait()
    except asyncio.CancelledError:
        proc.kill()
        await proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"CPU burn subprocess exited with {rc}")
