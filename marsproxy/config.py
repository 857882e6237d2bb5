"""The one typed configuration of marsproxy.

Sources, weakest first: built-in defaults, a YAML file, ``MARSPROXY_*`` environment variables,
command-line flags. Every tunable number lives here with its default, and has the same name in
YAML, the docs (``docs/configuration.md``) and the code.

Environment overrides name a key path with ``__`` between levels, e.g.
``MARSPROXY_SERVER__PORT=9000`` or ``MARSPROXY_UPSTREAM__CONNECT_TIMEOUT_S=2``; the value is read
as YAML, so ``MARSPROXY_WORKERS='[http://a:8000, http://b:8000]'`` works too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Field, ValidationError, field_validator

from marsproxy.aimd.config import AdmissionConfig, PlacementConfig
from marsproxy.aimd.stores.config import StoreConfig
from marsproxy.config_input import format_validation_error, read_yaml_file
from marsproxy.config_moves import retired_keys
from marsproxy.config_section import Section as _Section
from marsproxy.config_section import redis_stream_url, unique_workers, worker_url
from marsproxy.policies import PolicyError, policy_preset
from marsproxy.probes.config import KVEventsSourceConfig, ProbesConfig
from marsproxy.sched.config import SchedulerConfig
from marsproxy.security_config import AuthConfig, LimitsConfig

ENV_PREFIX = "MARSPROXY_"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the source."""


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8080, ge=0, le=65535, description="Port the proxy listens on (0: any free).")
    max_body_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="Largest request body accepted; larger gets 413."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the proxy."
    )
    access_log: bool = Field(
        False,
        description="Log one line per request (client, method, path without query, status,"
        " bytes, seconds); never headers or bodies.",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="Event loop of `marsproxy serve`: uvloop (faster; `pip install"
        " marsproxy[fast]`), asyncio, or auto (uvloop when installed).",
    )


class WorkerConfig(_Section):
    url: str = Field(description="Base URL of a vLLM (or emulated) worker, e.g. http://h:8000.")
    name: str = Field("", description="Name used in metrics and logs; defaults to host:port.")
    priority: bool | Literal["auto"] = Field(
        False,
        description="Whether the worker runs --scheduling-policy priority: true (levels go in"
        " the body's priority), false (the proxy orders continuations in its gated dispatch"
        " queue), auto (a short ordering probe at start decides; gated until it has).",
    )
    max_num_seqs: int | None = Field(
        None, ge=1,
        description="The worker's --max-num-seqs: the in-flight cap of gated dispatch; unset:"
        " scheduler.default_max_num_seqs.",
    )
    kv_events: KVEventsSourceConfig | None = Field(
        None,
        description="Where the worker publishes KV events ({endpoint, replay_endpoint, topic});"
        " unset: no KV index for it (docs/kv-events.md).",
    )

    @field_validator("url")
    @classmethod
    def _url_has_host(cls, v: str) -> str:
        return worker_url(v)

    @property
    def label(self) -> str:
        return self.name or self.url.split("://", 1)[1]


class UpstreamConfig(_Section):
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout to a worker.")
    first_byte_timeout_s: float = Field(
        600.0, gt=0, description="Time from sending a request to the worker's response headers;"
        " also how long a background Responses call may stay unfinished (docs/clients.md)."
    )
    idle_timeout_s: float = Field(120.0, gt=0, description="Longest silence between two body"
                                  " chunks of a worker's response.")
    max_connections: int = Field(
        1000, ge=1, description="Pooled keep-alive connections to all workers together."
    )
    keepalive_timeout_s: float = Field(
        4.0, gt=0,
        description="Idle pooled connections are closed after this; keep it below the workers'"
        " own keep-alive (uvicorn: 5 s) so a POST never goes out on a closing connection.",
    )
    retry_connect_once: bool = Field(
        True, description="On connect failure before any byte was sent, try another worker once."
    )


class HealthConfig(_Section):
    interval_s: float = Field(2.0, gt=0, description="Period of GET /health on each worker;"
                              " also how long a worker's 404 for a stored reply's id is believed,"
                              " and how often an unfinished background response is asked after"
                              " (docs/clients.md).")
    timeout_s: float = Field(
        1.0, gt=0, description="Timeout of one health check, of asking the workers which one"
        " keeps a Responses reply a call names, and of asking after a background response"
        " (docs/clients.md).")
    unhealthy_after: int = Field(
        2, ge=1, description="Consecutive failed checks (or failed connects) that eject a worker;"
        " unanswered asks after a background response that end its call (docs/clients.md)."
    )
    healthy_after: int = Field(1, ge=1, description="Consecutive good checks that readmit it.")


DEFAULT_SESSION_HEADERS = (
    "x-session-id",
    "x-mars-session-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "x-litellm-session-id",
    "session-id",
    "x-session-affinity",
    "session_id",
)


DEFAULT_SUBAGENT_HEADERS = {
    "x-claude-code-agent-id": "x-claude-code-parent-agent-id",
    "thread-id": "x-codex-parent-thread-id",
}


class SessionsConfig(_Section):
    headers: tuple[str, ...] = Field(
        DEFAULT_SESSION_HEADERS, description="Headers that carry a session id; first match wins."
    )
    subagent_headers: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_SUBAGENT_HEADERS),
        description="Sub-agents of harnesses that keep their parent's session id: agent-id"
        " header → parent-agent-id header. A request carrying both is the session"
        " <session id>/agent/<agent id>, child of <session id>/agent/<parent id> when that"
        " session is live, else of <session id> (docs/clients.md). {}: off.",
    )
    parent_headers: tuple[str, ...] = Field(
        ("x-parent-session-id",),
        description="Headers that name a new session's parent session (its id, same tenant);"
        " first match wins.",
    )
    trees: bool = Field(True, description="Agent trees: children of admitted parents first, a"
                        " waiting parent's KV hold released, levels inherited. false: flat.")
    body_fields: bool = Field(
        True,
        description="Also read session_params.session_id, prompt_cache_key and user from bodies.",
    )
    chain_matching: bool = Field(
        True, description="Match id-less requests to sessions by append-only history."
    )
    final_headers: tuple[str, ...] = Field(
        ("x-session-final", "x-dynamo-session-final"),
        description="Headers whose value true marks a session's last request.",
    )
    idle_ttl_s: float = Field(
        1800.0, gt=0, description="A session unseen this long is forgotten (affinity, history)."
    )
    max_sessions: int = Field(
        100_000, ge=1, description="Most sessions remembered, and most Responses replies whose"
        " worker is remembered; the least recently seen go first."
    )

    @field_validator("headers", "final_headers", "parent_headers")
    @classmethod
    def _lower(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(h.lower() for h in v)

    @field_validator("subagent_headers")
    @classmethod
    def _lower_pairs(cls, v: dict[str, str]) -> dict[str, str]:
        return {a.lower(): p.lower() for a, p in v.items()}


class ToolsTuning(_Section):
    """``tools.tuning:`` — how tool phases are confirmed, predicted and bounded."""

    confirm_psi: float = Field(
        50.0, ge=0, le=100,
        description="With location host: CPU PSI some avg10 (%) at or above which the host's"
        " pressure confirms inferred tool phases as CPU work (cgroup throttling confirms too)."
        " Tools at twice the cores (the backlog's high mark) keep some task waiting nearly all"
        " the time; lighter pressure is other work on the host.",
    )
    confirm_cpu_percent: float = Field(
        80.0, ge=0, le=100,
        description="With location host and no PSI or cgroup stats: CPU busy (%) at or above"
        " which inferred tool phases count as CPU work.",
    )
    ema_alpha: float = Field(
        0.2, gt=0, le=1, description="Weight of the newest sample in tool wait and slowdown EMAs."
    )
    quantile: float = Field(
        0.9, gt=0, le=1, description="Quantile of recent tool durations used as the prediction."
    )
    history: int = Field(64, ge=1, description="Tool durations kept per session and per kind.")
    inferred_min_s: float = Field(
        0.5, ge=0,
        description="An inferred tool phase (the gap between a session's calls) counts in the"
        " CPU backlog only once it is this old: shorter gaps are client overhead, not tools.",
    )
    event_max_future_s: float = Field(
        5.0, ge=0, description="Explicit tool events may carry a ts this far ahead (clock skew)."
    )
    event_max_age_s: float = Field(
        3600.0, gt=0, description="Explicit tool events with an older ts are refused (400)."
    )


class ToolsConfig(_Section):
    location: Literal["host", "reported", "elsewhere"] = Field(
        "host",
        description="Where agents' tools run. host: on the probed host or cgroup (probes.cpu);"
        " reported phases count as CPU work, inferred ones (the gap between a session's calls)"
        " only while measured pressure confirms it. reported: only phases harnesses report"
        " (POST /mars/v1/sessions/{id}/events) count. elsewhere: tool CPU never holds sessions"
        " back (tools run in sandboxes on other machines).",
    )
    tuning: ToolsTuning = Field(
        ToolsTuning(),
        description="How tool phases are confirmed as CPU work, predicted and bounded.",
    )


class RedisStreamConfig(_Section):
    url: Annotated[str, AfterValidator(redis_stream_url)] = Field(
        "", description="Redis URL for the event stream sink; empty: off.")
    key: str = Field("marsproxy:events", description="Stream key events are XADDed to.")
    maxlen: int = Field(100_000, ge=1, description="Approximate cap of the stream (MAXLEN ~).")


class TelemetryConfig(_Section):
    bus_capacity: int = Field(
        65_536, ge=16, description="Events kept in the bus ring; slower readers lose the oldest."
    )
    jsonl_path: str = Field("", description="Append every event to this JSONL file; empty: off.")
    redis_stream: RedisStreamConfig = RedisStreamConfig()
    sse_keepalive_s: float = Field(
        15.0, gt=0, description="Comment line sent on idle /mars/v1/events streams."
    )
    pressure_sample_every: int = Field(
        5, ge=1, description="Publish a pressure_sample event every Nth scrape of each worker."
    )


class MarsConfig(_Section):
    """Root of the configuration."""

    server: ServerConfig = ServerConfig()
    workers: Annotated[tuple[WorkerConfig, ...], AfterValidator(unique_workers)] = Field(
        (), description="Upstream workers; `serve` needs at least one."
    )
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    sessions: SessionsConfig = SessionsConfig()
    probes: ProbesConfig = ProbesConfig()
    tools: ToolsConfig = ToolsConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    admission: AdmissionConfig = AdmissionConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    placement: PlacementConfig = PlacementConfig()
    store: StoreConfig = StoreConfig()
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    policy: str = Field(
        "mars",
        description="Named preset applied beneath the file (marsproxy/data/policies/<name>.yaml,"
        " also at configs/policies/): mars, fcfs, autellix, continuum, mars-no-admission,"
        " mars-no-priority, mars-no-retention, mars-least-loaded, mars-no-trees. Keys set in the"
        " file, env or flags win.",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_from_urls(cls, v: Any) -> Any:
        # A bare URL is the common case; accept it as shorthand for {url: ...}.
        if isinstance(v, (list, tuple)):
            return [{"url": w} if isinstance(w, str) else w for w in v]
        return v


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``MARSPROXY_A__B=v`` → ``{"a": {"b": yaml(v)}}``. ``MARSPROXY_CONFIG`` (the file) and
    ``MARSPROXY_URL`` (``marsproxy status``' proxy) are not keys."""
    tree: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name[len(ENV_PREFIX):] in ("CONFIG", "URL"):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"environment variable {name}: not valid YAML: {exc}") from exc
        _set_path(tree, path, value)
    return tree


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> MarsConfig:
    """Build the effective config: defaults < policy preset < YAML file < env < ``overrides``."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get(ENV_PREFIX + "CONFIG"):
        path = environ[ENV_PREFIX + "CONFIG"]
    data: dict[str, Any] = {}
    sources: list[str] = []
    if path is not None:
        p = Path(path)
        try:
            loaded = read_yaml_file(p)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            if isinstance(exc, yaml.reader.ReaderError) and exc.encoding != "unicode":
                raise ConfigError(f"config file {p}: not UTF-8 text (byte {exc.position}:"
                                  f" {exc.reason})") from exc
            raise ConfigError(f"config file {p}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: the top level must be a mapping")
        data = loaded
        sources.append(f"file {p}")
        retired = retired_keys(loaded, f"file {p}")
    else:
        retired = []
    env = env_overrides(environ)
    if env:
        data = _deep_merge(data, env)
        sources.append("environment " + ", ".join(k for k in environ if k.startswith(ENV_PREFIX)))
        for name in sorted(environ):
            one = env_overrides({name: environ[name]})
            retired += retired_keys(one, f"environment variable {name}", ENV_PREFIX)
    if overrides:
        data = _deep_merge(data, overrides)
        sources.append("command line")
        retired += retired_keys(overrides, "command line")
    if retired:
        raise ConfigError("configuration keys that moved or were removed:\n" + "\n".join(retired))
    # The preset is the bottom layer: whatever the file, env or flags set wins over it.
    name = data.get("policy", MarsConfig.model_fields["policy"].default)
    try:
        data = _deep_merge(policy_preset(name), data)
    except PolicyError as exc:
        raise ConfigError(f"policy: {exc} ({'; '.join(sources) or 'defaults'})") from exc
    try:
        return MarsConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "; ".join(sources) or "defaults")) from exc


def dump_config(cfg: MarsConfig) -> str:
    """The effective values as YAML (what ``marsproxy config check`` prints)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
