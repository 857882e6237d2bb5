"""``priority: auto``: how the start-up probe is shaped and how its timings are read (pure).

vLLM 0.32 accepts a body ``priority`` with 200 whether or not it runs
``--scheduling-policy priority``, so an error tells nothing; only ordering does. The probe
puts two requests into the engine's *waiting* queue at the same time, behind a long prefill
that keeps the engine busy, and sees which one the engine picks first:

1. ``A``: a prompt half as long as B's (priority 0): the engine starts prefilling it at once,
   in chunks, and is busy with it while B and C arrive.
2. ``B``: a long prompt with a *low* priority (1), sent a moment later: it waits behind A.
3. ``C``: a short prompt with a *high* priority (0), sent last: it waits too.

Running requests are scheduled before waiting ones under both policies; the difference is in
the waiting queue. FCFS takes B first, so C finishes no sooner than the step in which B's
prefill ends. The priority policy takes C first, in the step where A's last chunk leaves room,
well before B (twice A's prefill) is done. All three use ``max_tokens`` 1 and fresh random
token ids (no prefix-cache hits). The worker honours priority iff C finished ahead of B by a
clear share of the time from A's end (when the engine chooses) to B's end. Anything else (an
error, a timeout, prompts too short to need several chunks, a tie) reads as *gated*, which is
always safe: the proxy then orders continuations itself.
"""

from __future__ import annotations

from dataclasses import dataclass

SHORT_TOKENS = 8
_MIN_LONG_TOKENS = 256
_MAX_LONG_TOKENS = 16_384
_LEN_MARGIN = 16


@dataclass(frozen=True, slots=True)
class ProbePlan:
    long_tokens: int  # B
    short_tokens: int = SHORT_TOKENS  # C

    @property
    def blocker_tokens(self) -> int:  # A: keeps the engine busy while B and C arrive
        return self.long_tokens // 2


@dataclass(frozen=True, slots=True)
class ProbeReading:
    honours_priority: bool
    reason: str


def plan(max_model_len: int | None, kv_tokens: int | None) -> ProbePlan | None:
    """Prompt sizes: as long as the context allows (capped), and all three (1.5 long + short)
    must fit the KV cache together so none waits for blocks. None: too small to probe."""
    n = _MAX_LONG_TOKENS
    if max_model_len is not None:
        n = min(n, max_model_len - _LEN_MARGIN)
    if kv_tokens is not None:
        n = min(n, (kv_tokens - 4 * SHORT_TOKENS) * 2 // 3)
    return ProbePlan(n) if n >= _MIN_LONG_TOKENS else None


def read(blocker_done: float, long_done: float, short_done: float,
         min_lead: float) -> ProbeReading:
    """Judge one run from when A, B and C finished. The engine chooses between B and C when A
    leaves room, so the lead is C's head start on B over the time from A's end to B's end (not
    from when A was sent: how long the requests took to reach the engine says nothing about
    its order)."""
    span = long_done - blocker_done
    if span <= 0:
        return ProbeReading(False, "probe timings out of order: the long request finished"
                                   " no later than the blocker")
    lead = (long_done - short_done) / span
    told = (f"short high-priority request done {short_done - blocker_done:.3f} s, long"
            f" low-priority one {span:.3f} s after the blocker (lead {lead:.0%}, needs"
            f" {min_lead:.0%})")
    if lead >= min_lead:
        return ProbeReading(True, "honours priority: " + told)
    return ProbeReading(False, "no priority ordering seen: " + told)
