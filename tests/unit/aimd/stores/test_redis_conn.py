"""How the store builds its Redis clients from ``store:`` and names setup mistakes (no server
needed: nothing here connects; tests/faults/test_store_tls.py and test_sentinel_failover.py
connect to real servers)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from redis.asyncio.connection import SSLConnection
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from marsproxy.aimd.stores import RedisStore, StoreConfig
from marsproxy.aimd.stores.redis_conn import (
    BlockingSentinelPool,
    StoreSetupError,
    close_clients,
    make_clients,
    read_secret,
    setup_problem,
)
from marsproxy.bench.procs import free_port
from marsproxy.config import ConfigError


def test_secrets_come_from_env_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_TEST_PW", "from-env")
    assert read_secret("password_env", "MARS_TEST_PW", "password_file", None) == "from-env"
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    assert read_secret("password_env", None, "password_file", str(f)) == "from-file"
    assert read_secret("password_env", None, "password_file", None) is None
    with pytest.raises(StoreSetupError, match=r"store.password_env names \$MARS_NOPE"):
        read_secret("password_env", "MARS_NOPE", "password_file", None)
    with pytest.raises(StoreSetupError, match=r"store\.password_file: cannot read"):
        read_secret("password_env", None, "password_file", str(tmp_path / "missing"))


async def test_url_clients_take_user_password_and_tls_from_the_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read before a connect")
    monkeypatch.setenv("MARS_TEST_PW", "pw-env")
    cfg = StoreConfig(backend="redis", redis_url="rediss://urluser:urlpw@h:6380/3",
                      username="acl", password_env="MARS_TEST_PW", tls={"ca_file": str(ca)})
    c = make_clients(cfg)
    try:
        kw = c.redis.connection_pool.connection_kwargs
        assert (kw["username"], kw["password"], kw["db"]) == ("acl", "pw-env", 3)
        assert kw["ssl_ca_certs"] == str(ca) and kw["ssl_cert_reqs"] == "required"
        assert issubclass(c.redis.connection_pool.connection_class, SSLConnection)
        assert c.where == "h:6380" and "pw" not in c.where
    finally:
        await close_clients(c)


async def test_sentinel_clients_ask_the_sentinels(tmp_path: Path) -> None:
    pw = tmp_path / "spw"
    pw.write_text("sentinel-pw")
    cfg = StoreConfig(backend="redis", sentinels=["127.0.0.1:1", "127.0.0.1:2"],
                      sentinel_service="prod", sentinel_username="sen",
                      sentinel_password_file=str(pw), max_connections=5)
    c = make_clients(cfg)
    try:
        assert c.sentinel is not None and len(c.sentinel.sentinels) == 2
        skw = c.sentinel.sentinels[0].connection_pool.connection_kwargs
        assert (skw["username"], skw["password"]) == ("sen", "sentinel-pw")
        pool = c.redis.connection_pool
        assert isinstance(pool, BlockingSentinelPool) and pool.max_connections == 5
        assert pool.service_name == "prod" and "prod" in c.where
    finally:
        await close_clients(c)


def test_missing_files_and_secrets_refuse_the_store_as_a_config_error(tmp_path: Path) -> None:
    cfg = StoreConfig(backend="redis", redis_url="rediss://h:6380/0",
                      tls={"ca_file": str(tmp_path / "nope.pem")})
    with pytest.raises(ConfigError, match=r"store: store.tls.ca_file: no such file"):
        RedisStore(cfg)
    with pytest.raises(ConfigError, match=r"store.sentinel_password_env names \$MARS_NOPE"):
        RedisStore(StoreConfig(backend="redis", sentinels=["h:1"],
                               sentinel_password_env="MARS_NOPE"))


def test_setup_problems_are_told_from_outages() -> None:
    cfg = StoreConfig(backend="redis")
    wrong = AuthenticationError("WRONGPASS invalid username-password pair")
    assert "check store.username" in str(setup_problem(wrong, cfg, "Redis at h:1"))
    assert "store.sentinel_username" in str(setup_problem(wrong, cfg, "sentinel h:2"))
    try:
        try:
            raise ssl.SSLCertVerificationError(1, "certificate verify failed")
        except OSError as exc:
            raise RedisConnectionError("Error 1 connecting to h:1.") from exc
    except RedisConnectionError as wrapped:
        got = str(setup_problem(wrapped, cfg, "Redis at h:1"))
    assert "not trusted" in got and "store.tls.ca_file" in got
    assert setup_problem(RedisConnectionError("Connection refused"), cfg, "Redis at h:1") is None
    assert setup_problem(TimeoutError(), cfg, "Redis at h:1") is None


async def test_unreachable_sentinels_at_start_are_an_outage_not_a_mistake() -> None:
    cfg = StoreConfig(backend="redis", sentinels=[f"127.0.0.1:{free_port()}"],
                      op_timeout_s=0.2, reconnect_interval_s=0.1)
    store = RedisStore(cfg)
    await store.start()  # starts degraded and keeps trying, as with one unreachable URL
    try:
        assert not store.up and store.mode == "local"
    finally:
        await store.close()
