"""Step-time model of one engine iteration (derivation and fitted coefficients: docs/emulator.md).

    t = a + w·(1 − (15/16)^N) + b·P + c·D + d_dec·K_dec + d_pf·A_pf

P prefill tokens, D decoding sequences, N = P + D, K_dec the summed context of the decoding
sequences (KV read), A_pf the causal (query, key) pairs of the prefill chunks. The w term is the
share of MoE expert weights a batch of N tokens touches (8 of 128 experts per token).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimeCoeffs:
    """Coefficients in seconds (per unit)."""

    a: float  # fixed per-step floor
    w: float  # streaming all expert weights once
    b: float  # per prefill token
    c: float  # per decoding sequence
    d_dec: float  # per context token read by a decoding sequence
    d_pf: float  # per causal attention pair of a prefill chunk
    expert_keep: float = 15.0 / 16.0  # 1 - experts_per_token / num_experts


@dataclass
class StepBatch:
    """What one step computes; filled by the scheduler, priced by :func:`step_duration`."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    prefill_pairs: int = 0

    def add_prefill(self, num_new: int, num_computed: int) -> None:
        """A prefill chunk of ``num_new`` tokens after ``num_computed`` tokens already in KV."""
        self.prefill_tokens += num_new
        self.prefill_pairs += num_new * num_computed + num_new * (num_new + 1) // 2

    def add_decode(self, context_len: int) -> None:
        """One decoding sequence whose attention reads ``context_len`` tokens of KV."""
        self.decode_seqs += 1
        self.decode_context += context_len

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


def step_duration(k: StepTimeCoeffs, batch: StepBatch) -> float:
    """Modelled seconds one step takes; 0 for an empty batch."""
    n = batch.num_tokens
    if n == 0:
        return 0.0
    return (
        k.a
        + k.w * (1.0 - k.expert_keep**n)
        + k.b * batch.prefill_tokens
        + k.c * batch.decode_seqs
        + k.d_dec * batch.decode_context
        + k.d_pf * batch.prefill_pairs
    )
