"""``store:`` config: defaults, validation, and the factory."""

from __future__ import annotations

import pydantic
import pytest

from marsproxy.aimd.stores import (
    MemoryStore,
    RedisStore,
    StoreConfig,
    WindowRecord,
    WindowStore,
    make_store,
)
from marsproxy.aimd.stores.redis_keys import Keys


def test_defaults_follow_design() -> None:
    cfg = StoreConfig()
    assert cfg.backend == "memory" and cfg.on_store_failure == "local"
    assert cfg.pool == "default" and cfg.key_prefix == "mars"
    assert cfg.heartbeat_interval_s < cfg.lease_ttl_s / 2
    assert all(f.description for f in StoreConfig.model_fields.values())


def test_heartbeat_must_fit_twice_in_a_lease() -> None:
    with pytest.raises(pydantic.ValidationError, match="heartbeat_interval_s"):
        StoreConfig(lease_ttl_s=2, heartbeat_interval_s=1)


def test_unknown_keys_and_modes_are_errors() -> None:
    with pytest.raises(pydantic.ValidationError):
        StoreConfig(on_store_failure="retry")
    with pytest.raises(pydantic.ValidationError):
        StoreConfig.model_validate({"lease_ttl": 3})


def test_keys_share_one_cluster_hash_tag() -> None:
    k = Keys.for_pool("mars", "prod")
    assert k.adm("w1") == "mars:{prod}:adm:w1" and k.leader == "mars:{prod}:leader"
    assert all(key.startswith("mars:{prod}:") for key in (k.queue, k.windows, k.channel))


def test_window_record_round_trips_through_json() -> None:
    rec = WindowRecord(limit=7, window=9, updated_ms=123, reason="kv_overload")
    assert WindowRecord.from_json(rec.to_json()) == rec
    idle = WindowRecord(limit=2, window=9, updated_ms=123, idle_limit=9)
    assert WindowRecord.from_json(idle.to_json()) == idle
    # A record from a replica without the idle limit: idle admissions check the limit.
    old = WindowRecord.from_json('{"limit":7,"window":9,"updated_ms":123,"reason":""}')
    assert old.idle_limit is None


async def test_factory_builds_the_configured_backend() -> None:
    mem = make_store(StoreConfig())
    assert isinstance(mem, MemoryStore) and isinstance(mem, WindowStore)
    red = make_store(StoreConfig(backend="redis"), replica_id="r1")
    assert isinstance(red, RedisStore) and isinstance(red, WindowStore)
    assert red.replica_id == "r1" and red.mode == "shared"
    await red.link.close()  # never started: just release the (unconnected) clients


def test_sentinels_are_host_port_pairs() -> None:
    cfg = StoreConfig(sentinels=["s1:26379", "[::1]:26380"], sentinel_service="prod")
    assert cfg.sentinels == ("s1:26379", "[::1]:26380")
    for bad in ("s1", "s1:port", ":26379"):
        with pytest.raises(pydantic.ValidationError, match="is not host:port"):
            StoreConfig(sentinels=[bad])


def test_url_scheme_and_password_sources_are_checked() -> None:
    with pytest.raises(pydantic.ValidationError, match="must start with redis://"):
        StoreConfig(redis_url="http://h:6379")
    with pytest.raises(pydantic.ValidationError, match="password_env or password_file"):
        StoreConfig(password_env="P", password_file="/p")
    with pytest.raises(pydantic.ValidationError, match="sentinel_password_env or"):
        StoreConfig(sentinel_password_env="P", sentinel_password_file="/p")


def test_a_password_in_the_url_is_masked_in_dumps() -> None:
    cfg = StoreConfig(redis_url="rediss://app:s3cret@redis.example:6380/2")
    dumped = cfg.model_dump(mode="json")
    assert dumped["redis_url"] == "rediss://app:***@redis.example:6380/2"
    assert "s3cret" not in str(dumped)
    assert cfg.redis_url.endswith("s3cret@redis.example:6380/2")  # the real one is used


def test_recover_hold_defaults_to_how_late_another_replica_resyncs() -> None:
    cfg = StoreConfig(heartbeat_interval_s=1, reconnect_interval_s=0.5, op_timeout_s=0.25)
    assert cfg.hold_s == 1 + 2 * 0.5 + 0.25
    assert StoreConfig(recover_hold_s=0).hold_s == 0
