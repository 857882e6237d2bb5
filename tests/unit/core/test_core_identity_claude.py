"""Claude Code's session id inside an Anthropic request's ``metadata.user_id``."""

import json
from typing import Any

from multidict import CIMultiDict

from marsproxy.config import DEFAULT_SESSION_HEADERS
from marsproxy.core.identity import ExplicitId, claude_code_session, explicit_session_id

SID = "54c1eb09-bc4c-4d2f-98eb-6d2ab2d5e2fe"


def _resolve(headers: dict[str, str], body: dict[str, Any]) -> ExplicitId | None:
    return explicit_session_id(
        CIMultiDict(headers), body, header_names=DEFAULT_SESSION_HEADERS, body_fields=True
    )


def test_both_known_forms() -> None:
    as_json = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SID})
    assert claude_code_session({"user_id": as_json}) == SID
    legacy = f"user_{'a' * 64}_account__session_{SID}"
    assert claude_code_session({"user_id": legacy}) == SID


def test_a_plain_end_user_id_is_no_session() -> None:
    for junk in ({"user_id": "alice"}, {"user_id": "{not json"}, {"user_id": '{"a": 1}'},
                 {"user_id": '["x"]'}, {"user_id": "x_session_"}, {"user_id": 5}, {}, "x", None):
        assert claude_code_session(junk) is None


def test_order_header_then_session_params_then_metadata_then_prompt_cache_key() -> None:
    body: dict[str, Any] = {
        "session_params": {"session_id": "sp"},
        "metadata": {"user_id": json.dumps({"session_id": SID})},
        "prompt_cache_key": "pck",
    }
    assert _resolve({"x-claude-code-session-id": "h"}, body) == ExplicitId(
        "h", "header", "x-claude-code-session-id")
    assert _resolve({}, body) == ExplicitId("sp", "body", "session_params.session_id")
    del body["session_params"]
    assert _resolve({}, body) == ExplicitId(SID, "body", "metadata.user_id")
    body["metadata"] = {"user_id": "alice"}
    assert _resolve({}, body) == ExplicitId("pck", "body", "prompt_cache_key")
