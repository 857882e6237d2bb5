"""Log-probabilities in vLLM 0.32's shapes for the emulator's synthetic tokens (no I/O).

The emulator samples nothing, so the values are made up but plausible and deterministic: each
token is the most likely one at its step (a probability in [0.5, 0.95) drawn from its id), the
alternatives share the rest geometrically, so every value is ≤ 0, each list is sorted and the
probabilities of a step sum below 1. vLLM's engine returns, per step, the sampled token then the
top ``N``; with the sampled token the most likely, that is ``max(N, 1)`` distinct tokens. Chat
shows the first ``top_logprobs`` of them, completions all (``i <= N``: at least the sampled one).
Prompt tokens (a completions ``echo``, a request's ``prompt_logprobs``) are scored the same way,
except the first (vLLM: null).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from marsproxy.emulator.tokenizer import (
    BYTES_PER_TOKEN,
    FILLER_TEXT,
    chat_segments,
    chunk_id,
    encode_text,
    filler_chunk,
    filler_token_id,
)

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
_ALT_STRIDE = 7  # alternatives are other filler pieces, this far apart in the cycle
_FILLER_PIECES = len(FILLER_TEXT) // BYTES_PER_TOKEN  # 58 distinct pieces

# A token as logprobs report it: (text, id).
Token = tuple[str, int]


def output_tokens(start: int, count: int) -> list[Token]:
    """The generated tokens ``start`` .. ``start + count - 1`` (the filler's pieces)."""
    return [(filler_chunk(i), filler_token_id(i)) for i in range(start, start + count)]


def prompt_tokens(ids: Sequence[int], text: str | None) -> list[Token]:
    """A prompt's tokens: a text prompt's 4-byte pieces (a cut character decodes to U+FFFD, as
    a byte-level tokenizer's piece does); a token-id prompt has no text here (it echoes none)."""
    if text is None:
        return [("", tok) for tok in ids]
    data = text.encode("utf-8", "surrogatepass")
    pieces = [data[i : i + BYTES_PER_TOKEN].decode("utf-8", "replace")
              for i in range(0, len(data), BYTES_PER_TOKEN)]
    return list(zip(pieces, ids, strict=True))


def chat_prompt_tokens(messages: Sequence[Any]) -> list[Token]:
    """A chat prompt's tokens as :func:`~marsproxy.emulator.tokenizer.encode_chat` counts
    them: its special tokens by name, its text in pieces."""
    out: list[Token] = []
    for seg, special in chat_segments(messages):
        out += [(seg, special)] if special is not None else prompt_tokens(encode_text(seg), seg)
    return out


def ranked(token: Token, count: int) -> list[tuple[str, int, float]]:
    """``token`` and ``count - 1`` distinct alternatives (filler pieces picked by its id), most
    likely first: (text, id, logprob)."""
    text, tok = token
    p0 = 0.5 + 0.45 * ((tok * 2654435761) % 1000) / 1000
    out = [(text, tok, math.log(p0))]
    seen = {text}
    for j in range(1, _FILLER_PIECES + 1):  # the stride is prime to the cycle: all visited
        if len(out) == count:
            break
        alt = filler_chunk(tok + j * _ALT_STRIDE)
        if alt not in seen:
            seen.add(alt)
            out.append((alt, chunk_id(alt.encode()), math.log((1 - p0) * 0.5 ** len(out))))
    return out


def chat_logprobs(tokens: Sequence[Token], top: int) -> dict[str, Any]:
    """Chat's ``logprobs`` (``ChatCompletionLogProbs``): each token with its ``top`` most
    likely (``top_logprobs``)."""
    content = []
    for tok in tokens:
        best = ranked(tok, max(top, 1))
        content.append({
            "token": tok[0], "logprob": best[0][2], "bytes": list(tok[0].encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                             for t, _, lp in best[:top]],
        })
    return {"content": content}


def completion_logprobs(
    tokens: Sequence[Token], top: int, offset: int = 0, unscored: int = 0
) -> dict[str, Any]:
    """Completions' ``logprobs`` (``CompletionLogProbs``): ``text_offset`` from ``offset`` by
    each token's length; the first ``unscored`` tokens (an echoed prompt's first) are null."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                           "top_logprobs": []}
    for i, tok in enumerate(tokens):
        out["text_offset"].append(offset)
        offset += len(tok[0])
        out["tokens"].append(tok[0])
        if i < unscored:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        best = ranked(tok, max(top, 1))
        out["token_logprobs"].append(best[0][2])
        out["top_logprobs"].append({t: lp for t, _, lp in best})
    return out


def prompt_logprobs(tokens: Sequence[Token], top: int) -> list[dict[str, Any] | None]:
    """A completions choice's ``prompt_logprobs`` (an ``echo`` with ``logprobs``): per prompt
    token after the first, ``{id: {logprob, rank, decoded_token}}``, the token's own first."""
    out: list[dict[str, Any] | None] = [None] if tokens else []
    for tok in tokens[1:]:
        out.append({str(t_id): {"logprob": lp, "rank": rank, "decoded_token": t}
                    for rank, (t, t_id, lp) in enumerate(ranked(tok, max(top, 1)), 1)})
    return out


@dataclass(frozen=True)
class ChoiceLogprobs:
    """The ``logprobs`` of one choice: ``top`` per token (the request's number); ``prompt``, a
    completions ``echo``'s prompt tokens, listed before the output's where the text shows the
    prompt (alone with ``prompt_only``: a prompt scoring, ``max_tokens: 0``)."""

    kind: str
    top: int
    prompt: tuple[Token, ...] = ()
    prompt_only: bool = False
    prompt_chars: int = field(init=False)  # the echoed text's length: where output starts

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_chars", sum(len(t) for t, _ in self.prompt))

    def of(self, start: int, count: int, shows_prompt: bool = False) -> dict[str, Any]:
        """Of the output tokens ``start`` .. ``start + count - 1`` (a choice, or a stream's
        chunk; ``shows_prompt``: the one with the echoed prompt)."""
        out = [] if self.prompt_only else output_tokens(start, count)
        if self.kind == "chat":
            return chat_logprobs(out, self.top)
        if shows_prompt:
            return completion_logprobs(
                [*self.prompt, *out], self.top, 0, unscored=1 if self.prompt else 0)
        # the filler's tokens are 4 ASCII characters each
        return completion_logprobs(out, self.top, self.prompt_chars + BYTES_PER_TOKEN * start)


def too_many(requested: int, what: str = "sample") -> str:
    """vLLM's words for ``logprobs`` (or chat's ``top_logprobs``; ``what`` "prompt": the
    request's ``prompt_logprobs``) over ``--max-logprobs``."""
    return (f"Requested {what} logprobs of {requested}, which is greater than max allowed:"
            f" {MAX_LOGPROBS}")
