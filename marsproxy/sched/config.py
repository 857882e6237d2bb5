"""Configuration of the scheduler (``scheduler:`` in ``MarsConfig``).

Every number of DESIGN §5.3 (continuation priority) and §5.4 (KV retention) is a field here
with the design's default, so code, YAML, docs and Prometheus share one name for it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from marsproxy.config_section import Section as _Section

ServiceMeasure = Literal["tokens", "engine_seconds"]
HintEncoderName = Literal["headers", "dynamo", "none"]
RetentionPolicy = Literal["mars", "fixed", "off"]
PriorityPolicy = Literal["mars", "las", "session_fcfs", "off"]


class SchedulerConfig(_Section):
    """``scheduler:`` — MLFQ levels of continuations, KV retention and upstream hints."""

    # -- Priority levels (DESIGN §5.3) ------------------------------------------------------
    priority_policy: PriorityPolicy = Field(
        "mars",
        description="How continuations are ordered: mars (uncached-prefill bucket, demoted by"
        " attained service, aged); las (attained service only, as Autellix); session_fcfs"
        " (older sessions first, as Continuum); off (no levels, no priority hints).",
    )
    level_thresholds: tuple[int, int, int] = Field(
        (2048, 8192, 32768),
        description="Uncached prompt tokens up to which a continuation is level 0, 1, 2;"
        " above the last it is level 3.",
    )
    service_measure: ServiceMeasure = Field(
        "tokens",
        description="What counts as a session's attained service: tokens processed"
        " (prompt + generated) or engine seconds (sum of request latencies on the worker).",
    )
    service_thresholds: tuple[float, float, float] = Field(
        (2048.0, 8192.0, 32768.0),
        description="Attained service (in service_measure units) past each of which a session"
        " is demoted one level (least attained service, as Autellix PLAS).",
    )
    aging_period_s: float = Field(
        30.0, gt=0, description="A waiting continuation moves up one level per this many seconds."
    )
    priority_override_client: bool = Field(
        True,
        description="Replace a client's explicit body 'priority' with the level; false: respect"
        " the client's value.",
    )
    # -- KV retention (DESIGN §5.4) ---------------------------------------------------------
    retention_policy: RetentionPolicy = Field(
        "mars",
        description="mars: retain iff re-prefill time > predicted tool time; fixed: retain for"
        " fixed_retention_s when the predicted tool time is at most that (Continuum); off.",
    )
    retention_ttl_max_s: float = Field(
        60.0, gt=0, description="Longest a retained session's blocks stay reserved (s)."
    )
    fixed_retention_s: float = Field(
        2.0, gt=0, description="TTL (s) and tool-time bound of the fixed retention policy."
    )
    # -- Hints ------------------------------------------------------------------------------
    hint_encoder: HintEncoderName = Field(
        "headers", description="What goes upstream with each continuation: headers, dynamo, none."
    )

    @model_validator(mode="after")
    def _relations(self) -> SchedulerConfig:
        # Unsorted thresholds would make buckets overlap; say which key is wrong.
        problems = []
        for name, values in (
            ("level_thresholds", self.level_thresholds),
            ("service_thresholds", self.service_thresholds),
        ):
            if any(v <= 0 for v in values) or list(values) != sorted(set(values)):
                problems.append(f"{name} must be positive and strictly increasing, got {values}")
        if problems:
            raise ValueError("; ".join(problems))
        return self
