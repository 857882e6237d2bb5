"""KV retention decision at the end of a continuation.

Holding a dormant session's prefix costs KV that others could use; dropping it costs a
re-prefill when the session returns. MARS retains iff the re-prefill would take longer than
the tool phase is expected to (a high quantile of the tool time, so a retained prefix is
rarely dropped just before its session returns), and only for that long, capped. The
``fixed`` policy is Continuum's: a fixed TTL for tools that are usually quick.

Pure code: no I/O, no clock. Every outcome says why, for the ``retention_decision`` event.
"""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.core.events import RetentionDecision
from marsproxy.core.kv import blocks_for_tokens, reprefill_seconds
from marsproxy.sched.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class RetentionOutcome:
    retain: bool
    reprefill_s: float  # predicted re-prefill time of the context; 0 when unknown
    predicted_tool_s: float | None  # None: no tool-time history to predict from
    ttl_s: float  # how long to reserve; 0 when not retained
    blocks: int  # blocks to reserve; 0 when not retained or block size unknown
    reason: str

    def to_event(
        self,
        ts: float,
        session: str | None,
        worker: str | None,
        *,
        context_tokens: int = 0,
        prefill_tokens_per_s: float | None = None,
        policy: str = "",
    ) -> RetentionDecision:
        """The ``retention_decision`` event with the decision's inputs and its reason."""
        return RetentionDecision(
            ts=ts,
            session=session,
            worker=worker,
            retain=self.retain,
            reprefill_s=self.reprefill_s,
            predicted_tool_s=self.predicted_tool_s or 0.0,
            blocks=self.blocks,
            ttl_s=self.ttl_s,
            reason=self.reason,
            context_tokens=context_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
            policy=policy,
        )


def decide(
    context_tokens: int,
    prefill_tokens_per_s: float | None,
    predicted_tool_s: float | None,
    cfg: SchedulerConfig,
    block_size: int | None = None,
) -> RetentionOutcome:
    """Whether to retain the session's ``context_tokens`` through the coming tool phase.

    ``prefill_tokens_per_s`` is the worker's measured prefill throughput; ``predicted_tool_s``
    the tracker's high quantile for this session and tool kind (None without history).
    ``block_size`` turns the context into the blocks to reserve.
    """
    reprefill = reprefill_seconds(context_tokens, prefill_tokens_per_s)
    known = reprefill if reprefill is not None else 0.0

    def no(reason: str) -> RetentionOutcome:
        return RetentionOutcome(False, known, predicted_tool_s, 0.0, 0, reason)

    def yes(ttl_s: float, reason: str) -> RetentionOutcome:
        blocks = blocks_for_tokens(context_tokens, block_size) if block_size else 0
        return RetentionOutcome(True, known, predicted_tool_s, ttl_s, blocks, reason)

    if cfg.retention_policy == "off":
        return no("retention off")
    if predicted_tool_s is None:
        # Without history a reservation could hold KV for a tool that never ends.
        return no("no tool-time prediction")
    if predicted_tool_s < 0:
        raise ValueError(f"predicted_tool_s must not be negative, got {predicted_tool_s}")
    if context_tokens <= 0:
        return no("empty context")
    if cfg.retention_policy == "fixed":
        fixed = cfg.tuning.fixed_retention_s
        if predicted_tool_s > fixed:
            return no(f"tool {predicted_tool_s:.3g} s > fixed {fixed:.3g} s")
        return yes(min(fixed, cfg.tuning.retention_ttl_max_s), f"tool ≤ fixed {fixed:.3g} s")
    if reprefill is None:
        return no("no prefill throughput measured")
    if predicted_tool_s <= 0:
        # The session returns at once; a zero TTL reservation would protect nothing.
        return no("tool predicted instant")
    if reprefill <= predicted_tool_s:
        return no(f"re-prefill {reprefill:.3g} s ≤ tool {predicted_tool_s:.3g} s")
    ttl = min(predicted_tool_s, cfg.tuning.retention_ttl_max_s)
    capped = " (TTL capped)" if ttl < predicted_tool_s else ""
    return yes(ttl, f"re-prefill {reprefill:.3g} s > tool {predicted_tool_s:.3g} s{capped}")
