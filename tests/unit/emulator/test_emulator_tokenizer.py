"""The stand-in tokenizer: 4 bytes per token, replies re-tokenize to the ids generated."""

from __future__ import annotations

import pytest

from marsproxy.emulator.tokenizer import (
    PromptError,
    encode_chat,
    encode_text,
    filler_chunk,
    filler_text,
    filler_token_id,
    render_chat,
)


def test_four_bytes_per_token() -> None:
    assert len(encode_text("")) == 0
    assert len(encode_text("abcd")) == 1
    assert len(encode_text("abcde")) == 2
    assert len(encode_text("é" * 4)) == 2  # 8 bytes of UTF-8
    assert encode_text("abcdabcd")[0] == encode_text("abcdabcd")[1]


def test_filler_tokens_are_four_ascii_chars_and_retokenize() -> None:
    text = filler_text(0, 100)
    assert len(text) == 400 and text.isascii()
    assert encode_text(text) == [filler_token_id(i) for i in range(100)]
    assert all(len(filler_chunk(i)) == 4 for i in range(200))


def test_chat_history_with_reply_extends_the_prompt() -> None:
    turn1 = [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "hi!"}]
    ids1 = encode_chat(turn1)
    reply_ids = [filler_token_id(i) for i in range(7)]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": filler_text(0, 7)},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    ids2 = encode_chat(turn2)
    assert ids2[: len(ids1) + 7] == ids1 + reply_ids
    assert render_chat(turn2).endswith("<|im_start|>assistant\n")


def test_content_parts_equal_plain_string_and_tool_calls_count() -> None:
    plain = encode_chat([{"role": "user", "content": "hello world"}])
    parts = encode_chat(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
            }
        ]
    )
    assert plain == parts
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    with_call = encode_chat([{"role": "assistant", "content": None, "tool_calls": [call]}])
    without = encode_chat([{"role": "assistant", "content": None}])
    assert len(with_call) > len(without)


@pytest.mark.parametrize(
    "bad", [[], ["x"], [{"content": "no role"}], [{"role": "user", "content": 3}]]
)
def test_bad_messages_raise(bad: list[object]) -> None:
    with pytest.raises(PromptError):
        encode_chat(bad)
