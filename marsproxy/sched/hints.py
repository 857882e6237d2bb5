"""Hints sent upstream with each continuation, by a named encoder.

An encoder writes the session id, the level (``las``) and the retention the proxy intends into the
outgoing request's headers and/or JSON body. Hints must never break a worker that does not
understand them, so encoders only add headers or namespaced body keys, and leave a body part
of an unexpected shape alone. Adding an encoder is one function and one entry in
:func:`encoders`.

Also here: the vLLM body ``priority`` for workers run with ``--scheduling-policy priority``.

Pure code: mutates the dicts it is given, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from marsproxy.sched.priority import LOWEST

# (session_id, level, retain_s, headers, body) -> None; mutates headers and body in place.
# level None: no priority hint (a policy without levels: session_fcfs or off).
Encoder = Callable[[str, int | None, float | None, dict[str, str], dict[str, Any]], None]

SESSION_HEADER = "x-mars-session-id"
PRIORITY_HEADER = "x-mars-priority"
RETAIN_HEADER = "x-mars-kv-retain-seconds"


def _seconds(value: float) -> str:
    # Compact and locale-free: "2", "1.5", "0.001"; never exponent noise for ordinary TTLs.
    return f"{value:.3f}".rstrip("0").rstrip(".") or "0"


def encode_headers(
    session_id: str, level: int | None, retain_s: float | None, headers: dict[str, str],
    body: dict[str, Any],
) -> None:
    """``x-mars-*`` headers; the level in MARS polarity (0 runs first). Body untouched."""
    headers[SESSION_HEADER] = session_id
    if level is not None:
        headers[PRIORITY_HEADER] = str(level)
    if retain_s is not None:
        headers[RETAIN_HEADER] = _seconds(max(0.0, retain_s))


def dynamo_priority(level: int) -> int:
    """Dynamo's polarity is the reverse of vLLM's: higher values run earlier."""
    return LOWEST - min(LOWEST, max(0, level))


def encode_dynamo(
    session_id: str, level: int | None, retain_s: float | None, headers: dict[str, str],
    body: dict[str, Any],
) -> None:
    """``nvext.agent_hints`` with ``priority`` (Dynamo polarity) and the retention seconds.

    Merged into what the client sent: its other ``nvext`` keys and hints stay. The session id
    is not a hint in Dynamo's schema, so it goes in the ``x-mars-session-id`` header.
    """
    headers[SESSION_HEADER] = session_id
    nvext = body.setdefault("nvext", {})
    if not isinstance(nvext, dict):
        return  # a client's own odd 'nvext' wins; a hint is not worth breaking its request
    hints = nvext.setdefault("agent_hints", {})
    if not isinstance(hints, dict):
        return
    if level is not None:
        hints["priority"] = dynamo_priority(level)
    if retain_s is not None:
        hints["kv_retain_seconds"] = max(0.0, retain_s)


def encode_none(
    session_id: str, level: int | None, retain_s: float | None, headers: dict[str, str],
    body: dict[str, Any],
) -> None:
    """Sends nothing: the worker sees the client's request as is."""


def encoders() -> Mapping[str, Encoder]:
    """The registry, by config name (a function, not a module global, so it cannot be mutated
    from elsewhere)."""
    return {"headers": encode_headers, "dynamo": encode_dynamo, "none": encode_none}


def encode(
    name: str, session_id: str, level: int | None, retain_s: float | None, headers: dict[str, str],
    body: dict[str, Any],
) -> None:
    """Applies the encoder called ``name``; an unknown name is a configuration error."""
    try:
        encoder = encoders()[name]
    except KeyError:
        known = ", ".join(sorted(encoders()))
        raise ValueError(f"unknown hint encoder {name!r}; known: {known}") from None
    encoder(session_id, level, retain_s, headers, body)


def apply_vllm_priority(body: dict[str, Any], level: int, override_client: bool) -> int:
    """Sets vLLM's body ``priority`` (lower runs first, the level as is); returns what is sent.

    A client's own integer ``priority`` is kept when ``override_client`` is false; a
    non-integer one is replaced, as it is no valid vLLM priority.
    """
    client = body.get("priority")
    if isinstance(client, int) and not isinstance(client, bool) and not override_client:
        return client
    body["priority"] = level
    return level
