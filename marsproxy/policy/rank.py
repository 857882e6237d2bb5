"""A pending session's place in the store's global queue (several replicas): the policy as a
number every replica computes alike.

The global queue (``store.backend: redis``) confirms pending sessions of all replicas in one
order, lowest score first. The score carries the admission queue's order across replicas:

1. the *band*: 0 for a child of an admitted parent (the children's lane), else 1 + the rank of
   its service class in ``admission.classes.order`` (interactive before batch);
2. the *tenant term*: ``floor(16 · log2(1 + v))`` with ``v`` the tenant's virtual token
   counter as every replica shares it (served tokens / weight, summed over the replicas in the
   store) plus the estimated cost of the tenant's sessions pending before this one on this
   replica (so one replica's burst interleaves with the other tenants); tenants within ~4 %
   of each other tie;
3. the arrival, in 100 ms steps since 2025-01-01 UTC.

Packed into one float as ``(band · 2^17 + tenant) · 2^32 + arrival``: every part an integer
below its field (band < 16, tenant < 2^17, arrival < 2^32), so the sum stays below 2^53 and a
double holds it exactly. Ties (same band, tenant term and 100 ms step) are broken by the
session's name, as Redis orders equal scores.

Pure code: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from marsproxy.policy.outcome import Pending

__all__ = ["RankKey", "rank_keys", "tenant_term"]

EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
ARRIVAL_STEP_MS = 100
ARRIVAL_BITS = 32
TENANT_BITS = 17
TENANT_STEPS = 16  # tenant terms per doubling of the counter
BAND_MAX = 15


@dataclass(frozen=True, slots=True)
class RankKey:
    band: int
    """0: a child of an admitted parent; 1 + its class's rank otherwise."""
    tenant: int
    """The tenant's position by its shared counter (:func:`tenant_term`)."""

    def score(self, arrival_ms: int) -> int:
        """The global queue's score of a session with this key that arrived at ``arrival_ms``
        (epoch ms); lower goes first."""
        arrival = min((1 << ARRIVAL_BITS) - 1, max(0, arrival_ms - EPOCH_MS) // ARRIVAL_STEP_MS)
        band = min(BAND_MAX, max(0, self.band))
        return ((band << TENANT_BITS) + self.tenant << ARRIVAL_BITS) + arrival


def tenant_term(counter: float) -> int:
    """Monotone in the counter, small for any counter a deployment reaches."""
    return min((1 << TENANT_BITS) - 1, math.floor(TENANT_STEPS * math.log2(1 + max(0.0, counter))))


def rank_keys(
    pending: Sequence[tuple[str, Pending]], counters: Mapping[str, float],
    class_rank: Callable[[str], int], cost: Callable[[str, int], float],
) -> dict[str, RankKey]:
    """The key of each pending session (``pending`` oldest first); ``counters``: the shared
    virtual token counters; ``cost``: what a session's estimated tokens add to its tenant's."""
    ahead: dict[str, float] = {}
    out: dict[str, RankKey] = {}
    for key, p in pending:
        band = 0 if p.child else 1 + class_rank(p.cls)
        v = counters.get(p.tenant, 0.0) + ahead.get(p.tenant, 0.0)
        out[key] = RankKey(band, tenant_term(v))
        ahead[p.tenant] = ahead.get(p.tenant, 0.0) + cost(p.tenant, p.est_tokens)
    return out
