"""Configuration of the probes (mounted into ``MarsConfig`` as ``probes:``).

Same pattern as :mod:`marsproxy.config`: frozen sections, every tunable a ``Field`` with a
default and a description.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from marsproxy.config_section import Section as _Section


class VllmProbeConfig(_Section):
    period_s: float = Field(
        0.2, gt=0,
        description="Period of scraping each worker's /metrics while it serves (or sessions"
        " wait for it, or its last scrape failed).",
    )
    idle_period_s: float = Field(
        1.0, gt=0,
        description="Period of scraping an idle worker: it runs and queues nothing, and no call"
        " of the proxy is in flight there. Each scrape costs the engine's API server CPU (vLLM"
        " renders the page for every read); at or below period_s: always period_s.",
    )
    timeout_s: float = Field(
        0.5, gt=0, description="Timeout of one /metrics scrape; a timeout counts as a scrape error."
    )
    stale_after_s: float = Field(
        2.5,
        gt=0,
        description="A worker whose last good sample is older than this is stale: saturated."
        " Longer than idle_period_s.",
    )

    @property
    def slowest_period_s(self) -> float:
        return max(self.period_s, self.idle_period_s)

    @model_validator(mode="after")
    def _stale_after_exceeds_periods(self) -> VllmProbeConfig:
        # Otherwise every worker would flap to stale between two healthy scrapes.
        if self.stale_after_s <= self.slowest_period_s:
            raise ValueError(
                f"stale_after_s ({self.stale_after_s}) must be longer than the scrape periods"
                f" (period_s {self.period_s}, idle_period_s {self.idle_period_s}): raise it, or"
                " lower idle_period_s"
            )
        return self


class NvmlProbeConfig(_Section):
    enabled: bool = Field(
        True, description="Read GPU memory and utilization through NVML when a GPU is present."
    )
    gpus_by_worker: dict[str, tuple[Annotated[int, Field(ge=0)], ...]] = Field(
        default_factory=dict,
        description="GPU indices (NVML numbering) that each worker (by name) runs on.",
    )
    period_s: float = Field(1.0, gt=0, description="Period of reading NVML.")


class CpuProbeConfig(_Section):
    cgroup_path: str = Field(
        "",
        description=(
            "cgroup v2 directory where tools run (e.g. /sys/fs/cgroup/tools.slice); "
            "empty: the host (/proc/pressure/cpu)."
        ),
    )
    tool_cpus: float = Field(
        0.0,
        ge=0,
        description="CPUs available to tools; 0: the cgroup's cpu.max quota, else usable CPUs.",
    )
    period_s: float = Field(1.0, gt=0, description="Period of reading CPU pressure.")


class KVEventsSourceConfig(_Section):
    """``workers[].kv_events``: where a worker publishes its KV events (vLLM's
    ``--kv-events-config``, seen from the proxy)."""

    endpoint: str = Field(
        description="The worker's PUB socket as the proxy reaches it, e.g. tcp://10.0.0.5:5557"
        " (vLLM binds it with endpoint tcp://*:5557)."
    )
    replay_endpoint: str | None = Field(
        None,
        description="The worker's replay (ROUTER) socket, e.g. tcp://10.0.0.5:5558; unset: gaps"
        " are not replayed (the index forgets and goes on).",
    )
    topic: str = Field("", description="The topic the worker publishes on (its config's topic).")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, v: str | None) -> str | None:
        if v is None or v.startswith(("ipc://", "inproc://")):
            return v
        if not v.startswith("tcp://"):
            raise ValueError(f"a ZMQ endpoint starts with tcp://, ipc:// or inproc://, got {v!r}")
        if "*" in v:
            raise ValueError(f"{v!r}: name the worker's host (tcp://HOST:PORT), not *")
        host, _, port = v[len("tcp://"):].rpartition(":")
        if not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{v!r}: a TCP endpoint is tcp://HOST:PORT")
        return v


class KVEventsConfig(_Section):
    """``probes.kv_events:`` — subscribing to the workers' KV events (docs/kv-events.md)."""

    session_id: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Put the proxy's session key in the body's session_id of relayed requests,"
        " so the workers' KV events name the session: auto (when some worker has kv_events),"
        " always, never. A client's own session_id is replaced.",
    )
    tokenize: Literal["auto", "never"] = Field(
        "auto",
        description="auto: tokenize each scheduled chat/completions prompt on a worker with"
        " kv_events (its /tokenize) to predict cached tokens, place new sessions by prefix and"
        " verify retention; never: none of that (the index is observed only).",
    )


class KVEventsTuning(_Section):
    """``probes.tuning.kv_events:`` — the KV event subscriber's internals."""

    replay_timeout_s: float = Field(
        2.0, gt=0,
        description="Longest wait for a replay's next frame; then the gap is given up (resync).",
    )
    max_pending_batches: int = Field(
        10_000, ge=1,
        description="Live batches held while a gap is replayed; more: resync at once. A replay"
        " may send this many batches past the held one it must reach (at a connection before"
        " any live batch: in all); more: it is cut off as if it had ended (a gap left open"
        " resyncs). Keep it at or above the workers' buffer_steps.",
    )
    max_pending_bytes: int = Field(
        32 * 2**20, ge=1,
        description="Payload bytes of the batches held while a gap is replayed; more: resync"
        " at once (decoded, they take a few times that).",
    )
    max_message_bytes: int = Field(
        16 * 2**20, ge=1,
        description="Largest frame taken from a publisher's event or replay socket"
        " (ZMQ_MAXMSGSIZE): one larger drops that connection (the index starts over, or the"
        " replay is given up).",
    )
    reconnect_s: float = Field(
        1.0, gt=0, description="ZMQ reconnect interval to a publisher that went away."
    )
    rate_window_s: float = Field(
        10.0, gt=0, description="Window of the events/s figure in the state document."
    )
    tokenize_timeout_s: float = Field(
        1.0, gt=0,
        description="Longest wait for /tokenize; a prompt not tokenized in time is relayed"
        " without prediction or prefix placement.",
    )
    ledger_grace_s: float = Field(
        1.0, ge=0,
        description="A retention reservation younger than this is not corrected by the index"
        " (its call's last blocks may still be on their way).",
    )


class ProbesTuning(_Section):
    """``probes.tuning:`` — the probes' internals."""

    kv_events: KVEventsTuning = KVEventsTuning()


class ProbesConfig(_Section):
    """``probes:`` — vLLM /metrics scraping, NVML, CPU pressure and KV events."""

    vllm: VllmProbeConfig = VllmProbeConfig()
    nvml: NvmlProbeConfig = NvmlProbeConfig()
    cpu: CpuProbeConfig = CpuProbeConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    tuning: ProbesTuning = Field(
        ProbesTuning(),
        description="The probes' internals (the KV event subscriber's timeouts and buffers).",
    )
