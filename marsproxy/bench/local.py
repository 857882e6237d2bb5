"""Run aiohttp applications in-process on free loopback ports (demo, benchmarks, tests)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from aiohttp import web


@dataclass
class LocalServer:
    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_local(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> LocalServer:
    """Start ``app`` on ``port`` (0: a free one, bound here so there is no bind-then-close race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return LocalServer(runner=runner, url=f"http://{host}:{port}")
