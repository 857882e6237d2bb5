from collections.abc import Mapping
from typing import Any

import pytest
from multidict import CIMultiDict

from marsproxy.config import DEFAULT_SESSION_HEADERS
from marsproxy.core.identity import (
    BadFinalFlag,
    ExplicitId,
    UnknownClass,
    explicit_session_id,
    history_of,
    is_final,
    session_class,
    tenant_of,
)


def _resolve(
    headers: dict[str, str], body: Mapping[str, Any] | None, body_fields: bool = True
) -> ExplicitId | None:
    return explicit_session_id(
        CIMultiDict(headers), body, header_names=DEFAULT_SESSION_HEADERS, body_fields=body_fields
    )


def test_every_configured_header_is_a_source() -> None:
    for name in DEFAULT_SESSION_HEADERS:
        got = _resolve({name.upper(): "abc"}, None)
        assert got is not None and got.value == "abc" and got.name == name


def test_first_header_in_configured_order_wins() -> None:
    got = _resolve({"x-litellm-session-id": "late", "x-session-id": "early"}, None)
    assert got is not None and got.value == "early"


def test_header_beats_body() -> None:
    got = _resolve({"x-session-id": "h"}, {"prompt_cache_key": "b", "user": "u"})
    assert got is not None and (got.value, got.source) == ("h", "header")


def test_body_order_session_params_then_prompt_cache_key_then_user() -> None:
    body: dict[str, Any] = {
        "session_params": {"session_id": "sp"},
        "prompt_cache_key": "pck",
        "user": "u",
    }
    assert _resolve({}, body) == ExplicitId("sp", "body", "session_params.session_id")
    del body["session_params"]
    assert _resolve({}, body) == ExplicitId("pck", "body", "prompt_cache_key")
    del body["prompt_cache_key"]
    got = _resolve({}, body)
    assert got is not None and (got.value, got.source, got.name) == ("u", "body", "user")


def test_body_fields_can_be_switched_off_and_junk_is_ignored() -> None:
    assert _resolve({}, {"user": "u"}, body_fields=False) is None
    assert _resolve({"x-session-id": "  "}, {"user": 5, "session_params": "x"}) is None


def test_tenant_is_a_short_hash_of_authorization() -> None:
    a, b = tenant_of("Bearer key-a"), tenant_of("Bearer key-b")
    assert a != b and a == tenant_of("Bearer key-a") and "key" not in a
    assert tenant_of(None) == tenant_of("") == "anon"


def test_final_flag() -> None:
    names = ("x-session-final", "x-dynamo-session-final")
    assert is_final(CIMultiDict({"X-Session-Final": "true"}), names)
    assert is_final(CIMultiDict({"x-dynamo-session-final": "1"}), names)
    assert not is_final(CIMultiDict({"x-session-final": "false"}), names)
    assert not is_final(CIMultiDict(), names)
    for yes in ("TRUE", " yes ", "On", "1"):
        assert is_final(CIMultiDict({"x-session-final": yes}), names)
    for no in ("False", "0", "NO", "off", "", "  "):  # empty: as if absent
        assert not is_final(CIMultiDict({"x-session-final": no}), names)


@pytest.mark.parametrize("value", ["maybe", "2", "truee", "y"])
def test_an_unrecognised_final_flag_is_an_error_naming_the_header(value: str) -> None:
    names = ("x-session-final", "x-dynamo-session-final")
    with pytest.raises(BadFinalFlag) as exc:
        # Even beside a header that says true: a value we cannot read is never guessed.
        is_final(CIMultiDict({"x-session-final": "true", "x-dynamo-session-final": value}), names)
    assert "x-dynamo-session-final" in str(exc.value) and repr(value) in str(exc.value)
    assert "true/false, 1/0, yes/no, on/off" in str(exc.value)


def test_chat_history_ignores_what_clients_rewrite() -> None:
    a = history_of(
        "chat",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                        }
                    ],
                },
            ]
        },
    )
    b = history_of(
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "other-id",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"cmd":"ls"}'},
                        }
                    ],
                },
            ]
        },
    )
    assert a is not None and b is not None
    assert a.prefix_hash(2) == b.prefix_hash(2)


def test_messages_history_includes_system_and_responses_instructions() -> None:
    m1 = history_of("messages", {"system": "S1", "messages": [{"role": "user", "content": "q"}]})
    m2 = history_of("messages", {"system": "S2", "messages": [{"role": "user", "content": "q"}]})
    assert m1 is not None and m2 is not None and m1.length == 2
    assert m1.prefix_hash(2) != m2.prefix_hash(2)
    r = history_of("responses", {"instructions": "I", "input": "q"})
    assert r is not None and r.length == 2


def test_completion_prompts() -> None:
    t = history_of("completions", {"prompt": "abc"})
    assert t is not None and (t.kind, t.length) == ("text", 3)
    k = history_of("completions", {"prompt": [1, 2, 3]})
    assert k is not None and (k.kind, k.length) == ("tokens", 3)
    assert history_of("completions", {"prompt": ["a", "b"]}) is None


# -- service classes -------------------------------------------------------------------------

def test_session_class_from_header_tenant_or_default() -> None:
    order = ("interactive", "batch")
    assert session_class({}, order=order, default="interactive") == "interactive"
    assert session_class({"x-session-class": " Batch "}, order=order,
                         default="interactive") == "batch"
    assert session_class({}, order=order, default="interactive", tenant_class="batch") == "batch"
    # A tenant's class is also the highest it may ask for; lower ones it may pick.
    assert session_class({"x-session-class": "interactive"}, order=order, default="interactive",
                         tenant_class="batch") == "batch"
    assert session_class({"x-session-class": "batch"}, order=order, default="interactive",
                         tenant_class="interactive") == "batch"


def test_an_unknown_session_class_is_an_error() -> None:
    with pytest.raises(UnknownClass, match="unknown class 'gold'"):
        session_class({"x-session-class": "gold"}, order=("interactive",), default="interactive")
