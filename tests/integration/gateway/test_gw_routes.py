"""Through the real app: proxy-made 404/405 in the OpenAI shape, and which unscheduled paths
reach a worker (the inference API by default, operator routes only when listed or with the
admin token)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from marsproxy.config import load_config
from marsproxy.emulator.server import EmulatorOptions
from marsproxy.emulator.server import create_app as emulator_app
from marsproxy.gateway.http.app import Running, start

TOKEN = "adm-routes-token"


async def gateway(workers: list[str], **auth: Any) -> Running:
    over: dict[str, Any] = {"workers": workers, "server": {"port": 0}, "auth": auth}
    return await start(load_config(None, environ={}, overrides=over))


@pytest.fixture
async def emulator(run_app: Any) -> AsyncIterator[str]:
    runner, url = await run_app(emulator_app(EmulatorOptions()))
    yield url
    await runner.cleanup()


async def openai_error(resp: aiohttp.ClientResponse, status: int, code: str) -> str:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return str(body["error"]["message"])


def refused(metrics: str, status: int) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'marsproxy_refused_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


async def test_proxy_made_404_and_405_are_openai_shaped_logged_and_never_relayed(
    fake: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    g = await gateway([fake.url], admin_token=TOKEN)
    base = f"http://127.0.0.1:{g.port}"
    admin = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with caplog.at_level(logging.WARNING, logger="marsproxy.gateway"):
            async with http.get(f"{base}/v1/chat/completions") as r:
                await openai_error(r, 405, "method_not_allowed")
                assert r.headers["Allow"] == "POST"
            async with http.put(f"{base}/v1/messages", data=b"{}") as r:
                await openai_error(r, 405, "method_not_allowed")
                assert r.headers["Allow"] == "POST"
            async with http.post(f"{base}/mars/v1/state", headers=admin) as r:
                await openai_error(r, 405, "method_not_allowed")
                assert r.headers["Allow"] == "GET"
            async with http.post(f"{base}/healthz") as r:
                await openai_error(r, 405, "method_not_allowed")
                assert r.headers["Allow"] == "GET,HEAD"
            async with http.get(f"{base}/mars/v1/nothing", headers=admin) as r:
                await openai_error(r, 404, "not_found")
            async with http.post(f"{base}/no/such/route", json={"x": 1}) as r:
                msg = await openai_error(r, 404, "unknown_route")
                assert "auth.passthrough_routes" in msg
        logged = [rec.getMessage() for rec in caplog.records]
        assert any(m.startswith("405 method_not_allowed: GET /v1/chat/completions")
                   for m in logged), logged
        assert any(m.startswith("404 unknown_route: POST /no/such/route") for m in logged)
        assert fake.seen == []  # the worker heard none of it
        async with http.get(f"{base}/metrics") as r:
            metrics = await r.text()
        assert refused(metrics, 405) >= 3 and refused(metrics, 404) >= 1
    finally:
        await g.stop()


async def test_an_operator_route_is_refused_by_default_even_with_a_bearer(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway([fake.url])  # no admin token configured: no one holds it
    base = f"http://127.0.0.1:{g.port}"
    try:
        for path in ("/sleep", "/scale_elastic_ep", "/collective_rpc", "/v1/load_lora_adapter"):
            async with http.post(f"{base}{path}", json={"level": 1},
                                 headers={"Authorization": "Bearer sk-client"}) as r:
                msg = await openai_error(r, 403, "operator_route")
                assert path in msg and "admin token" in msg
        assert fake.seen == []
    finally:
        await g.stop()


async def test_the_admin_token_opens_every_route_of_the_workers(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway([fake.url], admin_token=TOKEN)
    base = f"http://127.0.0.1:{g.port}"
    try:
        async with http.post(f"{base}/sleep?level=1",
                             headers={"Authorization": "Bearer wrong-token"}) as r:
            await openai_error(r, 403, "operator_route")
        async with http.get(f"{base}/not/inference",
                            headers={"Authorization": "Bearer wrong-token"}) as r:
            await openai_error(r, 404, "unknown_route")
        assert fake.seen == []
        admin = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(f"{base}/sleep?level=1", headers=admin) as r:
            assert r.status == 200 and (await r.json())["path"] == "/sleep"
        async with http.get(f"{base}/not/inference", headers=admin) as r:
            assert r.status == 200
        assert [s.path_qs for s in fake.seen] == ["/sleep?level=1", "/not/inference"]
        # The proxy's own 405 holds for the operator too: scheduled routes are POST only.
        async with http.get(f"{base}/v1/chat/completions", headers=admin) as r:
            await openai_error(r, 405, "method_not_allowed")
    finally:
        await g.stop()


async def test_routes_listed_in_config_pass_for_any_client(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway([fake.url], passthrough_routes=["/reset_prefix_cache", "/ops/*"])
    base = f"http://127.0.0.1:{g.port}"
    try:
        async with http.post(f"{base}/reset_prefix_cache") as r:
            assert r.status == 200
        async with http.delete(f"{base}/ops/a/b") as r:
            assert r.status == 200 and (await r.json())["method"] == "DELETE"
        async with http.post(f"{base}/pause") as r:  # not listed: still refused
            await openai_error(r, 403, "operator_route")
        assert [s.path_qs for s in fake.seen] == ["/reset_prefix_cache", "/ops/a/b"]
    finally:
        await g.stop()


async def test_inference_routes_still_reach_an_emulated_worker(
    emulator: str, http: aiohttp.ClientSession
) -> None:
    g = await gateway([emulator], admin_token=TOKEN)
    base = f"http://127.0.0.1:{g.port}"
    try:
        async with http.get(f"{base}/v1/models") as r:
            assert r.status == 200 and (await r.json())["object"] == "list"
        async with http.post(f"{base}/tokenize", json={"prompt": "def main():"}) as r:
            assert r.status == 200 and (await r.json())["count"] > 0
        for path in ("/health", "/ping", "/version"):
            async with http.get(f"{base}{path}") as r:
                assert r.status == 200, path
        chat = {"model": "tiny-emulated", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(f"{base}/v1/chat/completions", json=chat) as r:
            assert r.status == 200 and (await r.json())["object"] == "chat.completion"
        # A relayed route the worker does not serve: the worker's own answer comes back, as
        # vLLM's (the emulated worker serves no embeddings).
        async with http.post(f"{base}/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 404 and await r.read() == b'{"detail":"Not Found"}'
        # An operator route, relayed with the admin token: vLLM without its dev switch
        # answers 404 in FastAPI's shape, and so does the emulated worker.
        async with http.post(f"{base}/sleep", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 404 and await r.json() == {"detail": "Not Found"}
    finally:
        await g.stop()
