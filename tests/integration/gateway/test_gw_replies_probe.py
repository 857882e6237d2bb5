"""Asking the workers which one keeps a stored reply (gateway/shells/replies.py), over real
sockets: the one answering 200 wins, whatever the others do (404, an error, silence); none, or
silence past the timeout, is ``None``; those that answered 404 are named (they keep no such
reply); the caller's credentials go with the question. Through gateways: replicas sharing no
store find a reply's worker so, and an id no worker keeps is not asked on every call."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from marsproxy.gateway.shells.replies import worker_keeping

from .conftest import run_app
from .relay_client import config, gateway, url
from .responses_worker import StoringWorker, busy, call


def _worker(status: int, delay_s: float = 0.0, seen: list[str] | None = None) -> web.Application:
    async def get(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append(f"{request.raw_path} {request.headers.get('Authorization')}")
        await asyncio.sleep(delay_s)
        return web.json_response({"id": request.match_info["rid"]}, status=status)

    app = web.Application()
    app.router.add_get("/v1/responses/{rid}", get)
    return app


async def test_the_worker_that_has_it_answers() -> None:
    seen: list[str] = []
    runners = [await run_app(_worker(404, seen=seen)), await run_app(_worker(500)),
               await run_app(_worker(200, delay_s=0.05, seen=seen)),
               await run_app(_worker(200, delay_s=30))]
    urls = [u for _, u in runners]
    try:
        async with aiohttp.ClientSession() as http:
            got = await worker_keeping(http, urls, "resp_1/x", {"Authorization": "Bearer k"}, 5)
            none = await worker_keeping(http, urls[:2], "resp_1/x", {}, 5)
            silent = await worker_keeping(http, urls[3:], "resp_1/x", {}, 0.2)
    finally:
        for r, _ in runners:
            await r.cleanup()
    assert (got[0], none, silent) == (urls[2], (None, [urls[0]]), (None, []))
    assert got[1] in ([], [urls[0]])  # the 404 is told when it came before the 200
    assert seen[:2] == ["/v1/responses/resp_1%2Fx Bearer k"] * 2  # quoted; the key sent along


async def test_replicas_without_a_shared_store_ask_the_workers_who_keeps_a_reply(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    """Two replicas that share nothing (each its own memory store), as after a restart or
    before a reply's entry reaches the store: a call naming a reply this replica never saw asks
    every worker for it (``GET /v1/responses/{id}``) and goes to the one that has it."""
    g = [await gateway(config([w.url for w in two])) for _ in range(2)]
    try:
        await busy(http, g[1], "busy")  # b's least loaded is w1, wherever a's chain is
        ids = [await call(http, g[0], {"model": "fake", "input": "Fix the bug in foo.py"})]
        for turn in range(1, 4):
            ids.append(await call(http, g[turn % 2], {
                "model": "fake", "input": f"tool output {turn}", "previous_response_id": ids[-1]}))
        async with http.post(url(g[0], "/v1/responses"), json={
                "model": "fake", "input": "x", "previous_response_id": "resp_never"}) as r:
            assert r.status == 404  # no worker has it: vLLM's answer
        lookups = []
        for gi in g:
            async with http.get(url(gi, "/metrics")) as r:
                text = await r.text()
            lookups.append([line for line in text.splitlines()
                            if line.startswith("marsproxy_reply_lookups_total{")])
    finally:
        for gi in g:
            await gi.stop()
    maker = next(w for w in two if ids[0] in w.made)
    assert all(i in maker.made for i in ids), (ids, maker.made)
    asked = {s.path_qs for s in maker.seen if s.method == "GET"}  # the others may be cut short
    assert asked >= {f"/v1/responses/{i}" for i in ids[:3]}
    # a asked for ids[1] and the unknown id, b for ids[0] and ids[2].
    assert 'marsproxy_reply_lookups_total{source="workers"} 1.0' in lookups[0]
    assert 'marsproxy_reply_lookups_total{source="none"} 1.0' in lookups[0]
    assert 'marsproxy_reply_lookups_total{source="workers"} 2.0' in lookups[1]


async def test_an_id_no_worker_keeps_is_asked_of_the_workers_once(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    """A client repeating an id no worker keeps (made up, or lost to a worker's restart) gets
    vLLM's 404 each time, but within a health interval (2 s) the workers are asked of it once:
    they answered that they keep none (after it they are asked again: a streamed reply's id is
    seen before its worker stores it; tests/unit/core/test_core_replies.py)."""
    g = await gateway(config([w.url for w in two]))
    try:
        for _ in range(3):
            async with http.post(url(g, "/v1/responses"), json={
                    "model": "fake", "input": "x", "previous_response_id": "resp_gone"}) as r:
                assert r.status == 404
        async with http.get(url(g, "/metrics")) as r:
            text = await r.text()
    finally:
        await g.stop()
    asked = [s for w in two for s in w.seen if s.method == "GET"]
    assert [s.path_qs for s in asked] == ["/v1/responses/resp_gone"] * 2  # once each
    assert 'marsproxy_reply_lookups_total{source="none"} 3.0' in text
