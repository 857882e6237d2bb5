"""After Redis comes back, new sessions wait ``store.recover_hold_s`` (held ones go on).

Why: another replica re-asserts its leases only once it noticed the outage and reconnected,
and a failover can have lost its latest grants; until then a slot that looks free may be
taken. The store refuses new admissions (the gateway queues them) and renews admitted ones.
"""

from __future__ import annotations

from typing import Any

from marsproxy.aimd.stores import RedisStore, StoreConfig
from tests.integration.aimd.conftest import FakeClock

LIMIT = 3


async def test_new_sessions_wait_out_the_hold_admitted_ones_renew(
    private_redis: Any, clock: FakeClock, eventually: Any
) -> None:
    cfg = StoreConfig(backend="redis", redis_url=private_redis.url, pool="hold",
                      op_timeout_s=0.2, reconnect_interval_s=0.1, lease_ttl_s=60,
                      heartbeat_interval_s=10, recover_hold_s=5.0)
    store = RedisStore(cfg, clock=clock)
    await store.start()
    try:
        assert await store.try_admit("w0", "old", LIMIT, clock())
        # No hold at the first start: nothing was lost.
        assert await store.try_admit("w0", "early", LIMIT, clock())
        await store.release("w0", "early")

        private_redis.kill()
        await store.renew(clock())  # the heartbeat notices the outage
        assert not store.up
        private_redis.start()  # empty
        await eventually(lambda: store.up, 5.0)

        assert await store.admitted("w0") == 1  # "old" was re-asserted by the resync
        assert not await store.try_admit("w0", "new", LIMIT, clock())
        assert not await store.admit_if_ranked("queued", 1, "w0", LIMIT, clock(), score=1.0)
        assert await store.queue_rank("queued") == 0  # it waits in the queue meanwhile
        assert await store.try_admit("w0", "old", LIMIT, clock())  # admitted: renewed

        clock.advance(5_000)
        assert await store.try_admit("w0", "new", LIMIT, clock())
        assert await store.admit_if_ranked("queued", 1, "w0", LIMIT, clock())
        assert sorted(await store.admitted_sessions("w0")) == ["new", "old", "queued"]
    finally:
        await store.close()
