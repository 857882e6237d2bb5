"""A scheduler core to test, and a call's successful end (shared by the core and gate tests)."""

from __future__ import annotations

from typing import Any

from marsproxy.sched.config import SchedulerConfig, SchedulerTuning
from marsproxy.sched.core import SchedulerCore


def make(workers: tuple[str, ...] = ("w",), kv_reserve_frac: float = 0.10,
         **kw: Any) -> SchedulerCore:
    """A core with ``kw`` set at either level (the tuning keys go under ``tuning``)."""
    tuned = {k: v for k, v in kw.items() if k in SchedulerTuning.model_fields}
    rest = {k: v for k, v in kw.items() if k not in tuned}
    cfg = SchedulerConfig(**rest, tuning=SchedulerTuning(**tuned))
    return SchedulerCore(cfg, list(workers), kv_reserve_frac)


def end_ok(core: SchedulerCore, now: float, call: int, prompt: int, completion: int = 10,
           cached: int = 0, tool: float | None = None, more: bool = True) -> Any:
    return core.end(now, call, ok=True, prompt_tokens=prompt, completion_tokens=completion,
                    cached_tokens=cached, engine_s=0.1, predicted_tool_s=tool,
                    session_continues=more)
