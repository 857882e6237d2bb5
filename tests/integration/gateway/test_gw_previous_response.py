"""Responses API continuations by ``previous_response_id``: vLLM keeps its responses per server
(an id another worker made is unknown there, answered 404), so a client chaining calls by id,
with no session header, must stay on the worker that made the id: one session, one worker."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from marsproxy.gateway.http.app import Running

from .relay_client import config, gateway, url
from .responses_worker import StoringWorker, busy, call


async def _until_replies(redis_url: str, pool: str, n: int) -> None:
    """Until the pool holds ``n`` reply entries (a bounded poll, 10 s)."""
    r = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(200):
            if len(await r.keys(f"*{{{pool}}}:reply:*")) >= n:
                return
            await asyncio.sleep(0.05)
    finally:
        await r.aclose()
    raise AssertionError(f"fewer than {n} reply entries in the store")


async def _until_idle(http: aiohttp.ClientSession, gateways: list[Running]) -> None:
    """Until no worker of any of ``gateways`` holds a session (a bounded poll, 10 s)."""
    for _ in range(200):
        held = []
        for gi in gateways:
            async with http.get(url(gi, "/mars/v1/state")) as r:
                held += [row["admitted"] for row in (await r.json())["admission"]["workers"]
                         .values()]
        if not any(held):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"sessions still admitted: {held}")


async def test_a_chain_by_previous_response_id_is_one_session_on_one_worker(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    g = await gateway(config([w.url for w in two]))
    try:
        first = await call(http, g, {"model": "fake", "input": "Fix the bug in foo.py"})
        # Streamed: the id comes from the stream's events.
        second = await call(http, g, {"model": "fake", "input": "ran the tests: 2 failed",
                                       "previous_response_id": first, "stream": True})
        third = await call(http, g, {"model": "fake", "input": "ran them again: all pass",
                                      "previous_response_id": second})
        async with http.get(url(g, "/mars/v1/state?sessions=1")) as r:
            state = await r.json()
    finally:
        await g.stop()
    maker = next(w for w in two if first in w.made)
    assert [second in maker.made, third in maker.made] == [True, True]
    assert sum(len(w.seen) for w in two) == len(maker.seen) == 3
    sessions = state["sessions"]
    assert sessions["total"] == 1, sessions
    assert sessions["details"][0]["turns"] == 3


async def test_an_unknown_previous_id_is_a_new_session_and_an_explicit_id_wins(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    g = await gateway(config([w.url for w in two]))
    try:
        first = await call(http, g, {"model": "fake", "input": "task one"})
        # An id this proxy never relayed (another replica's): no link, a session of its own.
        async with http.post(url(g, "/v1/responses"), json={
                "model": "fake", "input": "go on", "previous_response_id": "resp_elsewhere"}) as r:
            await r.read()
        # A session header names the session, whatever the previous id says.
        async with http.post(url(g, "/v1/responses"), headers={"x-session-id": "run-7"}, json={
                "model": "fake", "input": "go on", "previous_response_id": first}) as r:
            await r.read()
        async with http.get(url(g, "/mars/v1/state?sessions=1")) as r:
            state = await r.json()
    finally:
        await g.stop()
    sessions = state["sessions"]
    assert sessions["total"] == 3, sessions
    assert "run-7" in {d["id"] for d in sessions["details"]}


async def test_a_chain_by_reply_id_stays_on_its_worker_across_replicas(
    two: list[StoringWorker], http: aiohttp.ClientSession, private_redis: Any
) -> None:
    """Two replicas sharing a real Redis: each call of a chain reaches the other replica, which
    knows the id only from the store's reply index, joins the session there (its lease moves)
    and sends the call to the worker that made the id: no 404, one session."""
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "replies",
             "lease_ttl_s": 2.0, "heartbeat_interval_s": 0.2, "leader_ttl_s": 1.0,
             "op_timeout_s": 2.0, "reconnect_interval_s": 0.2}
    # Replica b already serves a session on w0: a new session there would go to w1 (the
    # least loaded), wherever the chain's first reply was made.
    g = [await gateway(config([w.url for w in two], store=store,
                              admission={"idle_timeout_min_s": 0.5})) for _ in range(3)]
    try:
        await busy(http, g[1], "busy")
        ids = [await call(http, g[0], {"model": "fake", "input": "Fix the bug in foo.py"})]
        for turn in range(1, 5):  # b, a, b, a: every call on the replica that did not relay it
            # The entry lands just after the reply left (a store call of its own); a replica
            # asked before it lands finds the worker by asking the workers (a test below).
            await _until_replies(private_redis.url, "replies", len(ids))
            ids.append(await call(http, g[turn % 2], {
                "model": "fake", "input": f"tool output {turn}",
                "previous_response_id": ids[-1], "stream": turn == 2}))
        states = []
        for gi in g[:2]:
            async with http.get(url(gi, "/mars/v1/state?sessions=1")) as r:
                states.append(await r.json())
        # The session idles out (its lease and record go); a third replica that never saw it
        # learns the worker from the store's reply entry, while least-loaded placement would
        # pick the other one (a session of its own takes w0 when the chain's worker is w0).
        await _until_idle(http, g[:2])
        maker = next(w for w in two if ids[0] in w.made)
        if maker is two[0]:
            await busy(http, g[2], "c-busy")
        ids.append(await call(http, g[2], {"model": "fake", "input": "later",
                                            "previous_response_id": ids[-1]}))
        # A reply b relayed, fetched through c: the store names its worker.
        async with http.get(url(g[2], f"/v1/responses/{ids[1]}")) as r:
            assert (r.status, (await r.json())["id"]) == (200, ids[1])
    finally:
        for gi in g:
            await gi.stop()
    assert all(i in maker.made for i in ids), (ids, maker.made)
    responses = [s for w in two for s in w.seen if s.path_qs == "/v1/responses"]
    assert len(responses) == len(maker.made) == 6
    # One session: a's own (its turns 1, 3, 5), and b's copy of it under a's store key.
    a, b = ([d for d in st["sessions"]["details"] if d["id"] != "busy"] for st in states)
    assert [(d["id"], d["turns"]) for d in a] == [("chain/1", 3)], a
    assert len(b) == 1 and b[0]["id"].startswith("chain/1@") and b[0]["turns"] == 2, b


async def test_a_chain_whose_session_ended_goes_back_to_the_worker_keeping_its_reply(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    """The user reads the answer longer than the admission idle timeout: the session ends
    (its slot goes back) while the table still knows the reply id. The next call is a new
    admission, yet only the worker that made the reply keeps it: it goes there, not to the
    least loaded worker."""
    g = await gateway(config([w.url for w in two], admission={"idle_timeout_min_s": 0.3}))
    try:
        await busy(http, g, "busy")
        first = await call(http, g, {"model": "fake", "input": "Fix the bug in foo.py"})
        # The busy one ends, the chain's session idles out: both workers are empty, and the
        # least loaded in worker order is not the one that made the reply.
        async with http.delete(url(g, "/mars/v1/sessions/busy")) as r:
            assert r.status == 200
        await _until_idle(http, [g])
        second = await call(http, g, {"model": "fake", "input": "and the tests?",
                                       "previous_response_id": first})
        third = await call(http, g, {"model": "fake", "input": "done",
                                      "previous_response_id": second})
    finally:
        await g.stop()
    maker = next(w for w in two if first in w.made)
    assert maker is two[1]  # the busy session had w0
    assert [second in maker.made, third in maker.made] == [True, True]


async def test_a_hung_store_costs_a_reply_lookup_its_timeout_not_the_request(
    two: list[StoringWorker], http: aiohttp.ClientSession, private_redis: Any
) -> None:
    """Redis stops answering (SIGSTOP): a replica asked for a reply id it does not know waits
    at most the store's op timeout for the lookup, then asks the workers who keeps it and
    serves the call there; the replica that knows the id serves its chain on as before."""
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "hung",
             "lease_ttl_s": 5.0, "heartbeat_interval_s": 0.2, "leader_ttl_s": 1.0,
             "op_timeout_s": 0.3, "reconnect_interval_s": 0.2}
    g = [await gateway(config([w.url for w in two], store=store)) for _ in range(2)]
    try:
        first = await call(http, g[0], {"model": "fake", "input": "Fix the bug in foo.py"})
        private_redis.pause()
        try:
            async def ask() -> tuple[int, Any]:
                async with http.post(url(g[1], "/v1/responses"), json={
                        "model": "fake", "input": "go on", "previous_response_id": first}) as r:
                    return r.status, await r.json()

            status, body = await asyncio.wait_for(ask(), 5.0)  # a hang fails, not a slow VM
            assert status == 200, body
            second = await asyncio.wait_for(call(http, g[0], {
                "model": "fake", "input": "go on", "previous_response_id": first}), 5.0)
        finally:
            private_redis.resume()
    finally:
        for gi in g:
            await gi.stop()
    maker = next(w for w in two if first in w.made)
    assert body["id"] in maker.made and second in maker.made


async def test_a_reply_outlives_its_forgotten_session_on_its_worker(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    """The session table forgot the chain (idle past ``sessions.idle_ttl_s``), vLLM did not:
    a call naming its last reply is a new session, placed on the worker that made the reply."""
    g = await gateway(config([w.url for w in two], sessions={"idle_ttl_s": 0.2}))
    try:
        await busy(http, g, "busy")  # w0: the chain goes to w1
        first = await call(http, g, {"model": "fake", "input": "Fix the bug in foo.py"})
        await asyncio.sleep(0.4)
        # The table expires what idled past its TTL; two new sessions take w0 and w1, so the
        # least loaded is w0 again (ties in worker order).
        await busy(http, g, "busy-2")
        await busy(http, g, "busy-3")
        async with http.get(url(g, "/mars/v1/state?sessions=1")) as r:
            ids = sorted(d["id"] for d in (await r.json())["sessions"]["details"])
        assert ids == ["busy-2", "busy-3"], ids
        second = await call(http, g, {"model": "fake", "input": "go on",
                                       "previous_response_id": first})
    finally:
        await g.stop()
    assert first in two[1].made and second in two[1].made


async def test_a_final_reply_can_still_be_continued_on_its_worker(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    """A call sent with the final flag ends its session at once; vLLM keeps its reply all the
    same, and a later call naming it goes to the worker that made it."""
    g = await gateway(config([w.url for w in two]))
    try:
        await busy(http, g, "busy")  # w0
        async with http.post(url(g, "/v1/responses"), headers={"x-session-final": "true"},
                             json={"model": "fake", "input": "One question."}) as r:
            first = str((await r.json())["id"])  # made on w1, its session ended
        await busy(http, g, "busy-2")  # w1: now the least loaded is w0 again
        second = await call(http, g, {"model": "fake", "input": "And another.",
                                       "previous_response_id": first})
    finally:
        await g.stop()
    assert first in two[1].made and second in two[1].made


async def test_a_stored_response_is_fetched_from_the_worker_that_made_it(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    """``GET /v1/responses/{id}`` (a background response polled) passes through to the worker
    that made the id, not to the least loaded one, which would answer 404."""
    g = await gateway(config([w.url for w in two]))
    try:
        await busy(http, g, "busy")
        made = await call(http, g, {"model": "fake", "input": "Fix the bug in foo.py"})
        statuses = []
        for _ in range(3):
            async with http.get(url(g, f"/v1/responses/{made}")) as r:
                statuses.append((r.status, (await r.json()).get("id")))
        async with http.get(url(g, "/v1/responses/resp_never")) as r:
            unknown = r.status
    finally:
        await g.stop()
    assert statuses == [(200, made)] * 3
    assert unknown == 404  # known nowhere: the least loaded worker's answer
