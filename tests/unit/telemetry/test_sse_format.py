"""Wire forms and filters of the live event stream (pure)."""

from __future__ import annotations

import json

import pytest

from marsproxy.core.events import LlmEnd, SessionEnd, ToolStart
from marsproxy.gateway.shells.sessions import unscoped_id
from marsproxy.telemetry.sse import FilterError, encode, event_filter, parse_types


def test_sse_and_ndjson_encoding() -> None:
    evs = [ToolStart(ts=1.5, session="t/id/a", tool="pytest"), LlmEnd(ts=2.0, status=502)]
    sse = encode(evs, "sse").decode()
    blocks = sse.split("\n\n")
    assert blocks[0].startswith("event: tool_start\ndata: ")
    assert json.loads(blocks[0].split("data: ", 1)[1])["tool"] == "pytest"
    assert blocks[1].startswith("event: llm_end\n") and blocks[2] == ""
    lines = encode(evs, "ndjson").decode().splitlines()
    assert [json.loads(x)["type"] for x in lines] == ["tool_start", "llm_end"]


def test_type_filter_rejects_unknown_names() -> None:
    assert parse_types(None) is None and parse_types(" ") is None
    assert parse_types("llm_end, tool_start") == frozenset({"llm_end", "tool_start"})
    with pytest.raises(FilterError) as exc:
        parse_types("llm_end,nope")
    assert exc.value.param == "type" and "nope" in str(exc.value)


def test_filters_by_type_and_unscoped_session() -> None:
    assert event_filter(None, None, unscoped_id) is None
    accept = event_filter(frozenset({"session_end"}), "a", unscoped_id)
    assert accept is not None
    assert accept(SessionEnd(ts=0, session="abc123/id/a"))
    assert not accept(SessionEnd(ts=0, session="abc123/id/ab"))
    assert not accept(LlmEnd(ts=0, session="abc123/id/a"))
    assert not accept(SessionEnd(ts=0))
    chain = event_filter(None, "chain/4", unscoped_id)
    assert chain is not None and chain(LlmEnd(ts=0, session="t/chain/4"))
