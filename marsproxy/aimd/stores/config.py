"""Configuration of the admission state store (mounted into ``MarsConfig`` as ``store:``).

Same pattern as :mod:`marsproxy.config`: frozen sections, every tunable a ``Field`` with a
default and a description. DESIGN §5.5 holds the reasoning behind the defaults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from marsproxy.config_section import Section as _Section

StoreBackend = Literal["memory", "redis"]
FailureMode = Literal["local", "closed", "open"]


class StoreConfig(_Section):
    """``store:`` — where admission state lives: this process, or Redis shared by replicas."""

    backend: StoreBackend = Field(
        "memory", description="memory: one replica, no Redis; redis: replicas share state."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis URL used when backend is redis."
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
        "a crashed replica's slots come back within it.",
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

    @model_validator(mode="after")
    def _heartbeat_fits_lease(self) -> StoreConfig:
        # Two heartbeats per lease: one lost or late heartbeat must not expire a live lease.
        if self.heartbeat_interval_s >= self.lease_ttl_s / 2:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be shorter than "
                f"lease_ttl_s / 2 ({self.lease_ttl_s / 2})"
            )
        return self
