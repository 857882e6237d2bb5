"""Configuration of the admission control plane (mounted into ``MarsConfig`` as ``admission:``).

The keys an operator sets sit directly under ``admission:``; the controller's internals (overload
marks, the forecast fit, queue order) under ``admission.tuning:``, rarely changed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from marsproxy.config_section import Section as _Section


class AdmissionTuning(_Section):
    """``admission.tuning:`` — internals of the window, the KV fit and the queue order."""

    # -- AIMD window --------------------------------------------------------------------------
    increase: int = Field(1, ge=1, description="Additive increase per control tick.")
    decrease: float = Field(0.85, gt=0, lt=1, description="Multiplicative decrease per tick.")
    control_interval_s: float = Field(0.2, gt=0, description="Period of the control tick.")
    app_limited_frac: float = Field(0.5, ge=0, le=1, description="Grow only when admitted"
        " sessions ≥ this fraction of the window (app-limited guard).")
    # -- Overload marks -------------------------------------------------------------------------
    kv_enter: float = Field(
        0.90, gt=0, le=1,
        description="KV usage at or above which a worker is KV-overloaded. The usage read is"
        " max(vLLM usage, (used blocks + blocks retained for dormant sessions) / total): vLLM"
        " counts a dormant session's cached blocks as free.",
    )
    kv_leave: float = Field(0.85, ge=0, lt=1, description="KV usage ending a KV overload.")
    cpu_backlog_enter: float = Field(
        2.0, gt=0,
        description="Tool backlog ratio (tools in flight / tool CPUs) at or above which CPU"
        " overload begins.",
    )
    cpu_backlog_leave: float = Field(1.0, ge=0, description="Tool backlog ratio at or below"
                                     " which CPU overload may end.")
    tool_wait_enter_s: float = Field(
        5.0, gt=0, description="Tool queue-wait EMA (s) at or above which CPU overload begins."
    )
    tool_wait_leave_s: float = Field(
        2.0, ge=0, description="Tool queue-wait EMA (s) at or below which CPU overload may end."
    )
    use_psi: bool = Field(
        False, description="Also use CPU PSI 'some avg10' for CPU overload (when the probe has it)."
    )
    psi_enter: float = Field(
        60.0, gt=0, le=100, description="PSI some avg10 (%) at or above which CPU overload begins."
    )
    psi_leave: float = Field(
        30.0, ge=0, lt=100, description="PSI some avg10 (%) at or below which CPU overload may end."
    )
    cpu_cap_backlog: float = Field(
        4.0, gt=0,
        description="While tool CPUs are overloaded the window stops growing and the limit is at"
        " most ceil(tool_cpus × this) sessions, clamped to [window_min, the ceiling]. Lower"
        " values queue short sessions behind long tool phases while the cores are busy anyway.",
    )
    # -- KV fit ---------------------------------------------------------------------------------
    kv_fit_peak: bool = Field(
        True,
        description="KV-fit budgets every admitted session (running or in a tool phase) at its"
        " forecast peak context, max(context so far, first prompt × growth), and admits a new"
        " session only if its forecast fits beside them; false: only its first prompt against"
        " the free blocks (with window_min = window_init = window_max = N, a fixed window of N"
        " sessions: the benchmarks' yardstick).",
    )
    peak_growth_prior: float = Field(
        2.0, ge=1,
        description="Peak context per first-prompt token assumed until peak_min_samples sessions"
        " have finished.",
    )
    peak_history: int = Field(
        64, ge=1,
        description="Finished sessions whose Σ peak / Σ first prompt is the learnt growth.",
    )
    peak_min_samples: int = Field(
        4, ge=1, description="Finished sessions needed before the learnt growth replaces the prior."
    )
    peak_overcommit: float = Field(
        1.0, gt=0,
        description="Forecast peaks may always sum to this many times a worker's usable KV: the"
        " floor of the overcommit measured from the overlap (peak_overcommit_max). Well above 1"
        " the fit lets in more than the KV holds and the engine preempts.",
    )
    peak_overcommit_max: float = Field(
        3.0, gt=0,
        description="Largest overcommit the fit may take from the measured overlap: the"
        " blocks the engine holds for the admitted sessions over the sum of their forecasts,"
        " a decaying maximum (starts at 1, halves once per mean session lifetime, resets on a"
        " preemption). The fit's factor is peak_overlap_target / overlap, between"
        " peak_overcommit and this; equal to peak_overcommit: a fixed factor.",
    )
    peak_overlap_target: float = Field(
        0.8, gt=0, le=1,
        description="Share of the usable KV that the admitted sessions should be seen to hold"
        " at most: the fit overcommits by this / overlap (below kv_leave, so that what the"
        " overcommit lets in keeps clear of the KV overload marks).",
    )
    peak_overlap_min_sessions: int = Field(
        4, ge=1,
        description="Sessions a worker must hold before its overlap is measured: with fewer,"
        " one session's growth decides it, and the fit stays at peak_overcommit.",
    )
    peak_overlap_min_fill: float = Field(
        0.5, ge=0, le=1,
        description="Share of a worker's usable blocks its sessions' forecasts must fill"
        " before its overlap is measured.",
    )
    peak_free_sessions: int = Field(
        2, ge=0,
        description="Sessions a worker may hold before the forecast-peak fit applies (only the"
        " first-prompt fit below that): on a worker whose KV holds few sessions' peaks, an"
        " idle engine costs more than an occasional preemption.",
    )
    peak_cheap_reprefill_s: float = Field(
        0.5, ge=0,
        description="Where a worker re-prefills its sessions' mean forecast peak (at its measured"
        " prefill speed) within this many seconds and fewer than peak_cheap_sessions of them are"
        " in an LLM call, the fit overcommits by peak_overcommit_max for as many admissions as"
        " fill the calls to that: such preemptions cost less than an engine with little to run."
        " 0: off. Keep it below a second: dearer re-prefills cost more than they save.",
    )
    peak_cheap_sessions: int = Field(3, ge=0, description="Sessions in an LLM call the"
        " cheap-preemption ceiling fills to.")
    idle_admit: bool = Field(
        True,
        description="A worker with sessions waiting, whose admitted sessions are all in tool"
        " phases and whose engine runs nothing (vLLM's running gauge) for idle_admit_after_s,"
        " admits one more session whose first prompt fits its free KV, even where the"
        " forecast-peak fit says no: an idle engine with work waiting is the waste the fit is"
        " there to avoid, and the fit applies again to later admissions.",
    )
    idle_admit_after_s: float = Field(
        0.0, ge=0,
        description="How long a worker must sit idle that way before idle_admit lets one more"
        " session in; 0: at once (a plain client's next one-shot session waits for nothing).",
    )
    kv_hold_min_s: float = Field(
        20.0, ge=0,
        description="A dormant session's forecast counts in the KV fit for idle_timeout_factor ×"
        " its usual tool time, at least this long, at most its idle timeout (without tool"
        " history: this long). A session away longer than that (a plain client's finished"
        " task) stays admitted but no longer holds KV room; it counts again when it is back."
        " Also the time within which a session back after its answer goes on (return_history).",
    )
    kv_hold_reprefill_factor: float = Field(4.0, ge=0, description="With tool history, a"
        " dormant session's forecast counts for kv_hold_min_s at most this many times what"
        " re-prefilling its context takes at the worker's measured prefill speed (its slot for"
        " the full hold): a prefix cheap to rebuild is not worth KV room others wait for, as a"
        " plain client's finished sessions held it. 0: off.")
    return_history: int = Field(16, ge=1, description="A session dormant after its first call"
        " holds KV room only where at least half of its tenant's latest this-many such sessions"
        " came back within their hold (none seen: not held); with this many seen and under half"
        " back, new ones are forecast flat. Likewise a tool-calling tenant's answers end its"
        " sessions unless half of its latest this-many answered ones came back (kv_hold_min_s).")
    one_shot_crowd: int = Field(32, ge=1, description="A tenant with this many sessions dormant"
        " after their first call at once and none of its sessions back is taken as one-shot.")
    chars_per_token: float = Field(
        4.0, gt=0, description="Prompt characters per token before any first prompt's usage."
    )
    estimate_history: int = Field(
        64, ge=1, description="A new session's first prompt is estimated at the tokens per"
        " character of this many latest first prompts (their usage).",
    )
    tokenize_timeout_s: float = Field(
        0.5, gt=0,
        description="Timeout of the /tokenize call (admission.tokenize); past it, the character"
        " estimate.",
    )
    # -- Queue order ----------------------------------------------------------------------------
    long_prompt_tokens: int = Field(
        50_000, ge=1, description="A session whose first prompt exceeds this many tokens is long."
    )
    max_long_in_flight: int = Field(
        2, ge=0, description="Long sessions admitted per worker while short ones wait."
    )
    long_pack_frac: float = Field(
        0.9, gt=0, le=1,
        description="When only long sessions wait, pack them into this fraction of free KV.",
    )
    aging_margin_s: float = Field(
        30.0, ge=0,
        description="Safety slack (s): a session goes first once its time to deadline, less this,"
        " no longer covers admitting it and all due before it at the observed admission rate.",
    )
    max_bypass: int = Field(
        64, ge=1,
        description="Times later arrivals may be admitted ahead of a waiting session before it"
        " goes first.",
    )
    rate_halflife_s: float = Field(
        30.0, gt=0, description="Half-life of the admission-rate estimate behind Retry-After."
    )
    retry_after_min_s: int = Field(1, ge=0, description="Smallest Retry-After sent (s).")
    retry_after_max_s: int = Field(60, ge=1, description="Largest Retry-After sent (s).")

    @model_validator(mode="after")
    def _relations(self) -> AdmissionTuning:
        # Bad relations make the controller oscillate or never move; say which keys clash.
        problems = []
        pairs = (
            ("kv_leave", self.kv_leave, "kv_enter", self.kv_enter),
            ("cpu_backlog_leave", self.cpu_backlog_leave, "cpu_backlog_enter",
             self.cpu_backlog_enter),
            ("tool_wait_leave_s", self.tool_wait_leave_s, "tool_wait_enter_s",
             self.tool_wait_enter_s),
            ("psi_leave", self.psi_leave, "psi_enter", self.psi_enter),
            ("retry_after_min_s", self.retry_after_min_s, "retry_after_max_s",
             self.retry_after_max_s),
        )
        for low_name, low, high_name, high in pairs:
            strict = low_name.startswith(("kv_", "cpu_", "tool_", "psi_"))
            if low > high or (strict and low == high):
                rel = "<" if strict else "≤"
                problems.append(f"need {low_name} {rel} {high_name}, got {low} and {high}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ServiceClasses(_Section):
    """``admission.classes:`` — service classes: who is admitted ahead, and each class's wait."""

    order: tuple[str, ...] = Field(
        ("interactive", "batch"),
        description="Class names, first admitted first: a waiting session of a class goes"
        " ahead of every session of the classes after it, and one that does not fit holds the"
        " capacity against them (the later classes fill what is left and yield first).",
    )
    default: str = Field(
        "interactive",
        description="Class of a session whose request names none (header x-session-class) and"
        " whose API key has no entry in by_tenant.",
    )
    weights: dict[str, float] = Field(
        {"interactive": 4.0, "batch": 1.0},
        description="Share of the admission queue (queue_max) per class while several classes"
        " wait: a class over weight / Σ weights of the waiting classes gets 429"
        " class_over_share. Missing: 1.",
    )
    queue_deadline_s: dict[str, float] = Field(
        {"batch": 3600.0},
        description="Longest wait in the queue per class (s); missing: admission.queue_deadline_s.",
    )
    by_tenant: dict[str, str] = Field(
        {},
        description="Tenant id (a hash of the API key: docs/sharing.md) → its class: the class"
        " it gets by default and the highest it may ask for by header.",
    )

    @model_validator(mode="after")
    def _known(self) -> ServiceClasses:
        problems = []
        if not self.order or len(set(self.order)) != len(self.order):
            problems.append(f"order must name distinct classes, got {list(self.order)}")
        names = set(self.order)
        odd = sorted(n for n in names if not n or n != n.strip().lower())
        if odd:
            problems.append(f"class names are lower case, without spaces around: {odd}")
        if self.default not in names:
            problems.append(f"default {self.default!r} is not in order")
        for what, keys in (("weights", self.weights), ("queue_deadline_s", self.queue_deadline_s),
                           ("by_tenant", set(self.by_tenant.values()))):
            unknown = sorted(set(keys) - names)
            if unknown:
                problems.append(f"{what} names unknown classes {unknown}")
        bad = [k for k, v in [*self.weights.items(), *self.queue_deadline_s.items()] if v <= 0]
        if bad:
            problems.append(f"weights and deadlines must be > 0: {sorted(bad)}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def rank(self, cls: str) -> int:
        """0 for the first class in ``order``; unknown names rank with the default."""
        try:
            return self.order.index(cls)
        except ValueError:
            return self.order.index(self.default)

    def weight(self, cls: str) -> float:
        return self.weights.get(cls, 1.0)

    def deadline_s(self, cls: str, fallback: float) -> float:
        return self.queue_deadline_s.get(cls, fallback)


class AdmissionConfig(_Section):
    """``admission:`` — the session window per worker, the KV reserve and the admission queue."""

    enabled: bool = Field(
        True, description="Hold new sessions in the admission queue; false: admit every session."
    )
    window_init: int = Field(
        30, ge=1,
        description="Window (sessions per worker) at start. The window holds sessions back only"
        " while the worker is overloaded (KV, tool CPU, or unseen); otherwise the KV fit decides.",
    )
    window_min: int = Field(4, ge=1, description="Smallest window; decreases stop here.")
    window_max: int | None = Field(
        None, ge=1,
        description="Most sessions a worker may hold, overloaded or not; null: no count bound"
        " (the KV fit and, under overload, the window decide).",
    )
    kv_reserve_frac: float = Field(
        0.10, ge=0, lt=1,
        description="Share of a worker's KV blocks never promised: neither to sessions by the"
        " KV fit nor to yielding continuations by the scheduler's dispatch gate (which keeps it"
        " with admission off too).",
    )
    tokenize: bool = Field(
        False,
        description="Count a new session's first prompt with a worker's /tokenize (one round"
        " trip per new session) instead of characters / admission.tuning.chars_per_token.",
    )
    queue_deadline_s: float = Field(
        300.0, gt=0,
        description="Longest wait in the admission queue; past it the request gets 503.",
    )
    queue_max: int = Field(
        10_000, ge=1, description="Most sessions waiting; one more gets 429."
    )
    idle_timeout_factor: float = Field(
        4.0, gt=0, description="An admitted session idle this many times its usual tool time ends."
    )
    idle_timeout_min_s: float = Field(
        60.0, gt=0,
        description="Floor of the idle timeout (s); also used while no tool history exists.",
    )
    idle_timeout_max_s: float = Field(1800.0, gt=0, description="Cap of the idle timeout (s).")
    classes: ServiceClasses = Field(
        ServiceClasses(), description="Service classes (docs/admission.md)."
    )
    tenant_weights: dict[str, float] = Field(
        {},
        description="Tenant id → weight of its fair share (missing: 1). Waiting sessions are"
        " ordered by their tenant's served tokens (uncached prompt + completion) over its"
        " weight, so under contention each tenant's share follows its weight; alone, a tenant"
        " takes everything. A tenant over its weighted share of queue_max among the waiting"
        " tenants gets 429 tenant_over_share.",
    )
    tuning: AdmissionTuning = Field(
        AdmissionTuning(), description="Internals of the window, the KV fit and the queue order."
    )

    @model_validator(mode="after")
    def _relations(self) -> AdmissionConfig:
        problems = []
        top = self.window_init if self.window_max is None else self.window_max  # no bound
        if not self.window_min <= self.window_init <= top:
            problems.append(f"need window_min ≤ window_init ≤ window_max, got {self.window_min}"
                            f" ≤ {self.window_init} ≤ {self.window_max}")
        if self.idle_timeout_min_s > self.idle_timeout_max_s:
            problems.append(f"need idle_timeout_min_s ≤ idle_timeout_max_s, got"
                            f" {self.idle_timeout_min_s} and {self.idle_timeout_max_s}")
        if self.tuning.aging_margin_s >= self.queue_deadline_s:
            problems.append(
                f"need tuning.aging_margin_s < queue_deadline_s, got "
                f"{self.tuning.aging_margin_s} and {self.queue_deadline_s}"
            )
        short = sorted(c for c, d in self.classes.queue_deadline_s.items()
                       if d <= self.tuning.aging_margin_s)
        if short:
            problems.append(f"need tuning.aging_margin_s < classes.queue_deadline_s of {short}")
        bad = sorted(t for t, w in self.tenant_weights.items() if w <= 0)
        if bad:
            problems.append(f"tenant_weights must be > 0: {bad}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class PlacementConfig(_Section):
    """``placement:`` — which worker a new session goes to (docs/kv-events.md#placement)."""

    policy: Literal["prefix", "least_loaded"] = Field(
        "prefix",
        description="prefix: a new session goes to the worker whose KV cache holds the longest"
        " prefix of its first prompt (workers with kv_events only; the others and a prompt no"
        " worker holds are placed least loaded), within max_load_gap; least_loaded: the fewest"
        " sessions, as without KV events.",
    )
    max_load_gap: int = Field(
        2, ge=0,
        description="Load guard: a worker with a longer prefix takes a new session only while"
        " it holds at most this many sessions more than the least loaded placeable worker.",
    )
    max_call_gap: int = Field(
        0, ge=0,
        description="Load guard on work in flight: a worker with a longer prefix takes a new"
        " session only while it runs at most this many LLM calls more than the least-loaded"
        " choice (the new call would queue behind them).",
    )
    min_prefix_tokens: int = Field(
        256, ge=1,
        description="Resident prefix tokens a worker must hold beyond the least-loaded choice"
        " for prefix placement to prefer it (a shared system prompt is not worth a move).",
    )
