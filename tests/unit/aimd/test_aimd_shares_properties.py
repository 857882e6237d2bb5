"""Properties of the fair shares, on a simulated worker: under contention each tenant's served
tokens follow its weight; a tenant alone (or beside idle ones) is never held back."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.aimd.config import AdmissionConfig
from marsproxy.aimd.queue import AdmissionQueue, WorkerView

SIM = settings(max_examples=25, deadline=None)
_IDS = itertools.count()


def _run(q: AdmissionQueue, tenants: dict[str, tuple[int, float]], slots: int, steps: int,
         backlog: dict[str, int], hold: int = 4) -> tuple[Counter[str], int]:
    """One worker with ``slots`` sessions at most; each session holds its slot ``hold`` steps
    and is served ``est × growth`` tokens, charged when it ends (as responses end). Every tenant
    keeps ``backlog[t]`` sessions waiting. Returns tokens served per tenant and idle slot-steps
    while someone waited."""
    served: Counter[str] = Counter()
    running: list[tuple[int, str, str, int]] = []  # (end step, tenant, session, tokens)
    idle_while_waiting = 0
    waiting: Counter[str] = Counter(e.tenant for e in q.ordered(0.0))
    for step in range(steps):
        for _end, tenant, session, tokens in [r for r in running if r[0] <= step]:
            q.charge(tenant, session, tokens)
            q.forget(session)
            served[tenant] += tokens
        running = [r for r in running if r[0] > step]
        for t, want in backlog.items():
            for _ in range(want - waiting[t]):
                est, _growth = tenants[t]
                assert q.push(q.entry(f"{t}-{next(_IDS)}", t, float(step), est))
                waiting[t] += 1
        view = WorkerView("w", admitted=len(running), limit=slots, budget_blocks=None)
        for a in q.select(float(step), [view]):
            est, growth = tenants[a.entry.tenant]
            waiting[a.entry.tenant] -= 1
            running.append((step + hold, a.entry.tenant, a.entry.session, int(est * growth)))
        if len(running) < slots and len(q):
            idle_while_waiting += slots - len(running)
    return served, idle_while_waiting


@SIM
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(100, 2000), st.floats(1.0, 4.0)),
             min_size=2, max_size=3),
    st.integers(2, 8),
)
def test_served_tokens_follow_the_weights_under_contention(
    spec: list[tuple[int, int, float]], slots: int
) -> None:
    names = [f"t{i}" for i in range(len(spec))]
    weights = {t: float(w) for t, (w, _, _) in zip(names, spec, strict=True)}
    tenants = {t: (est, growth) for t, (_, est, growth) in zip(names, spec, strict=True)}
    q = AdmissionQueue(AdmissionConfig(tenant_weights=weights))
    served, idle = _run(q, tenants, slots, steps=300, backlog=dict.fromkeys(names, slots + 2))
    assert idle == 0  # work-conserving
    per_weight = {t: served[t] / weights[t] for t in names}
    # Every tenant keeps more waiting than the worker holds: contention at every pass. The
    # largest session's tokens are the granularity of a turn: allow a few of them.
    slack = 6 * max(est * g for est, g in tenants.values()) / min(weights.values())
    assert max(per_weight.values()) - min(per_weight.values()) <= slack + 0.1 * max(
        per_weight.values()), per_weight


@SIM
@given(st.integers(1, 5), st.integers(2, 8), st.integers(100, 2000))
def test_nobody_is_capped_while_others_are_idle(weight: int, slots: int, est: int) -> None:
    # "light" was busy before and has a small weight; now only it waits: it gets every slot.
    q = AdmissionQueue(AdmissionConfig(tenant_weights={"heavy": float(weight), "light": 1.0}))
    both = {"heavy": (est, 2.0), "light": (est, 2.0)}
    _run(q, both, slots, steps=50, backlog={"heavy": 2, "light": 2})
    served, idle = _run(q, both, slots, steps=200, backlog={"light": 4})
    assert idle == 0
    assert served["light"] > 0 and served["heavy"] <= 2 * slots * est * 2  # heavy only drains


@SIM
@given(st.integers(2, 6))
def test_a_returning_tenant_gets_no_burst(slots: int) -> None:
    # "b" was away while "a" was served a lot; back, it shares equally instead of taking
    # every slot until it caught up.
    q = AdmissionQueue(AdmissionConfig())
    both = {"a": (500, 1.0), "b": (500, 1.0)}
    _run(q, both, slots, steps=200, backlog={"a": 3})
    served, _ = _run(q, both, slots, steps=200, backlog={"a": 3, "b": 3})
    assert served["a"] >= 0.8 * served["b"]
