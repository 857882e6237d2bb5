"""A session ended and its id reused before the old session's end reached Redis: the store
calls of an ended session (its lease released, its queue entry removed) ran after the plane
decided it (the control tick awaits the store between the two; a DELETE's release is a task),
while the new session of the id asks the store under the same key. The old release must come
first, or it drops the new session's lease: its slot then looks free to every replica while
it is still taken. Replicas a and b (a alone for the idle end) share a private redis-server;
the one worker's window is 1. The probe for a taken slot is a session of b's: refused at its
queue deadline while the slot is x's, served at once when the store lost x's lease."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from marsproxy.policy.plane import Phase

_Factory = Any
KEY = "anon/id/x"
STORE = {"lease_ttl_s": 2.0, "heartbeat_interval_s": 0.2, "leader_ttl_s": 1.0,
         "op_timeout_s": 2.0, "reconnect_interval_s": 0.2}


async def _replicas(make_stack: _Factory, redis_url: str, pool: str, **admission: Any) -> Any:
    store = {"backend": "redis", "redis_url": redis_url, "pool": pool} | STORE
    a = await make_stack(window=1, store=store, queue_deadline_s=1.0, aging_margin_s=0.5,
                         **admission)
    b = await make_stack(window=1, store=store, share=a, queue_deadline_s=1.0,
                         aging_margin_s=0.5, **admission)
    return a, b


def _tick_held_when(s: Any, cond: Any) -> tuple[asyncio.Event, asyncio.Event]:
    """Holds a's control tick at its ``read_windows`` (after the plane's tick, before its
    outcome is carried out) once ``cond()`` holds, until the second event is set."""
    adm = s.proxy.gateway.admission
    real, paused, go = adm.store.read_windows, asyncio.Event(), asyncio.Event()

    async def read_windows() -> Any:
        if not paused.is_set() and cond():
            paused.set()
            await go.wait()
        return await real()

    adm.store.read_windows = read_windows
    return paused, go


async def _slot_taken(b: Any) -> None:
    """x holds the only slot: a session of b's waits for it until its queue deadline."""
    status, _, body = await asyncio.wait_for(b.chat("z"), 10)
    assert (status, body.get("error", {}).get("code")) == (503, "queue_deadline"), (
        "another replica was admitted into the slot x holds: x's lease is gone from the store")


async def test_a_pending_sessions_end_carried_late_keeps_the_reused_ids_lease(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """x pending on a (the slot is b's holder's) reaches its queue deadline; the tick that
    ends it is held before its dequeue and release; the slot frees and x's id comes back."""
    a, b = await _replicas(make_stack, private_redis.url, "pending-end")
    plane = a.proxy.gateway.plane
    assert (await b.chat("holder"))[0] == 200  # the only slot, b's
    paused, go = _tick_held_when(a, lambda: plane.phase(KEY) is Phase.ENDED)
    old = asyncio.create_task(a.chat("x", content="old"))

    async def pending() -> bool:
        return plane.phase(KEY) is Phase.PENDING

    await a.until(pending)  # proposed by a's core, refused by the store (b holds the slot)
    await asyncio.wait_for(paused.wait(), 10)
    status, _, body = await asyncio.wait_for(old, 10)
    assert (status, body["error"]["code"]) == (503, "queue_deadline")
    assert (await b.chat("holder", final=True))[0] == 200  # the slot frees
    assert (await a.chat("x", content="new"))[0] == 200  # the id reused: admitted, served
    go.set()
    assert plane.phase(KEY) is Phase.DORMANT
    await _slot_taken(b)
    assert plane.phase(KEY) is Phase.DORMANT  # a still holds the new session


async def test_an_idle_end_carried_late_keeps_the_reused_ids_lease(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """x, admitted and idle on a, times out; the tick that ends it is held before it releases
    the lease; a new session of x asks the store meanwhile (and finds the old lease)."""
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "idle-end"} | STORE
    a = await make_stack(window=1, store=store, idle_timeout_min_s=1.5, idle_timeout_max_s=1.5)
    plane = a.proxy.gateway.plane
    assert (await a.chat("x", content="old"))[0] == 200
    paused, go = _tick_held_when(a, lambda: plane.phase(KEY) is Phase.ENDED)
    await asyncio.wait_for(paused.wait(), 10)  # its idle timeout ended it
    assert (await a.chat("x", content="new"))[0] == 200  # the id reused: admitted, served
    go.set()
    await _ticks(a, 1)  # the held tick carried out (the next reads the windows): its release in
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        assert await r.zrange("mars:{idle-end}:adm:w0", 0, -1) == [KEY]  # x's lease
        assert await r.exists("mars:{idle-end}:ended:" + KEY) == 0  # not ended in the store
    finally:
        await r.aclose()
    assert plane.phase(KEY) is Phase.DORMANT


async def test_a_deleted_sessions_release_comes_before_the_reused_ids_admission(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """x, admitted on a, is deleted; its release (a task) is held at the store; a new session
    of x asks meanwhile: it is admitted only after that release, and keeps its lease."""
    a, b = await _replicas(make_stack, private_redis.url, "deleted-end")
    adm, plane = a.proxy.gateway.admission, a.proxy.gateway.plane
    assert (await a.chat("x", content="old"))[0] == 200
    real, go, released = adm.store.release, asyncio.Event(), asyncio.Event()

    async def release(worker: str, session: str, **kw: Any) -> Any:
        if session == KEY and not released.is_set():
            await go.wait()
            try:
                return await real(worker, session, **kw)
            finally:
                released.set()
        return await real(worker, session, **kw)

    adm.store.release = release
    async with a.http.delete(a.url("/mars/v1/sessions/x")) as resp:
        assert resp.status == 200
    assert plane.phase(KEY) is Phase.ENDED
    new = asyncio.create_task(a.chat("x", content="new"))
    await asyncio.wait({new}, timeout=1.0)  # the new session's ask, if it does not wait
    go.set()
    status, _, body = await asyncio.wait_for(new, 10)
    assert status == 200, body
    await asyncio.wait_for(released.wait(), 10)
    await _slot_taken(b)
    assert plane.phase(KEY) is Phase.DORMANT


async def test_the_old_release_sent_during_the_new_sessions_claim_leaves_it_held(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """x deleted on a, its release held until a new session of x asks the store (its ask on
    the wire; at most a second): this replica's heartbeats keep the new session's lease, and
    the session stays a's (not ended as moved)."""
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "claim-end"} | STORE
    a = await make_stack(window=1, store=store)
    adm, plane = a.proxy.gateway.admission, a.proxy.gateway.plane
    assert (await a.chat("x", content="old"))[0] == 200
    st, go = adm.store, asyncio.Event()
    real_release, real_claim, real_admit = st.release, st.claim, st.admit_if_ranked

    async def release(worker: str, session: str, **kw: Any) -> Any:
        if session == KEY:
            await go.wait()
        return await real_release(worker, session, **kw)

    def asking(real: Any) -> Any:
        async def ask(*args: Any, **kw: Any) -> Any:
            sent = asyncio.ensure_future(real(*args, **kw))
            await asyncio.sleep(0)  # on its way to Redis
            go.set()
            await asyncio.sleep(0)
            return await sent
        return ask

    st.release, st.claim, st.admit_if_ranked = release, asking(real_claim), asking(real_admit)
    async with a.http.delete(a.url("/mars/v1/sessions/x")) as resp:
        assert resp.status == 200
    asyncio.get_running_loop().call_later(1.0, go.set)  # a store call that waits for it
    assert (await a.chat("x", content="new"))[0] == 200
    real_renew, beats = st.renew, 0

    async def renew(now_ms: int) -> int:
        nonlocal beats
        got = await real_renew(now_ms)
        beats += 1
        return got

    st.renew = renew

    async def two_heartbeats() -> bool:
        return beats >= 2

    await a.until(two_heartbeats)
    await _ticks(a, 2)  # the second began after the beats: it drained what they found lost
    assert plane.phase(KEY) is Phase.DORMANT


async def test_a_record_saved_before_the_end_lands_before_the_reused_ids_admission(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """x's second turn ends on a; the save of its record is held at the store; x is deleted
    and a new session of x asks meanwhile. The old record must land before the old end (which
    deletes it) and so before the new session is admitted: landing after, it was written over
    the new session's (a owns the lease of both) and another replica adopted x as it was."""
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "save-end"} | STORE
    a = await make_stack(window=1, store=store)
    adm, plane = a.proxy.gateway.admission, a.proxy.gateway.plane
    assert (await a.chat("x", content="old"))[0] == 200
    st, go, held = adm.store, asyncio.Event(), asyncio.Event()
    real_save, saved = st.save_session, []

    async def save_session(key: str, record: dict[str, Any]) -> None:
        if key == KEY and not held.is_set():
            held.set()
            await go.wait()
        await real_save(key, record)
        saved.append(record)

    st.save_session = save_session
    assert (await a.chat("x", content="old again"))[0] == 200
    await asyncio.wait_for(held.wait(), 10)  # the old session's record, on its way
    async with a.http.delete(a.url("/mars/v1/sessions/x")) as resp:
        assert resp.status == 200
    new = asyncio.create_task(a.chat("x", content="new"))
    await asyncio.wait({new}, timeout=1.0)  # admitted meanwhile, if it does not wait
    go.set()
    status, _, body = await asyncio.wait_for(new, 10)
    assert status == 200, body
    assert plane.phase(KEY) is Phase.DORMANT

    async def settled() -> bool:
        return not adm._store_calls

    await a.until(settled)
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        raw = await r.get("mars:{save-end}:sess:" + KEY)
    finally:
        await r.aclose()
    assert raw is not None and json.loads(raw) == saved[-1], (
        "the record in the store is not the new session's latest")
    assert json.loads(raw)["turns"] == 1, "the old session's record (2 turns) came back"


async def _ticks(s: Any, n: int) -> None:
    """Waits for ``n`` more control ticks (each reads the windows once)."""
    adm, seen = s.proxy.gateway.admission, 0
    real = adm.store.read_windows

    async def read_windows() -> Any:
        nonlocal seen
        seen += 1
        return await real()

    adm.store.read_windows = read_windows

    async def done() -> bool:
        return seen >= n

    await s.until(done)
