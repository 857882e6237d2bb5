"""How the store reaches Redis: one URL or a Sentinel-named primary, over TLS or not, as an ACL
user or not, all through redis-py's own support; and the check at start that tells a
configuration mistake (wrong password, untrusted certificate, unknown service) from an outage.

A mistake cannot heal by retrying, so the proxy refuses to start with a message naming it; an
outage degrades service as ``store.on_store_failure`` says and is retried (:mod:`.redis_link`).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ResponseError,
)

from marsproxy.aimd.stores.config import StoreConfig, sentinel_address
from marsproxy.aimd.stores.redis_errors import FAILURES

# At start a refusal (DENIED: protected mode) is an outage like the others: it passes.
_START_ERRORS: tuple[type[BaseException], ...] = (*FAILURES, ResponseError)


class StoreSetupError(Exception):
    """The ``store:`` section cannot work as written (the message says which key and why)."""


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (asks the sentinels for the primary on every new connection, drops
    connections to a demoted one) with the bounded, waiting behaviour of the plain URL's."""


@dataclass
class Clients:
    redis: Redis  # operations: a bounded pool
    sub: Redis  # the wake-up subscription: blocks on reads by design
    sentinel: Sentinel | None
    where: str  # for log lines and errors: never a password


def read_secret(env_key: str, env: str | None, file_key: str, file: str | None) -> str | None:
    """The password named by ``env`` or ``file`` (none: None); StoreSetupError if absent."""
    if env:
        value = os.environ.get(env)
        if value is None:
            raise StoreSetupError(f"store.{env_key} names ${env}, which is not set")
        return value
    if file:
        try:
            return Path(file).read_text().removesuffix("\n")
        except OSError as exc:
            raise StoreSetupError(f"store.{file_key}: cannot read {file}: {exc.strerror}") from exc
    return None


def _tls_kwargs(cfg: StoreConfig) -> dict[str, Any]:
    tls = cfg.tls
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(tls, key)
        if path is not None and not Path(path).is_file():
            raise StoreSetupError(f"store.tls.{key}: no such file: {path}")
    return {"ssl_ca_certs": tls.ca_file, "ssl_certfile": tls.cert_file,
            "ssl_keyfile": tls.key_file, "ssl_check_hostname": tls.check_hostname,
            "ssl_cert_reqs": "required"}


def _server_kwargs(cfg: StoreConfig) -> tuple[dict[str, Any], bool]:
    """Connection kwargs of the data servers (the URL's, then the config keys over them)."""
    kw: dict[str, Any] = dict(parse_url(cfg.redis_url))
    tls = cfg.redis_url.startswith("rediss://")
    if cfg.username is not None:
        kw["username"] = cfg.username
    password = read_secret("password_env", cfg.password_env, "password_file", cfg.password_file)
    if password is not None:
        kw["password"] = password
    if tls:
        kw.update(_tls_kwargs(cfg))
    kw.update(decode_responses=True, socket_connect_timeout=cfg.op_timeout_s)
    return kw, tls


def make_clients(cfg: StoreConfig) -> Clients:
    """Clients for ``cfg``; StoreSetupError when a secret or a certificate file is missing."""
    kw, tls = _server_kwargs(cfg)
    # One quick retry covers a pooled connection that a Redis restart or failover broke. No
    # socket timeout: every op runs under its own op_timeout_s (RedisLink.io and the batcher),
    # and a per-read timer inside redis-py would cost ~8 % of an admission. A bounded pool: a
    # burst waits for a free connection instead of opening one socket per concurrent op.
    ops: dict[str, Any] = {"max_connections": cfg.max_connections, "timeout": None,
                           "retry": Retry(NoBackoff(), 1), "client_name": f"marsproxy:{cfg.pool}"}
    sub_name = f"marsproxy:{cfg.pool}:wakeups"
    if not cfg.sentinels:
        redis = Redis.from_pool(BlockingConnectionPool(**kw, **ops))
        sub = Redis.from_pool(ConnectionPool(**kw, client_name=sub_name))
        return Clients(redis, sub, None, _url_where(kw))
    for key in ("host", "port", "connection_class", "path"):
        kw.pop(key, None)  # the sentinels name the primary; TLS is chosen by the ssl flag
    sentinel_kw: dict[str, Any] = {
        "username": cfg.sentinel_username,
        "password": read_secret("sentinel_password_env", cfg.sentinel_password_env,
                                "sentinel_password_file", cfg.sentinel_password_file),
        "socket_connect_timeout": cfg.op_timeout_s,
        "socket_timeout": cfg.op_timeout_s,  # sentinel queries are rare: a timer costs nothing
        "decode_responses": True,
    }
    if tls:  # one TLS setting for the whole deployment: sentinels speak TLS too
        sentinel_kw.update(ssl=True, **_tls_kwargs(cfg))
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        [sentinel_address(n) for n in cfg.sentinels], sentinel_kwargs=sentinel_kw, ssl=tls, **kw
    )
    redis = sentinel.master_for(cfg.sentinel_service, redis_class=Redis,
                                connection_pool_class=BlockingSentinelPool, **ops)
    sub = sentinel.master_for(cfg.sentinel_service, redis_class=Redis, client_name=sub_name)
    where = f"service {cfg.sentinel_service!r} of sentinels {', '.join(cfg.sentinels)}"
    return Clients(redis, sub, sentinel, where)


def _url_where(kw: dict[str, Any]) -> str:
    if kw.get("path"):
        return str(kw["path"])
    return f"{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}"


async def close_clients(c: Clients) -> None:
    await c.redis.aclose()
    await c.sub.aclose()
    if c.sentinel is not None:
        for s in c.sentinel.sentinels:
            await s.aclose()


def setup_problem(exc: BaseException, cfg: StoreConfig, what: str) -> str | None:
    """What is misconfigured, if ``exc`` (from reaching ``what``) says so; None: an outage."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    sentinel = what.startswith("sentinel")
    for e in chain:
        if isinstance(e, ssl.SSLCertVerificationError):
            why = getattr(e, "verify_message", None) or e.strerror or e
            return (f"the TLS certificate of {what} is not trusted ({why}):"
                    " check store.tls.ca_file (and store.tls.check_hostname)")
        if isinstance(e, ssl.SSLError):
            return (f"TLS with {what} failed ({e.reason or e}): check store.tls and that the"
                    " address is a TLS port")
        if isinstance(e, AuthenticationError | AuthenticationWrongNumberOfArgsError):
            keys = ("store.sentinel_username and store.sentinel_password_env/_file" if sentinel
                    else "store.username and store.password_env/_file (or the URL's)")
            return f"{what} refused the credentials ({e}): check {keys}"
    return None


async def check_at_start(c: Clients, cfg: StoreConfig) -> None:
    """Reach Redis once. StoreSetupError for a configuration mistake; an outage passes (the
    store starts degraded and reconnects), and so does anything unexpected."""
    if c.sentinel is not None:
        answered = False
        for node, s in zip(cfg.sentinels, c.sentinel.sentinels, strict=True):
            try:
                async with asyncio.timeout(cfg.op_timeout_s):
                    masters = await s.sentinel_masters()
            except FAILURES as exc:
                problem = setup_problem(exc, cfg, f"sentinel {node}")
                if problem is not None:
                    raise StoreSetupError(problem) from None
                continue
            answered = True
            if cfg.sentinel_service in masters:
                break
        else:
            if answered:
                raise StoreSetupError(
                    f"no sentinel of {', '.join(cfg.sentinels)} monitors a primary named"
                    f" {cfg.sentinel_service!r}: check store.sentinel_service")
    try:
        async with asyncio.timeout(cfg.op_timeout_s):
            await c.redis.ping()
    except _START_ERRORS as exc:
        problem = setup_problem(exc, cfg, f"Redis at {c.where}")
        if problem is not None:
            raise StoreSetupError(problem) from None
