"""The emulator's synthetic logprobs: vLLM 0.32's shapes, plausible values, stream = whole."""

from __future__ import annotations

import math

import pytest

from marsproxy.emulator.logprobs import (
    MAX_LOGPROBS,
    ChoiceLogprobs,
    output_tokens,
    prompt_tokens,
    ranked,
)
from marsproxy.emulator.openai_api import ApiError
from marsproxy.emulator.openai_request import parse_request
from marsproxy.emulator.tokenizer import encode_text, filler_text


@pytest.mark.parametrize("count", [1, 2, 5, MAX_LOGPROBS])
def test_ranked_tokens_are_distinct_sorted_and_sum_below_one(count: int) -> None:
    for token in [*output_tokens(0, 60), ("ü€", 7), ("", 0)]:
        best = ranked(token, count)
        assert len(best) == count and best[0][:2] == token
        values = [lp for _, _, lp in best]
        assert values == sorted(values, reverse=True) and values[0] < 0
        assert len({t for t, _, _ in best}) == count
        assert sum(math.exp(v) for v in values) < 1


def test_a_stream_chunk_by_chunk_equals_the_whole() -> None:
    # vLLM's text_offset goes on across chunks; an echo's first chunk lists the prompt first.
    text = "abc€ héllo"  # "€" is cut by the 4-byte pieces
    pieces = prompt_tokens(encode_text(text), text)
    assert len(pieces) == len(encode_text(text)) and "\ufffd" in "".join(t for t, _ in pieces)
    for prompt in ((), tuple(pieces)):
        lp = ChoiceLogprobs("completion", 2, prompt)
        whole = lp.of(0, 5, shows_prompt=True)
        chunks = [lp.of(i, 1, shows_prompt=i == 0) for i in range(5)]
        assert {k: [v for c in chunks for v in c[k]] for k in whole} == whole
        assert whole["tokens"][len(prompt):] == [filler_text(i, 1) for i in range(5)]
        offsets, tokens = whole["text_offset"], whole["tokens"]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    chat = ChoiceLogprobs("chat", 3)
    assert chat.of(0, 4)["content"] == [e for i in range(4) for e in chat.of(i, 1)["content"]]


def test_engine_refusals_come_last_and_wait_for_the_stream() -> None:
    body = {"prompt": [5, 999_999], "max_tokens": 2}
    with pytest.raises(ApiError, match="Token id 999999 is out of vocabulary"):
        parse_request("completion", body, "m")
    with pytest.raises(ApiError, match="temperature"):  # a sampling check answers first
        parse_request("completion", {**body, "temperature": 5}, "m")
    parsed = parse_request("completion", {**body, "stream": True, "logprobs": -1}, "m")
    assert parsed.engine_error is not None and parsed.engine_error.param == "logprobs"
    assert "logprobs of 151936" in parsed.engine_error.message  # -1: the whole vocabulary
