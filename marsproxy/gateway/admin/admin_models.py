"""Request bodies and limits of the admin API, shared by its handlers and its OpenAPI document."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_PAGE = 1000  # most sessions one /mars/v1/state?sessions=1 page lists
MAX_OFFSET = 10**9  # beyond any session table: an empty page
MAX_FLUSH_MS = 5000  # longest /mars/v1/events?flush_ms= (the bus ring must hold what gathers)
# The query parameters each operator endpoint takes (any other is a 400, query.py).
STATE_QUERY = frozenset({"sessions", "limit", "offset"})
EVENTS_QUERY = frozenset({"format", "type", "session", "flush_ms"})


class ToolEventBody(BaseModel):
    """``POST /mars/v1/sessions/{id}/events``. Strict: no strings for numbers, no extras."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    type: Literal["tool_start", "tool_end"]
    tool: str = Field(min_length=1, max_length=64)
    ts: float | None = None
    queue_wait_s: float | None = Field(None, ge=0)
