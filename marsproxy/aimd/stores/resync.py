"""Write a replica's local view back into Redis after an outage: nothing admitted is lost,
nothing is counted twice.

The replica's mirror is the truth for what *it* admitted: its leases are re-added (ZADD of an
existing member only re-scores it) and its own leases that Redis still holds but it released
are dropped, per worker, inside ``resync.lua``. Queue entries and session records changed while
Redis was away are written back in the same pipeline, records fenced as every save is
(``save.lua``: not over another replica's lease, not after the session's end), deletions
fenced alike (``forget.lua``). Every step is idempotent, so a pass that fails half-way is
simply repeated by the reconnect loop.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING

from marsproxy.aimd.stores.redis_keys import Arg

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

    from marsproxy.aimd.stores.redis_store import RedisStore

_PASSES = 3  # ops keep running locally during a pass; repeat while they changed something


async def resync(store: RedisStore) -> int:
    """Returns how many sessions turned out to be owned by another replica (now forgotten)."""
    moved = 0
    for _ in range(_PASSES):
        gen = store.gen
        moved += await _one_pass(store)
        if store.gen == gen:
            break
    return moved


async def heartbeat(store: RedisStore, pipe: Pipeline, now_ms: int, expiry_ms: int) -> None:
    """Queue ``heartbeat.lua`` on ``pipe``: this replica is live until ``expiry_ms``; its
    answer is the count of live replicas and the pool's epoch (set here if Redis has none). It
    also drops dead replicas' entries from the head of the global queue."""
    await store.scripts.heartbeat(
        keys=[store.keys.replicas, store.keys.epoch, store.keys.queue],
        args=[now_ms, expiry_ms, store.replica_id, secrets.token_hex(8),
              store.keys.asked_prefix], client=pipe,
    )


async def _one_pass(store: RedisStore) -> int:
    now = store.clock()
    expiry = now + store.lease_ms
    own = store.local.own_leases()
    workers = sorted(store.workers | own.keys())
    q_gone = set(store.q_gone)
    queued = store.local.queue_items()
    dirty = {k: raw for k in store.dirty if (raw := store.local.load_raw(k)) is not None}
    deleted = set(store.deleted)
    store.fresh.clear()
    keys = store.keys
    async with store.redis.pipeline(transaction=False) as pipe:
        await heartbeat(store, pipe, now, expiry)
        for w in workers:
            args: list[Arg] = [now, expiry, store.replica_id, keys.tomb_prefix, *own.get(w, [])]
            await store.scripts.resync(keys=[keys.adm(w), keys.own(w), keys.queue], args=args,
                                       client=pipe)
        if q_gone:
            pipe.zrem(keys.queue, *q_gone)
        if queued:  # marked as asked (admit_ranked.lua drops unmarked entries as dead)
            pipe.zadd(keys.queue, dict(queued))
            for s, _ in queued:
                pipe.set(keys.asked(s), 1, px=store.lease_ms)
        for k, raw in dirty.items():
            # Fenced as any save (save.lua): after the leases above, so a session that moved
            # to another replica or ended there meanwhile keeps its holder's record, or none.
            worker = str(json.loads(raw).get("worker"))
            await store.scripts.save(keys=keys.saved(k, worker),
                                     args=[raw, store.session_ms, store.replica_id, k],
                                     client=pipe)
        for k in sorted(deleted):  # fenced too (forget.lua)
            await store.scripts.forget(keys=[keys.session(k), *map(keys.own, workers)],
                                       args=[store.replica_id, k], client=pipe)
        results = await store.io(pipe.execute())
    # A session queued at the snapshot may have been admitted or dequeued since (ops go on
    # meanwhile; once the link is up they go straight to Redis, before this pipeline): the
    # ZADD above then re-added an entry nobody would remove, ranking ahead of every newcomer.
    left = [s for s, _ in queued if store.local.rank_sync(s) is None]
    if left:
        await store.io(store.redis.zrem(keys.queue, *left))
    store.replicas, store.epoch = int(results[0][0]), str(results[0][1])
    moved = 0
    for w, gone in zip(workers, results[1 : 1 + len(workers)], strict=True):
        for s in gone:
            if (w, s) not in store.fresh and store.local.drop_lease(w, s):
                moved += 1
                store.lost.append((w, s))
    store.q_gone -= q_gone
    store.dirty -= dirty.keys()
    store.deleted -= deleted
    return moved
