"""Configuration of authentication (``auth:``) and of the caps on what clients may send
(``limits:``). The body cap is ``server.max_body_bytes`` and the queue cap
``admission.queue_max``; both predate this section and keep their names. docs/security.md
lists every cap with the status it answers.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from marsproxy.config_section import Section as _Section


class AuthConfig(_Section):
    """``auth:`` — the operator token of the admin API."""

    admin_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token the operator endpoints (/mars/v1/state, /mars/v1/events,"
        " /mars/v1/openapi.json) require; empty: they are open. It also opens the workers'"
        " routes beyond the inference API (docs/security.md). Prefer the environment"
        " (MARSPROXY_AUTH__ADMIN_TOKEN) to a file.",
    )
    protect_metrics: bool = Field(
        False, description="Also require the admin token on GET /metrics."
    )
    passthrough_routes: tuple[str, ...] = Field(
        (),
        description="Paths relayed to the workers for any client, beyond the inference API"
        " relayed by default (docs/security.md lists it): an exact path, or a prefix ending in"
        " `*` (`/*` relays every path). Anything else gets 404, or 403 for a known operator"
        " route of vLLM, unless the caller sends the admin token.",
    )

    @field_validator("passthrough_routes")
    @classmethod
    def _paths(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for entry in v:
            if not entry.startswith("/"):
                raise ValueError(f"{entry!r}: a route starts with '/'")
        return v


class LimitsConfig(_Section):
    """``limits:`` — caps on connections, headers, sessions, tool events and slow clients."""

    max_header_bytes: int = Field(
        32 * 1024, ge=1024,
        description="Largest request head (request line and all headers); larger gets 431.",
    )
    max_header_count: int = Field(
        128, ge=8, description="Most header lines in one request; more gets 431."
    )
    max_connections: int = Field(
        10_000, ge=1,
        description="Most client connections open at once; one more gets 429 and is closed.",
    )
    max_sessions_per_tenant: int = Field(
        10_000, ge=1,
        description="Most sessions one API key (tenant) may hold; a request that would start"
        " another forgets the key's least recently seen session with nothing in flight, or gets"
        " 429 if each has a request in flight.",
    )
    max_session_id_chars: int = Field(
        256, ge=1,
        description="Longest session id (header or body); longer, or one with control"
        " characters, gets 400.",
    )
    session_events_per_s: float = Field(
        20.0, gt=0,
        description="Tool events (POST /mars/v1/sessions/{id}/events) per second one session"
        " may post, on average; faster gets 429 with Retry-After.",
    )
    session_events_burst: int = Field(
        40, ge=1, description="Tool events one session may post at once before the rate applies."
    )
    header_timeout_s: float = Field(
        30.0, gt=0,
        description="Longest wait for a complete request head, from connect or from the end of"
        " the previous response (also the idle keep-alive time); then the connection is closed.",
    )
    body_timeout_s: float = Field(
        60.0, gt=0,
        description="Longest time to receive a request body once its head arrived; then 408.",
    )
