"""KV-fit: how many blocks a session needs, and how many a worker can still promise.

vLLM's usage gauge does not count blocks the proxy has promised but the worker has not yet
filled (admitted sessions whose prompts are still on their way, retained dormant prefixes), so
admission checks an explicit budget instead: free blocks minus a reserve minus those promises.

Prompt sizes are estimated from characters until the worker tells the truth: after each call
the session's real ``usage.prompt_tokens`` corrects its estimate. Agent prompts are append-only
and the tokenizer's characters-per-token is stable within a session, so the ratio of the last
call carries over to the next.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """KV blocks that ``tokens`` tokens occupy (a partly filled block is a whole block)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(0, math.ceil(tokens / block_size))


def reprefill_seconds(context_tokens: int, prefill_tokens_per_s: float | None) -> float | None:
    """Time to prefill the context again; None without a measured throughput."""
    if prefill_tokens_per_s is None or prefill_tokens_per_s <= 0:
        return None
    return max(0, context_tokens) / prefill_tokens_per_s


def free_blocks_from_usage(kv_usage: float | None, total_blocks: int | None) -> int | None:
    """Free blocks from vLLM's usage gauge and ``num_gpu_blocks`` (vLLM exports no free count).

    Rounded down, so the estimate never promises a block the worker may not have.
    """
    if kv_usage is None or total_blocks is None:
        return None
    return max(0, math.floor((1.0 - min(1.0, max(0.0, kv_usage))) * total_blocks + 1e-9))


def kv_budget(
    free_blocks: int, total_blocks: int, reserve_frac: float, retained_blocks: int = 0
) -> int:
    """Blocks a new session may use: free − reserve_frac·total − retained (may be negative)."""
    return free_blocks - math.ceil(reserve_frac * total_blocks) - retained_blocks


def fits(blocks: int, budget: int | None) -> bool:
    """Whether ``blocks`` fit ``budget``; ``None`` (a worker without block counts) always fits."""
    return budget is None or blocks <= budget


class PromptEstimator:
    """Prompt-token estimates per session, corrected by the usage each call reports.

    A session not seen yet is estimated at the tokens per character of the latest sessions'
    first prompts (``history`` of them): a tokenizer that counts more tokens per character
    than ``chars_per_token`` says would otherwise make every new session look smaller than it
    is, and with clients whose every call is a new session no call would ever correct it."""

    def __init__(self, chars_per_token: float, history: int) -> None:
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        if history < 1:
            raise ValueError(f"history must be ≥ 1, got {history}")
        self.chars_per_token = chars_per_token
        self._correction: dict[str, float] = {}  # session → real tokens / raw estimate
        self._firsts: deque[tuple[int, int]] = deque(maxlen=history)  # (chars, tokens)
        self._chars = self._tokens = 0

    def raw(self, chars: int) -> float:
        return max(0, chars) / self.chars_per_token

    def fresh(self) -> float:
        """The correction of a session not seen yet: Σ tokens / Σ raw estimates of the latest
        first prompts, at least 1. Only upwards: the raw estimate counts the whole body (JSON
        syntax, other fields), so small prompts read below 1, and a larger one that follows
        would be taken for smaller than it is."""
        if not self._chars:
            return 1.0
        return max(1.0, self._tokens * self.chars_per_token / self._chars)

    def estimate(self, session: str, chars: int) -> int:
        """Estimated prompt tokens of a request of ``chars`` characters."""
        c = self._correction.get(session)
        return math.ceil(self.raw(chars) * (self.fresh() if c is None else c))

    def observe(self, session: str, chars: int, prompt_tokens: int) -> None:
        """The worker reported ``prompt_tokens`` for a request of ``chars`` characters."""
        raw = self.raw(chars)
        if raw <= 0 or prompt_tokens <= 0:
            return  # nothing to learn from an empty prompt or a missing usage block
        if session not in self._correction:  # its first prompt
            if len(self._firsts) == self._firsts.maxlen:
                c, t = self._firsts[0]
                self._chars -= c
                self._tokens -= t
            self._firsts.append((chars, prompt_tokens))
            self._chars += chars
            self._tokens += prompt_tokens
        self._correction[session] = prompt_tokens / raw

    def restore(self, session: str, correction: float) -> None:
        """Carry a correction learnt elsewhere (another replica's session record) over."""
        if correction > 0:
            self._correction[session] = correction

    def correction(self, session: str) -> float:
        c = self._correction.get(session)
        return self.fresh() if c is None else c

    def forget(self, session: str) -> None:
        self._correction.pop(session, None)

    def __len__(self) -> int:
        return len(self._correction)
