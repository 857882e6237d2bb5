"""Fixtures: an emulator app on a real local socket, and a client session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from marsproxy.emulator.server import EmulatorOptions, create_app

StartEmulator = Callable[..., Awaitable[TestServer]]


@pytest.fixture
async def start_emulator() -> AsyncIterator[StartEmulator]:
    servers: list[TestServer] = []

    async def _start(**opts: object) -> TestServer:
        server = TestServer(create_app(EmulatorOptions(**opts)))  # type: ignore[arg-type]
        await server.start_server()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
