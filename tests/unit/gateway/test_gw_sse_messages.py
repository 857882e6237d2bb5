"""Usage and replies of the Anthropic Messages route, read from real vLLM 0.32 bytes
(``tests/fixtures/vllm-0.32-messages*``, captured with ``--enable-prompt-tokens-details``)."""

import json
from pathlib import Path

from marsproxy.gateway.http.sse import SSEFilter, StreamTap, Usage, read_body

FIXTURES = Path(__file__).parents[2] / "fixtures"


def test_anthropic_usage_adds_the_cache_split_back_into_the_prompt() -> None:
    # vLLM's input_tokens is the prompt minus what was read from and written to the cache.
    u = Usage.of({"input_tokens": 15, "output_tokens": 5, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 288})
    assert u == Usage(prompt_tokens=303, completion_tokens=5, cached_tokens=288)
    u = Usage.of({"input_tokens": 15, "output_tokens": 5, "cache_creation_input_tokens": 288,
                  "cache_read_input_tokens": 0})
    assert u == Usage(prompt_tokens=303, completion_tokens=5, cached_tokens=0)
    # Without --enable-prompt-tokens-details vLLM sends no cache keys: input_tokens is the prompt.
    assert Usage.of({"input_tokens": 303, "output_tokens": 5}) == Usage(303, 5, 0)
    # The responses API counts cached tokens inside input_tokens: nothing is added.
    assert Usage.of({"input_tokens": 40, "output_tokens": 2,
                     "input_tokens_details": {"cached_tokens": 32}}) == Usage(40, 2, 32)


def test_non_streaming_fixture() -> None:
    body = (FIXTURES / "vllm-0.32-messages.json").read_bytes()
    usage, reply, _, _ = read_body("messages", body, capture=True)
    assert usage == Usage(prompt_tokens=303, completion_tokens=5, cached_tokens=0)
    assert reply is not None and len(reply.units) == 1


def test_streaming_fixture_any_chunking() -> None:
    raw = (FIXTURES / "vllm-0.32-messages-stream.txt").read_bytes()
    for size in (1, 7, 64, len(raw)):
        tap = StreamTap("messages", strip_usage_chunk=False, capture=True)
        flt = SSEFilter(tap)
        out = b"".join(flt.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        out += flt.flush()
        assert out == raw  # nothing dropped or changed on this route
        assert tap.usage == Usage(prompt_tokens=303, completion_tokens=5, cached_tokens=288)
        assert not tap.saw_error
        reply = tap.reply()
        assert reply is not None
        unit = json.loads(reply.units[0])
        text = "".join(
            json.loads(line[6:])["delta"]["text"]
            for line in raw.decode().splitlines()
            if line.startswith("data: ") and '"text_delta"' in line
        )
        assert text in json.dumps(unit, ensure_ascii=False) or text.encode() in reply.units[0]


def test_message_start_alone_counts_the_whole_prompt() -> None:
    # A stream cut after message_start still knows the prompt's size.
    tap = StreamTap("messages", strip_usage_chunk=False, capture=False)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 303,
                                                            "output_tokens": 0}}}
    tap.keep(f"event: message_start\ndata: {json.dumps(start)}\n\n".encode())
    assert tap.usage == Usage(303, 0, 0)
