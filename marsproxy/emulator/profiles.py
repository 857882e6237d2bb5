"""Engine profiles: KV geometry, scheduler limits and step-time coefficients.

The H200 numbers were measured on an H200 running Qwen3-Coder-30B-A3B; docs/emulator.md gives
the derivation. Profiles are immutable; :func:`get_profile` applies command-line overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from marsproxy.emulator.step_time import StepTimeCoeffs


@dataclass(frozen=True)
class EngineProfile:
    name: str
    model_name: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Output length of a request that ends "naturally" (no ignore_eos): the emulator has no model
    # to emit EOS, so every such reply has this many tokens unless max_tokens is smaller.
    natural_output_tokens: int
    step: StepTimeCoeffs
    kv_bytes_per_token: int = 0  # informational (cache_config_info, docs)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        """vLLM refuses to start when one max_model_len request cannot fit in the KV cache; the
        emulator clamps instead, so small ``--num-blocks`` values stay usable."""
        return min(self.max_model_len, self.kv_capacity_tokens)


def _tiny() -> EngineProfile:
    return EngineProfile(
        name="tiny",
        model_name="tiny-emulated",
        block_size=16,
        num_blocks=512,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_model_len=8192,
        natural_output_tokens=32,
        # ~1.5 ms decode steps, ~3 ms for a full 512-token prefill step.
        step=StepTimeCoeffs(a=1e-3, w=0.5e-3, b=2e-6, c=20e-6, d_dec=10e-9, d_pf=1e-9),
    )


def _h200_qwen3_coder() -> EngineProfile:
    return EngineProfile(
        name="h200-qwen3-coder-30b-a3b",
        model_name="Qwen/Qwen3-Coder-30B-A3B-Instruct",
        block_size=16,
        num_blocks=43_000,  # ≈ 688k tokens at gpu_memory_utilization 0.9, max_num_seqs 1024
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        max_model_len=262_144,
        natural_output_tokens=256,
        step=StepTimeCoeffs(a=5.5e-3, w=9.9e-3, b=14e-6, c=0.09e-3, d_dec=25e-9, d_pf=1.3e-9),
        kv_bytes_per_token=98_304,
    )


def _zero() -> EngineProfile:
    base = _tiny()
    return dataclasses.replace(
        base,
        name="zero",
        model_name="zero-emulated",
        step=StepTimeCoeffs(a=0.0, w=0.0, b=0.0, c=0.0, d_dec=0.0, d_pf=0.0),
    )


def profile_names() -> tuple[str, ...]:
    return ("tiny", "h200-qwen3-coder-30b-a3b", "zero")


def get_profile(
    name: str,
    *,
    num_blocks: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
) -> EngineProfile:
    """The named profile with optional overrides; ``ValueError`` for unknown names or bad values."""
    builders = {"tiny": _tiny, "h200-qwen3-coder-30b-a3b": _h200_qwen3_coder, "zero": _zero}
    if name not in builders:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(profile_names())}")
    prof = builders[name]()
    over: dict[str, object] = {}
    for field, value in (
        ("num_blocks", num_blocks),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
    ):
        if value is not None:
            if value < 1:
                raise ValueError(f"{field} must be >= 1")
            over[field] = value
    if served_model_name:
        over["model_name"] = served_model_name
    return dataclasses.replace(prof, **over) if over else prof  # type: ignore[arg-type]
