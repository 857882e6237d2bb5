"""Ideal session time: the session alone on an idle system, COMPUTED from the engine profile.

Goodput counts sessions that finish within a factor of this time. It is not measured: each LLM
call is priced with the profile's step-time model exactly as the emulated engine would run it
alone (prefix cache warm from the previous call, prefill in chunks of ``max_num_batched_tokens``,
the first output token sampled with the last prefill chunk, then one decode step per token),
and each tool phase takes its planned time (one tool alone has a CPU to itself). Network and
proxy overheads are not included. For a real vLLM the profile is only an approximation.
"""

from __future__ import annotations

from marsproxy.emulator.profiles import EngineProfile
from marsproxy.emulator.step_time import StepBatch, step_duration
from marsproxy.runs.workload import PlannedSession


def llm_call_seconds(
    profile: EngineProfile, prompt_tokens: int, cached_tokens: int, output_tokens: int
) -> float:
    """Modelled seconds of one call alone on the engine."""
    k = profile.step
    bs = profile.block_size
    # Prefix hit: whole blocks, at least one prompt token left to compute (as the KV cache does).
    cached = min(cached_tokens // bs * bs, (prompt_tokens - 1) // bs * bs)
    total = 0.0
    done = cached
    while done < prompt_tokens:
        n = min(profile.max_num_batched_tokens, prompt_tokens - done)
        b = StepBatch()
        b.add_prefill(n, done)
        total += step_duration(k, b)
        done += n
    # Decode steps for tokens 2..out; the context of step j is prompt + j tokens.
    steps = max(0, output_tokens - 1)
    if steps:
        one = StepBatch()
        one.add_decode(0)
        base = step_duration(k, one)  # every term but the context read
        ctx_sum = steps * (prompt_tokens + 1) + steps * (steps - 1) // 2
        total += steps * base + k.d_dec * ctx_sum
    return total


def ideal_seconds(
    session: PlannedSession, profile: EngineProfile, time_scale: float = 1.0
) -> tuple[float, float]:
    """(LLM seconds, tool seconds) of ``session`` alone; LLM time in wall seconds at
    ``time_scale`` wall seconds per modelled second."""
    llm = 0.0
    context = 0  # tokens in the prefix cache after the previous call: its prompt and reply
    for t in session.turns:
        llm += llm_call_seconds(profile, t.input_tokens, context, t.output_tokens)
        context = t.input_tokens + t.output_tokens
    return llm * time_scale, session.tool_s_total
