"""Who is asking: tenant, service class, explicit session id, final flag, and the history used
for chaining.

One resolver for the whole project. The order: configured headers, then body
``session_params.session_id``, the session inside Claude Code's ``metadata.user_id``,
``prompt_cache_key``, ``user``; then a Responses request's ``previous_response_id`` and chain
matching, both the table's job (``core.sessions``), from what is read here.

Pure code: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from marsproxy.core.canon import (
    History,
    anthropic_units,
    chat_units,
    responses_units,
)

Route = Literal["chat", "completions", "responses", "messages"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _token_id(t: Any) -> bool:
    # A token id fits in 32 bits; anything else (bools, huge ints) is no history we understand.
    return type(t) is int and 0 <= t < 2**31


def tenant_of(authorization: str | None) -> str:
    """Short hash of the Authorization header, so tenants never share session ids."""
    if not authorization:
        return "anon"
    # surrogateescape: a header with bytes that are not UTF-8 still hashes (to itself).
    raw = authorization.encode("utf-8", "surrogateescape")
    return hashlib.blake2b(raw, digest_size=6).hexdigest()


CLASS_HEADER = "x-session-class"
"""The request header that names a session's service class (``admission.classes``)."""


class UnknownClass(ValueError):
    """The class header names no configured class (→ 400 unknown_session_class)."""


def session_class(
    headers: Mapping[str, str], *, order: Sequence[str], default: str,
    tenant_class: str | None = None,
) -> str:
    """The service class of a new session: the header's (case-insensitive), else the tenant's
    (``tenant_class``, from ``admission.classes.by_tenant``), else ``default``.

    ``order`` lists the classes first admitted first; a tenant's class is also the highest it
    may ask for: a header naming an earlier class gets the tenant's instead. Raises
    :class:`UnknownClass` for a name not in ``order``.
    """
    base = tenant_class if tenant_class is not None and tenant_class in order else default
    raw = (headers.get(CLASS_HEADER) or "").strip().lower()
    if not raw:
        return base
    if raw not in order:
        raise UnknownClass(f"{CLASS_HEADER}: unknown class {raw[:64]!r}; known: {', '.join(order)}")
    if tenant_class is not None and order.index(raw) < order.index(base):
        return base  # the operator's word caps the client's
    return raw


@dataclass(frozen=True)
class SubAgent:
    """A sub-agent's request in its parent's session (``sessions.subagent_headers``)."""

    agent: str
    parent: str
    """The parent agent's id (the root agent's own id is not sent by every harness)."""


def subagent_of(headers: Mapping[str, str], pairs: Mapping[str, str]) -> SubAgent | None:
    """The sub-agent a request comes from: the first (agent header, parent header) pair that
    the request carries both of; ``None`` for a root agent's request."""
    for agent_h, parent_h in pairs.items():
        agent = (headers.get(agent_h) or "").strip()
        parent = (headers.get(parent_h) or "").strip()
        if agent and parent:
            return SubAgent(agent, parent)
    return None


def subagent_id(session_id: str, agent: str) -> str:
    """The session id of ``agent`` in ``session_id``: each sub-agent is a session of its own."""
    return f"{session_id}/agent/{agent}"


def parent_session(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The parent session id a request names (``sessions.parent_headers``), or ``None``."""
    for name in names:
        value = (headers.get(name) or "").strip()
        if value:
            return value
    return None


def tree_identity(
    headers: Mapping[str, str], explicit: ExplicitId | None, *,
    subagent_headers: Mapping[str, str], parent_headers: Sequence[str],
    live: Callable[[str], bool],
) -> tuple[ExplicitId | None, str | None]:
    """A request's session id and its parent's (agent trees), both unscoped.

    A sub-agent's request (its harness keeps the parent's session id, see
    :func:`subagent_of`) is the session ``<id>/agent/<agent>``, child of
    ``<id>/agent/<parent>`` when ``live`` says that one is a live session, else of the root
    ``<id>``. Otherwise a parent header (``x-parent-session-id``) names the parent.
    """
    sub = None if explicit is None else subagent_of(headers, subagent_headers)
    if explicit is None or sub is None:
        return explicit, parent_session(headers, parent_headers)
    root = explicit.value
    parent = subagent_id(root, sub.parent)
    own = ExplicitId(subagent_id(root, sub.agent), explicit.source, explicit.name)
    return own, parent if live(parent) else root


@dataclass(frozen=True)
class ExplicitId:
    value: str
    source: Literal["header", "body"]
    name: str  # header or field it came from, for logs


def explicit_session_id(
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
    *,
    header_names: Sequence[str],
    body_fields: bool,
) -> ExplicitId | None:
    """The first session id found, in the documented order; ``None`` if there is none.

    ``headers`` should be case-insensitive (aiohttp's are); ``header_names`` are lower case.
    """
    for name in header_names:
        value = headers.get(name)
        if value and value.strip():
            return ExplicitId(value.strip(), "header", name)
    if not body_fields or body is None:
        return None
    params = body.get("session_params")
    if isinstance(params, Mapping):
        sid = params.get("session_id")
        if isinstance(sid, str) and sid:
            return ExplicitId(sid, "body", "session_params.session_id")
    sid = claude_code_session(body.get("metadata"))
    if sid is not None:
        return ExplicitId(sid, "body", "metadata.user_id")
    for fname in ("prompt_cache_key", "user"):
        value = body.get(fname)
        if isinstance(value, str) and value:
            return ExplicitId(value, "body", fname)
    return None


_LEGACY_SESSION_MARK = "_session_"


def claude_code_session(metadata: Any) -> str | None:
    """The session id Claude Code puts in an Anthropic request's ``metadata.user_id``.

    Two forms are known: a JSON object as a string (``{"device_id": ..., "account_uuid": ...,
    "session_id": ...}``) and, in older versions, ``user_<hash>_account_<id>_session_<uuid>``.
    Any other ``user_id`` names an end user, not a session, and is not used.
    """
    if not isinstance(metadata, Mapping):
        return None
    uid = metadata.get("user_id")
    if not isinstance(uid, str) or not uid:
        return None
    if uid.startswith("{"):
        try:
            obj = json.loads(uid)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the stack
            return None
        sid = obj.get("session_id") if isinstance(obj, dict) else None
        return sid if isinstance(sid, str) and sid else None
    _, mark, tail = uid.rpartition(_LEGACY_SESSION_MARK)
    return tail if mark and tail else None


class BadFinalFlag(ValueError):
    """A final header holds no value we can read as true or false (→ 400 invalid_final_flag)."""


def is_final(headers: Mapping[str, str], final_headers: Sequence[str]) -> bool:
    """Whether a final header says true. Empty is absent; a value neither true nor false raises
    :class:`BadFinalFlag` (guessing "not final" would hold the session's slot to its timeout)."""
    final = False
    for name in final_headers:
        value = (headers.get(name) or "").strip()
        if value.lower() in _TRUE:
            final = True
        elif value and value.lower() not in _FALSE:
            raise BadFinalFlag(f"{name}: {value[:64]!r} is not a boolean; send true/false, 1/0,"
                               " yes/no, on/off (any case)")
    return final


def previous_response_id(route: Route, body: Mapping[str, Any] | None) -> str | None:
    """The reply id a Responses API request continues from (``previous_response_id``), or
    ``None``. The session table knows which session's reply carried it (``core.sessions``)."""
    if route != "responses" or body is None:
        return None
    value = body.get("previous_response_id")
    return value if isinstance(value, str) and value else None


def history_of(route: Route, body: Mapping[str, Any]) -> History | None:
    """The append-only history of a request body, or ``None`` if it has none we understand."""
    try:
        return _history_of(route, body)
    except RecursionError:  # a part nested deeper than the stack: no history we understand
        return None


def _history_of(route: Route, body: Mapping[str, Any]) -> History | None:
    if route == "chat":
        messages = body.get("messages")
        return History.of_units(chat_units(messages)) if isinstance(messages, list) else None
    if route == "messages":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return History.of_units(anthropic_units(body.get("system"), messages))
    if route == "responses":
        units = responses_units(body.get("instructions"), body.get("input"))
        return History.of_units(units) if units else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return History.of_text(prompt)
    if isinstance(prompt, list) and prompt and all(_token_id(t) for t in prompt):
        return History.of_tokens(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return History.of_text(prompt[0])
    return None  # batches of prompts: no single history
