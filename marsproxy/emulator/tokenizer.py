"""Deterministic stand-in tokenizer for the emulated engine.

Real tokenizers are slow to load and differ per model; the emulator only needs token *counts* and
token ids that repeat exactly when text repeats, so that append-only agent histories hit the
prefix cache like they would on vLLM. Text is cut into 4-byte UTF-8 chunks; a chunk's id is its
CRC-32 modulo the vocabulary. Chat prompts are cut per segment (special marker, role header,
content), the way a real tokenizer never merges across special tokens: a reply that comes back
as history then re-tokenizes to exactly the token ids the engine generated.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

VOCAB_SIZE = 151_936
BYTES_PER_TOKEN = 4
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Special markers get fixed ids at the top of the vocabulary, outside the CRC range used below.
_SPECIAL_IDS = MappingProxyType({IM_START: VOCAB_SIZE - 2, IM_END: VOCAB_SIZE - 1})
_TEXT_VOCAB = VOCAB_SIZE - len(_SPECIAL_IDS)

# Output filler: 4 ASCII characters per token; the length is a multiple of 4 so slices cycle.
FILLER_TEXT = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. "
)
_FILLER_LEN = len(FILLER_TEXT) - len(FILLER_TEXT) % BYTES_PER_TOKEN


class PromptError(ValueError):
    """The request body cannot be turned into a prompt (answered with 400)."""


def chunk_id(chunk: bytes) -> int:
    """Token id of one chunk of at most 4 bytes."""
    return zlib.crc32(chunk) % _TEXT_VOCAB


def encode_text(text: str) -> list[int]:
    """Token ids of plain text: one id per 4 bytes of UTF-8 (the last chunk may be shorter)."""
    data = text.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates ("\ud800")
    return [chunk_id(data[i : i + BYTES_PER_TOKEN]) for i in range(0, len(data), BYTES_PER_TOKEN)]


def filler_chunk(index: int) -> str:
    """Text of output token number ``index`` (4 ASCII characters)."""
    start = (index * BYTES_PER_TOKEN) % _FILLER_LEN
    return FILLER_TEXT[start : start + BYTES_PER_TOKEN]


# The filler cycles every _FILLER_LEN / 4 tokens; the engine asks for an id per generated token.
_FILLER_IDS = tuple(
    chunk_id(FILLER_TEXT[i : i + BYTES_PER_TOKEN].encode("ascii"))
    for i in range(0, _FILLER_LEN, BYTES_PER_TOKEN)
)


def filler_token_id(index: int) -> int:
    """Token id of output token number ``index``; equals ``encode_text(filler_chunk(index))[0]``."""
    return _FILLER_IDS[index % len(_FILLER_IDS)]


def filler_text(start: int, count: int) -> str:
    """Text of output tokens ``start`` .. ``start + count - 1``."""
    return "".join(filler_chunk(i) for i in range(start, start + count))


def _content_text(content: Any) -> str:
    """Message content as text: a string, a list of ``{type: text, text}`` parts, or null."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                raise PromptError("content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise PromptError("a text content part needs a string 'text'")
                parts.append(text)
            # Non-text parts (images, audio) have no meaning for the emulator; skip them.
        return "".join(parts)
    raise PromptError("message content must be a string, a list of parts or null")


def _segments(messages: Sequence[Any]) -> Iterable[str]:
    """Template segments of a ChatML-like rendering, each tokenized on its own."""
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise PromptError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise PromptError("each message needs a string 'role'")
        yield IM_START
        yield f"{role}\n"
        yield _content_text(msg.get("content"))
        tool_calls = msg.get("tool_calls")
        if tool_calls:
            yield json.dumps(tool_calls, sort_keys=True, separators=(",", ":"))
        yield IM_END
        yield "\n"
    yield IM_START
    yield "assistant\n"


def render_chat(messages: Sequence[Any]) -> str:
    """The prompt text a ChatML template would produce (for /tokenize and debugging)."""
    return "".join(_segments(messages))


def encode_chat(messages: Sequence[Any]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant generation header."""
    if not messages:
        raise PromptError("messages must be a non-empty list")
    ids: list[int] = []
    for seg, special in chat_segments(messages):
        if special is not None:
            ids.append(special)
        else:
            ids.extend(encode_text(seg))
    return ids


def chat_segments(messages: Sequence[Any]) -> list[tuple[str, int | None]]:
    """The segments :func:`encode_chat` tokenizes, each with its special token's id (``None``:
    text, encoded by :func:`encode_text`)."""
    return [(seg, _SPECIAL_IDS.get(seg)) for seg in _segments(messages)]


def validate_token_ids(ids: Sequence[Any]) -> list[int]:
    """A completions prompt given as token ids: integers inside the vocabulary."""
    out: list[int] = []
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < VOCAB_SIZE:
            raise PromptError(f"token ids must be integers in [0, {VOCAB_SIZE})")
        out.append(tok)
    return out
