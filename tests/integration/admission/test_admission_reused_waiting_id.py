"""A waiting session ended (its queue deadline) and its id reused before the gateway answered
its waiting request: with the Redis store the control tick awaits the store (windows) between
the plane's decision and carrying it out. The reused id's request is a new session of its
own: the old session's refusal is not its, nor is its admission the old request's."""

from __future__ import annotations

import asyncio
from typing import Any

from marsproxy.policy.plane import Phase

_Factory = Any
KEY = "anon/id/x"


async def test_a_reused_id_is_not_refused_with_the_old_sessions_queue_deadline(
    make_stack: _Factory, private_redis: Any,
) -> None:
    s = await make_stack(window=1, queue_deadline_s=1.0, aging_margin_s=0.5, store={
        "backend": "redis", "redis_url": private_redis.url, "pool": "reused-waiting"})
    old, go = await _expired_in_a_held_tick(s)
    plane = s.proxy.gateway.plane
    new = asyncio.create_task(s.chat("x", content="new"))  # the id reused meanwhile
    await s.until(lambda: _phase(plane, Phase.WAITING))  # a new session, waiting its turn
    go.set()
    status, _, body = await asyncio.wait_for(old, 10)
    assert (status, body["error"]["code"]) == (503, "queue_deadline")
    assert (await s.chat("holder", final=True))[0] == 200  # the slot frees
    status, _, body = await asyncio.wait_for(new, 10)
    assert status == 200, body
    assert await s.queue_length() == 0


async def test_the_reused_ids_admission_is_not_the_old_requests(
    make_stack: _Factory, private_redis: Any,
) -> None:
    s = await make_stack(window=1, queue_deadline_s=1.0, aging_margin_s=0.5, store={
        "backend": "redis", "redis_url": private_redis.url, "pool": "reused-admitted"})
    old, go = await _expired_in_a_held_tick(s)
    assert (await s.chat("holder", final=True))[0] == 200  # the slot frees
    assert (await s.chat("x", content="new"))[0] == 200  # the id reused: admitted, served
    go.set()
    status, _, body = await asyncio.wait_for(old, 10)
    assert (status, body["error"]["code"]) == (503, "queue_deadline")
    assert plane_row(s) == (Phase.DORMANT, 0)  # the new session, its one call over


def plane_row(s: Any) -> tuple[Phase, int]:
    plane = s.proxy.gateway.plane
    return plane.phase(KEY), plane.admission.sessions.get(KEY).in_flight


async def _expired_in_a_held_tick(s: Any) -> tuple[asyncio.Task[Any], asyncio.Event]:
    """Session x waits behind the one slot until its queue deadline; the control tick that
    ends it is held at its next store call (until the event is set)."""
    adm, plane = s.proxy.gateway.admission, s.proxy.gateway.plane
    assert (await s.chat("holder"))[0] == 200  # the only slot, held (dormant)
    old = asyncio.create_task(s.chat("x", content="old"))
    await s.until(lambda: _phase(plane, Phase.WAITING))
    real, paused, go = adm.store.read_windows, asyncio.Event(), asyncio.Event()

    async def read_windows() -> Any:
        if not paused.is_set() and plane.phase(KEY) is Phase.ENDED:
            paused.set()
            await go.wait()
        return await real()

    adm.store.read_windows = read_windows
    await asyncio.wait_for(paused.wait(), 10)
    return old, go


async def _phase(plane: Any, phase: Phase) -> bool:
    return bool(plane.phase(KEY) is phase)


async def test_a_client_leaving_on_the_way_to_wait_leaves_its_sessions_other_request(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """Two requests of x on their way to waiting (behind a confirmation pass held at the
    store); the client of one leaves: the session waits on for the other."""
    s = await make_stack(window=2, store={
        "backend": "redis", "redis_url": private_redis.url, "pool": "leaving-on-the-way"})
    plane = s.proxy.gateway.plane
    other, go = await _confirmations_held(s)
    leaves = asyncio.create_task(s.chat("x", content="leaves"))
    stays = asyncio.create_task(s.chat("x", content="stays"))

    async def both_on_their_way() -> bool:
        rec = plane.admission.sessions.get(KEY)
        return rec is not None and rec.in_flight == 2

    await s.until(both_on_their_way)
    leaves.cancel()

    async def left() -> bool:
        rec = plane.admission.sessions.get(KEY)
        return rec is None or rec.in_flight == 1

    await s.until(left)
    go.set()
    assert (await asyncio.wait_for(other, 10))[0] == 200
    assert (await s.chat("holder", final=True))[0] == 200  # a slot for x
    status, _, body = await asyncio.wait_for(stays, 10)
    assert status == 200, body


async def test_a_refusal_whose_request_left_is_not_the_reused_ids(
    make_stack: _Factory, private_redis: Any,
) -> None:
    """x's request on its way to waiting (behind a held confirmation pass) when x is deleted:
    the refusal kept for it, its client gone, is nobody's; x's next session is served."""
    s = await make_stack(window=2, store={
        "backend": "redis", "redis_url": private_redis.url, "pool": "refusal-left"})
    adm, plane = s.proxy.gateway.admission, s.proxy.gateway.plane
    other, go = await _confirmations_held(s)
    leaves = asyncio.create_task(s.chat("x", content="leaves"))
    await s.until(lambda: _phase(plane, Phase.WAITING))
    async with s.http.delete(s.url("/mars/v1/sessions/x")) as r:
        assert r.status == 200
    await s.until(lambda: _phase(plane, Phase.ENDED))
    leaves.cancel()

    async def gone() -> bool:
        return not adm.held.expects(KEY)

    await s.until(gone)
    go.set()
    assert (await asyncio.wait_for(other, 10))[0] == 200
    again = asyncio.create_task(s.chat("x", content="again"))  # waits: both slots held
    await s.until(lambda: _phase(plane, Phase.WAITING))
    assert (await s.chat("holder", final=True))[0] == 200
    status, _, body = await asyncio.wait_for(again, 10)
    assert status == 200, body


async def _confirmations_held(s: Any) -> tuple[asyncio.Task[Any], asyncio.Event]:
    """One slot of two held; session y pending, its confirmation pass held at the store
    (until the event is set): x's requests wait for that pass on their way to waiting."""
    adm = s.proxy.gateway.admission
    assert (await s.chat("holder"))[0] == 200
    real, paused, go = adm.store.admit_if_ranked, asyncio.Event(), asyncio.Event()

    async def admit_if_ranked(*a: Any, **kw: Any) -> Any:
        if not go.is_set():
            paused.set()
            await go.wait()
        return await real(*a, **kw)

    adm.store.admit_if_ranked = admit_if_ranked
    other = asyncio.create_task(s.chat("y"))
    await asyncio.wait_for(paused.wait(), 10)
    return other, go
