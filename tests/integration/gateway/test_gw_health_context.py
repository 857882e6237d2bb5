"""The health checker reads each worker's context limit from ``GET /v1/models`` (vLLM's
``max_model_len``) once, again after an ejection, and never from a worker that states none;
the plane's observation of the worker carries it (it caps every forecast peak there)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from marsproxy.config import HealthConfig, WorkerConfig
from marsproxy.gateway.http.health import HealthChecker, WorkerHealth
from marsproxy.gateway.shells.observations import observations


class FakeWorker:
    def __init__(self) -> None:
        self.models: Any = {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}
        self.models_status = 200
        self.health_status = 200
        self.model_reads = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _models(self, _: web.Request) -> web.Response:
        self.model_reads += 1
        return web.json_response(self.models, status=self.models_status)


@pytest.fixture
async def worker() -> AsyncIterator[tuple[FakeWorker, str]]:
    fake = FakeWorker()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _checker(url: str) -> tuple[HealthChecker, WorkerHealth, WorkerConfig]:
    w = WorkerConfig(url=url)
    health = WorkerHealth([url], unhealthy_after=1, healthy_after=1)
    return HealthChecker([w], health, HealthConfig(timeout_s=2.0), lambda *_: None), health, w


class _NoScrape:
    def worker_pressure(self, label: str) -> None:
        return None


async def test_the_limit_is_read_once_and_reaches_the_observation(
    worker: tuple[FakeWorker, str],
) -> None:
    fake, url = worker
    checker, health, w = _checker(url)
    async with aiohttp.ClientSession() as http:
        await checker.check_all(http)
        await checker.check_all(http)
    assert health.max_model_len(url) == 4096 and fake.model_reads == 1
    assert observations([w], _NoScrape(), health)[w.label].max_model_len == 4096


async def test_an_ejected_worker_is_asked_again(worker: tuple[FakeWorker, str]) -> None:
    fake, url = worker
    checker, health, _ = _checker(url)
    async with aiohttp.ClientSession() as http:
        await checker.check_all(http)
        fake.health_status, fake.models["data"][0]["max_model_len"] = 503, 8192
        await checker.check_all(http)  # ejected: it may restart with another limit
        assert health.max_model_len(url) is None
        fake.health_status = 200
        await checker.check_all(http)
    assert health.max_model_len(url) == 8192 and fake.model_reads == 2


@pytest.mark.parametrize("status, models", [
    (404, {"detail": "Not Found"}),  # not a vLLM
    (200, {"data": [{"id": "m"}]}),  # no max_model_len
    (200, {"data": [{"id": "m", "max_model_len": "4096"}]}),  # not an integer
    (200, {"data": []}),
])
async def test_a_worker_that_states_no_limit_is_not_capped_nor_asked_again(
    worker: tuple[FakeWorker, str], status: int, models: Any,
) -> None:
    fake, url = worker
    fake.models_status, fake.models = status, models
    checker, health, w = _checker(url)
    async with aiohttp.ClientSession() as http:
        await checker.check_all(http)
        await checker.check_all(http)
    assert health.is_healthy(url) and health.max_model_len(url) is None
    assert fake.model_reads == 1
    assert observations([w], _NoScrape(), health)[w.label].max_model_len is None
