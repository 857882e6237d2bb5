"""Keys that moved or were removed, so that an old config file fails with the way forward.

The loader checks every source a user writes (the YAML file, each ``MARSPROXY_*`` variable, the
command-line overrides) against this table before validating, and names the key's new place, or
what marsproxy does now that the key is gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Internals of each plane moved under its tuning section.
_TUNED: dict[str, tuple[str, ...]] = {
    "admission": (
        "increase", "decrease", "control_interval_s", "app_limited_frac",
        "kv_enter", "kv_leave", "cpu_backlog_enter", "cpu_backlog_leave",
        "tool_wait_enter_s", "tool_wait_leave_s", "use_psi", "psi_enter", "psi_leave",
        "cpu_cap_backlog", "kv_fit_peak", "peak_growth_prior", "peak_history",
        "peak_min_samples", "peak_overcommit", "peak_overcommit_max", "peak_overlap_target",
        "peak_overlap_min_sessions", "peak_overlap_min_fill", "peak_free_sessions",
        "peak_cheap_reprefill_s", "idle_admit", "idle_admit_after_s", "kv_hold_min_s",
        "chars_per_token", "tokenize_timeout_s", "long_prompt_tokens", "max_long_in_flight",
        "long_pack_frac", "aging_margin_s", "max_bypass", "rate_halflife_s",
        "retry_after_min_s", "retry_after_max_s",
    ),
    "scheduler": (
        "service_measure", "service_thresholds", "aging_period_s",
        "retention_ttl_max_s", "fixed_retention_s", "retention_drop_kv_usage", "backfill_max",
        "warm_resume_min_frac", "tick_s", "probe_timeout_s", "probe_min_lead",
    ),
    "tools": (
        "confirm_psi", "confirm_cpu_percent", "ema_alpha", "quantile", "history",
        "inferred_min_s", "event_max_future_s", "event_max_age_s",
    ),
}

#: old dotted path → new dotted path.
MOVED: dict[str, str] = {
    f"{plane}.{key}": f"{plane}.tuning.{key}" for plane, keys in _TUNED.items() for key in keys
} | {
    # One KV reserve, kept by admission's fit and by the scheduler's dispatch gate alike.
    "scheduler.kv_reserve_frac": "admission.kv_reserve_frac",
}

#: old dotted path → what marsproxy does now that it is gone.
REMOVED: dict[str, str] = {
    "admission.cpu_cap_always": "the CPU cap (admission.tuning.cpu_cap_backlog) bounds the"
    " limit only while the tool CPUs are pressed",
    "admission.cpu_overload_shrinks": "CPU overload holds the window and the CPU cap bounds the"
    " limit; only KV overload shrinks the window",
    "admission.cpu_overload_order": "the queue keeps arrival order while tool CPUs are"
    " overloaded",
    "admission.kv_count_retained": "KV overload always counts the blocks retained for dormant"
    " sessions as used",
    "admission.classes.reserve_frac": "later classes' sessions give way to the first class's"
    " once admitted (KV fit, engine priority, dispatch gate: docs/sharing.md)",
} | dict.fromkeys(
    ("scheduler.level_thresholds", "scheduler.tuning.level_thresholds"),
    "levels by uncached prefill went with priority_policy mars; sessions go in arrival order"
    " (session_fcfs)",
)

#: (dotted path, old value) → what to set instead.
RETIRED_VALUES: dict[tuple[str, str], str] = {
    ("scheduler.priority_policy", "mars"): "session_fcfs (the default; the levels by uncached"
    " prefill lost to it on priority engines and changed nothing behind the dispatch gate)",
}


_MISSING = object()


def _get(tree: Mapping[str, Any], path: str) -> Any:
    """The value at dotted ``path``, or ``_MISSING``."""
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def env_name(path: str, prefix: str) -> str:
    """``admission.tuning.x`` → ``MARSPROXY_ADMISSION__TUNING__X``."""
    return prefix + "__".join(p.upper() for p in path.split("."))


def retired_keys(tree: Mapping[str, Any], source: str, env_prefix: str = "") -> list[str]:
    """One line per moved or removed key, or removed value, set in ``tree`` (what ``source``
    holds): the key, its new place or what happens now, and the source. With ``env_prefix``
    (``tree`` came from one environment variable) the replacement is named as a variable too."""
    lines = []
    for old, new in MOVED.items():
        if _get(tree, old) is not _MISSING:
            hint = f"; set {env_name(new, env_prefix)}" if env_prefix else ""
            lines.append(f"  {old} moved to {new} ({source}{hint})")
    for old, now in REMOVED.items():
        if _get(tree, old) is not _MISSING:
            lines.append(f"  {old} was removed: {now} ({source})")
    for (path, value), instead in RETIRED_VALUES.items():
        if _get(tree, path) == value:
            lines.append(f"  {path}: {value} was removed; set {instead} ({source})")
    return lines
