"""Configuration of the scheduler (``scheduler:`` in ``MarsConfig``).

The policy choices an operator makes sit directly under ``scheduler:``; the numbers behind the
priority order, KV retention, gated dispatch and the start-up probe under ``scheduler.tuning:``.
The KV reserve the dispatch gate keeps free is ``admission.kv_reserve_frac``, one key for both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from marsproxy.config_section import Section as _Section

ServiceMeasure = Literal["tokens", "engine_seconds"]
HintEncoderName = Literal["headers", "dynamo", "none"]
RetentionPolicy = Literal["mars", "fixed", "off"]
PriorityPolicy = Literal["session_fcfs", "las", "off"]


class SchedulerTuning(_Section):
    """``scheduler.tuning:`` — priority order, retention, gated dispatch and probe internals."""

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
    retention_ttl_max_s: float = Field(
        60.0, gt=0, description="Longest a retained session's blocks stay reserved (s)."
    )
    fixed_retention_s: float = Field(
        2.0, gt=0, description="TTL (s) and tool-time bound of the fixed retention policy."
    )
    retention_drop_kv_usage: float = Field(
        0.90, gt=0, le=1,
        description="KV usage of a worker at which reservations of dormant sessions are dropped"
        " (highest level first) until the ledger fits again.",
    )
    backfill_max: int = Field(
        4, ge=0,
        description="How many smaller continuations may pass the head of a gated queue that"
        " does not fit the worker's KV budget (a yielding call), before the queue waits for it.",
    )
    warm_resume_min_frac: float = Field(
        0.5, gt=0, le=1,
        description="A resumed session counts as warm when its cached prompt tokens cover at"
        " least this share of the context it left with.",
    )
    tick_s: float = Field(
        0.2, gt=0,
        description="Period of the scheduler tick: reservation expiry, drops under pressure,"
        " worker facts from the latest scrape.",
    )
    probe_timeout_s: float = Field(
        30.0, gt=0, description="Longest the start-up priority probe of one worker may take."
    )
    probe_min_lead: float = Field(
        0.25, gt=0, lt=1,
        description="The probe reads a worker as honouring priority when its short,"
        " high-priority request finishes before the long, low-priority one sent ahead of it by"
        " at least this share of the time from the blocker's end to the long one's end.",
    )

    @model_validator(mode="after")
    def _relations(self) -> SchedulerTuning:
        # Unsorted thresholds would make buckets overlap; say which key is wrong.
        problems = []
        for name, values in (("service_thresholds", self.service_thresholds),):
            if any(v <= 0 for v in values) or list(values) != sorted(set(values)):
                problems.append(f"{name} must be positive and strictly increasing, got {values}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class SchedulerConfig(_Section):
    """``scheduler:`` — how continuations are ordered, what is retained, what goes upstream."""

    priority_policy: PriorityPolicy = Field(
        "session_fcfs",
        description="How continuations are ordered: session_fcfs (the session that arrived"
        " first goes first, a continuation keeps its session's place); las (least attained"
        " service first, aged, as Autellix); off (no order, no priority hints).",
    )
    priority_override_client: bool = Field(
        True,
        description="Replace a client's explicit body 'priority' with the proxy's; false: respect"
        " the client's value.",
    )
    retention_policy: RetentionPolicy = Field(
        "mars",
        description="mars: retain iff re-prefill time > predicted tool time; fixed: retain for"
        " scheduler.tuning.fixed_retention_s when the predicted tool time is at most that"
        " (Continuum); off.",
    )
    default_max_num_seqs: int = Field(
        1024, ge=1,
        description="In-flight cap of a gated worker whose workers[].max_num_seqs is not set:"
        " the most vLLM picks by itself (GPUs of 70 GiB and more; 256 on smaller ones). A cap"
        " below the engine's would throttle it; above, the engine queues the rest in arrival"
        " order (set workers[].max_num_seqs to order them in the proxy).",
    )
    hint_encoder: HintEncoderName = Field(
        "headers", description="What goes upstream with each continuation: headers, dynamo, none."
    )
    tuning: SchedulerTuning = Field(
        SchedulerTuning(),
        description="Numbers behind the priority order, retention, gated dispatch and probe.",
    )
