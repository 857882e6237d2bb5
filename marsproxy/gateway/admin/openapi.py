"""The OpenAPI 3 description of the admin API (``/mars/v1/...``), served at
``/mars/v1/openapi.json``.

Built from the same models the handlers validate with (:mod:`admin_models`), so the request
schema cannot drift; ``tests/fuzz/test_openapi.py`` checks that the paths and methods here are
exactly the admin routes the app registers, and runs schemathesis against a live proxy.
"""

from __future__ import annotations

from typing import Any

import marsproxy
from marsproxy.core.events import EVENT_TYPES
from marsproxy.gateway.admin.admin_models import MAX_FLUSH_MS, MAX_OFFSET, MAX_PAGE, ToolEventBody

_ERROR = {"$ref": "#/components/schemas/Error"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR}}}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_SESSION_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "The session id the agent sent (x-session-id, session_params.session_id,"
    " ...), or chain/<n> as shown by /mars/v1/state. Percent-encode it.",
    "schema": {"type": "string", "minLength": 1},
}

# Every operation answers 400 to a query parameter it does not take, or one given twice.
_UNKNOWN_PARAM = "; or a query parameter this endpoint does not take, or one given twice."

_TENANT = (
    "Tenant-scoped: the caller's Authorization (or x-api-key) must be the one the session's"
    " requests carried; any other key gets 404, as for an unknown id."
)


def build_openapi(*, auth: bool) -> dict[str, Any]:
    """The document; ``auth``: operator endpoints declare the bearer scheme (a token is set)."""
    operator: list[dict[str, list[str]]] = [{"adminToken": []}] if auth else []
    unauthorized = {"401": _error("The admin token is missing or wrong.")} if auth else {}
    event_body = ToolEventBody.model_json_schema()
    event_body.pop("title", None)
    paths: dict[str, Any] = {
        "/mars/v1/sessions/{id}/events": {
            "post": {
                "operationId": "postToolEvent",
                "summary": "Report a tool call starting or ending in a session.",
                "description": _TENANT,
                "parameters": [_SESSION_ID],
                "security": [],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": event_body}},
                },
                "responses": {
                    "202": _json(
                        "Accepted; the events published because of it.",
                        {
                            "type": "object",
                            "required": ["session", "accepted", "published", "tools_in_flight"],
                            "properties": {
                                "session": {"type": "string"},
                                "accepted": {"type": "string", "enum": ["tool_start", "tool_end"]},
                                "published": {"type": "array", "items": {"type": "string"}},
                                "tools_in_flight": {"type": "integer", "minimum": 0},
                            },
                        },
                    ),
                    "400": _error("Invalid event (type, field or timestamp)" + _UNKNOWN_PARAM),
                    "404": _error("No such session for this API key."),
                    "408": _error("The body did not arrive within limits.body_timeout_s."),
                    "413": _error("The body exceeds server.max_body_bytes."),
                    "429": _error("Over limits.session_events_per_s; see Retry-After."),
                },
            }
        },
        "/mars/v1/sessions/{id}": {
            "delete": {
                "operationId": "endSession",
                "summary": "End a session now (as its final turn would).",
                "description": _TENANT,
                "parameters": [_SESSION_ID],
                "security": [],
                "responses": {
                    "200": _json(
                        "Ended.",
                        {
                            "type": "object",
                            "required": ["session", "ended"],
                            "properties": {
                                "session": {"type": "string"},
                                "ended": {"type": "boolean", "const": True},
                            },
                        },
                    ),
                    "400": _error("A query parameter" + _UNKNOWN_PARAM),
                    "404": _error("No such session for this API key."),
                },
            }
        },
        "/mars/v1/state": {
            "get": {
                "operationId": "getState",
                "summary": "The state document: workers, pressure, sessions, admission.",
                "security": operator,
                "parameters": [
                    {
                        "name": "sessions",
                        "in": "query",
                        "description": "1/true/yes (any case): list sessions (a page of"
                        " them); 0/false/no: do not.",
                        "schema": {"type": "string",
                                   "enum": ["1", "true", "yes", "0", "false", "no"]},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                    },
                    {
                        "name": "offset",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET},
                    },
                ],
                "responses": {
                    "200": _json(
                        "The state (see marsproxy/telemetry/state.py for every field).",
                        {
                            "type": "object",
                            "required": [
                                "time", "version", "workers", "cpu", "tools", "sessions", "events",
                            ],
                            "properties": {
                                "time": {"type": "number"},
                                "version": {"type": "string"},
                                "workers": {"type": "array", "items": {"type": "object"}},
                                "cpu": {"type": "object"},
                                "tools": {"type": "object"},
                                "sessions": {"type": "object"},
                                "events": {"type": "object"},
                                "admission": {"type": "object"},
                                # per worker with kv_events (docs/kv-events.md)
                                "kv_index": {"type": "object"},
                            },
                        },
                    ),
                    "400": _error("A bad sessions, limit or offset" + _UNKNOWN_PARAM),
                    **unauthorized,
                },
            }
        },
        "/mars/v1/events": {
            "get": {
                "operationId": "streamEvents",
                "summary": "The live event stream (never ends by itself).",
                "security": operator,
                "parameters": [
                    {
                        "name": "format",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["sse", "ndjson"]},
                    },
                    {
                        "name": "type",
                        "in": "query",
                        "description": "Comma-separated event types: "
                        + ", ".join(sorted(EVENT_TYPES)),
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "session",
                        "in": "query",
                        "description": "Only this session's events (id without tenant).",
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "flush_ms",
                        "in": "query",
                        "description": "Gather events this long between writes (0: write each"
                        " batch at once); what a page that redraws a few times a second needs.",
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_FLUSH_MS},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "Events as they happen, with keep-alives.",
                        "content": {
                            "text/event-stream": {"schema": {"type": "string"}},
                            "application/x-ndjson": {"schema": {"type": "string"}},
                        },
                    },
                    "400": _error(
                        "Bad format, unknown event type or flush_ms out of range" + _UNKNOWN_PARAM
                    ),
                    **unauthorized,
                },
            }
        },
        "/mars/v1/openapi.json": {
            "get": {
                "operationId": "getOpenAPI",
                "summary": "This document.",
                "security": operator,
                "responses": {
                    "200": _json("The OpenAPI document.", {"type": "object"}),
                    "400": _error("A query parameter" + _UNKNOWN_PARAM),
                    **unauthorized,
                },
            }
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "marsproxy admin API",
            "version": marsproxy.__version__,
            "description": "Tool events and session ends from agents (tenant-scoped), and the"
            " operator's state and event stream. Errors are OpenAI-shaped. See"
            " docs/security.md.",
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                # the query parameter at fault; null: none in particular
                                "param": {"type": "string", "nullable": True},
                                "code": {"type": "string"},
                            },
                        }
                    },
                }
            },
        },
    }
    if auth:
        doc["components"]["securitySchemes"] = {
            "adminToken": {"type": "http", "scheme": "bearer", "description": "auth.admin_token"}
        }
    return doc
