"""Configuration of the admission state store (mounted into ``MarsConfig`` as ``store:``).

Same pattern as :mod:`marsproxy.config`: frozen sections, every tunable a ``Field`` with a
default and a description.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_serializer, field_validator, model_validator

from marsproxy.config_section import Section as _Section
from marsproxy.config_section import redis_url

StoreBackend = Literal["memory", "redis"]
FailureMode = Literal["local", "closed", "open"]


class StoreTlsConfig(_Section):
    """``store.tls:`` — certificates for a ``rediss://`` URL (TLS is on iff the scheme is)."""

    ca_file: str | None = Field(
        None,
        description="CA bundle (PEM) that signed the Redis servers' certificates; none: the"
        " system's trust store.",
    )
    cert_file: str | None = Field(
        None, description="Client certificate (PEM), for servers that require one (mutual TLS)."
    )
    key_file: str | None = Field(
        None, description="Private key of cert_file (PEM); none: cert_file holds it."
    )
    check_hostname: bool = Field(
        True, description="Check that the server's certificate names the host connected to."
    )


class StoreConfig(_Section):
    """``store:`` — where admission state lives: this process, or Redis shared by replicas."""

    backend: StoreBackend = Field(
        "memory", description="memory: one replica, no Redis; redis: replicas share state."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL used when backend is redis; rediss:// for TLS (see store.tls)."
        " With sentinels only its scheme, user and db apply. A password in it is accepted but"
        " masked in dumps: prefer password_file or password_env.",
    )
    username: str | None = Field(
        None, description="ACL user to log in as (overrides the URL's); none: the default user."
    )
    password_env: str | None = Field(
        None, description="Name of the environment variable that holds the Redis password."
    )
    password_file: str | None = Field(
        None,
        description="File that holds the Redis password (a mounted secret; one trailing newline"
        " is ignored).",
    )
    sentinels: tuple[str, ...] = Field(
        (),
        description="Sentinel nodes as host:port; when set, the primary is the one they name"
        " for sentinel_service, and a failover moves the proxy to the new primary.",
    )
    sentinel_service: str = Field(
        "mymaster", min_length=1, description="The primary's name in the sentinels' config."
    )
    sentinel_username: str | None = Field(
        None, description="ACL user of the sentinels themselves; none: the default user."
    )
    sentinel_password_env: str | None = Field(
        None, description="Environment variable that holds the sentinels' own password."
    )
    sentinel_password_file: str | None = Field(
        None, description="File that holds the sentinels' own password."
    )
    tls: StoreTlsConfig = Field(
        StoreTlsConfig(), description="Certificates for TLS (rediss://) connections."
    )
    pool: str = Field(
        "default",
        min_length=1,
        description="Name of the replica group; keys live under {key_prefix}:{pool}:.",
    )
    key_prefix: str = Field("mars", min_length=1, description="First part of every Redis key.")
    lease_ttl_s: float = Field(
        10.0,
        gt=0,
        description="An admitted session's lease expires this long after its last heartbeat; "
        "a crashed replica's slots come back within it. With backend memory (one replica) "
        "leases do not expire: a stalled proxy loses no session.",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="Period of renewing this replica's leases; < lease_ttl_s / 2."
    )
    leader_ttl_s: float = Field(
        5.0, gt=0, description="Lease of the leader key; another replica takes over after it."
    )
    session_ttl_s: float = Field(
        1800.0, gt=0, description="Session records (worker, tokens, service) expire after this."
    )
    on_store_failure: FailureMode = Field(
        "local",
        description="Redis unreachable: local = keep admitting with the last windows divided "
        "among live replicas; closed = admit no new session (503); open = admit everything.",
    )
    op_timeout_s: float = Field(
        0.5, gt=0, description="Timeout of one Redis operation; a timeout counts as a failure."
    )
    max_connections: int = Field(
        32,
        ge=1,
        description="Most connections one replica keeps to Redis for its operations (the"
        " wake-up subscription has one more); a burst waits for a free one within"
        " op_timeout_s instead of opening a socket per concurrent operation.",
    )
    reconnect_interval_s: float = Field(
        1.0, gt=0, description="Period of trying Redis again while it is unreachable."
    )

    recover_hold_s: float | None = Field(
        None,
        ge=0,
        description="After Redis comes back, new sessions wait this long (held ones go on) so"
        " that every replica re-asserts its leases before slots are handed out again (a"
        " failover can lose the last writes); none: heartbeat_interval_s + 2 x"
        " reconnect_interval_s + op_timeout_s.",
    )

    @field_validator("redis_url")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return redis_url(v)

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for node in v:
            sentinel_address(node)  # raises ValueError naming the bad entry
        return v

    @field_serializer("redis_url")
    def _mask_password(self, v: str) -> str:
        return masked_url(v)

    @model_validator(mode="after")
    def _one_password_source(self) -> StoreConfig:
        for env, file in (("password_env", "password_file"),
                          ("sentinel_password_env", "sentinel_password_file")):
            if getattr(self, env) and getattr(self, file):
                raise ValueError(f"give {env} or {file}, not both")
        return self

    @property
    def hold_s(self) -> float:
        """``recover_hold_s`` or its default: how late another replica may resync."""
        if self.recover_hold_s is not None:
            return self.recover_hold_s
        return self.heartbeat_interval_s + 2 * self.reconnect_interval_s + self.op_timeout_s

    @model_validator(mode="after")
    def _heartbeat_fits_lease(self) -> StoreConfig:
        # Two heartbeats per lease: one lost or late heartbeat must not expire a live lease.
        if self.heartbeat_interval_s >= self.lease_ttl_s / 2:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be shorter than "
                f"lease_ttl_s / 2 ({self.lease_ttl_s / 2})"
            )
        return self


def sentinel_address(node: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; ValueError naming ``node`` otherwise."""
    parts = urlsplit(f"//{node}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"sentinel {node!r} is not host:port")
    return parts.hostname, port


def masked_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: safe for dumps and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
