"""Fair shares between tenants: one virtual token counter per tenant.

A tenant's counter is the tokens it was served (uncached prompt + completion) divided by its
weight. The admission queue offers the next slot to the waiting tenant with the smallest
counter, so under contention each tenant's served tokens grow in proportion to its weight; a
tenant alone is never held back, as nobody else competes for the slot.

Tokens are known only when a response ends, long after the admission that caused them, so an
admission charges the session's estimated first prompt at once (a *credit*), and the usage
reported later is charged net of what is left of that credit: a pass that admits several
sessions interleaves the tenants instead of giving them all to whoever was behind.

An idle tenant that comes back must not get a burst for the time it was away: the counters
share a *virtual time*, the smallest counter among the waiting tenants (when nobody waits, the
largest counter of all: without contention there is no debt to repay), and a tenant whose
first session starts waiting is lifted to it (start tags of start-time fair queueing).

Several replicas (``store.backend: redis``) share the counters: with :attr:`shared` on, every
charge is also kept, in full, for the store (:meth:`take_charges`); the shell adds them to a
hash of the store and reads back the sum of every replica's charges, and :meth:`sync` adds what
the *other* replicas charged since the last read to the local counters. The local counters
carry on alone while the store is away (the charges wait to be sent).

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["TenantShares"]


class TenantShares:
    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self._tags: dict[str, float] = {}  # tenant → virtual tokens (absent: the virtual time)
        self._credit: dict[str, tuple[str, float]] = {}  # session → (tenant, tokens left)
        self.virtual_time = 0.0
        self.shared = False
        """Keep charges for the store (several replicas): see :meth:`take_charges`."""
        self._outbox: dict[str, float] = {}  # tenant → charges not yet sent to the store
        self._seen: dict[str, float] = {}  # tenant → the store's counter as last read

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def tag(self, tenant: str) -> float:
        """The tenant's virtual token counter (served tokens / weight)."""
        return self._tags.get(tenant, self.virtual_time)

    def cost(self, tenant: str, tokens: float) -> float:
        """What serving ``tokens`` adds to the tenant's counter."""
        return max(0.0, tokens) / self.weight(tenant)

    # -- events --------------------------------------------------------------------------------
    def activate(self, tenant: str) -> None:
        """The tenant's first waiting session arrived: no credit for the time it was idle."""
        if self.tag(tenant) < self.virtual_time:
            self._tags[tenant] = self.virtual_time

    def admitted(self, tenant: str, session: str, est_tokens: int) -> None:
        """A session was admitted: charge its estimated first prompt now, as a credit."""
        self._tags[tenant] = self.tag(tenant) + self.cost(tenant, est_tokens)
        self._credit[session] = (tenant, float(max(0, est_tokens)))

    def charge(self, tenant: str, session: str, tokens: int) -> None:
        """A response ended: ``tokens`` (uncached prompt + completion) were served."""
        left = 0.0
        owner, credit = self._credit.get(session, (tenant, 0.0))
        if credit > 0 and owner == tenant:
            left = min(credit, float(tokens))
            self._credit[session] = (owner, credit - left)
        self._tags[tenant] = self.tag(tenant) + self.cost(tenant, tokens - left)
        if self.shared and tokens > 0:
            self._outbox[tenant] = self._outbox.get(tenant, 0.0) + self.cost(tenant, tokens)

    def forget(self, session: str) -> None:
        """The session ended: what is left of its credit stays charged (it was promised)."""
        self._credit.pop(session, None)

    def settle(self, waiting: Iterable[str]) -> None:
        """Advance the virtual time after the waiting set changed; forget counters at or below
        it (reading one back gives the virtual time, which is the same)."""
        tags = [self.tag(t) for t in waiting]
        if tags:
            self.virtual_time = max(self.virtual_time, min(tags))
        elif self._tags:
            self.virtual_time = max(self.virtual_time, max(self._tags.values()))
        stale = [t for t, v in self._tags.items() if v <= self.virtual_time]
        for t in stale:
            del self._tags[t]

    # -- several replicas ----------------------------------------------------------------------
    def take_charges(self) -> dict[str, float]:
        """The charges (virtual tokens per tenant) not yet sent to the store; they are gone
        from here: :meth:`restore` them if the store did not take them."""
        out, self._outbox = self._outbox, {}
        return out

    def restore(self, charges: Mapping[str, float]) -> None:
        """The store was unreachable: ``charges`` wait for the next exchange."""
        for t, c in charges.items():
            self._outbox[t] = self._outbox.get(t, 0.0) + c

    def sync(self, counters: Mapping[str, float], sent: Mapping[str, float]) -> None:
        """The store's counters (every replica's charges, ``sent`` included, which were
        added just before the read): what the others charged since the last read raises the
        local counters. A counter that went down (the store lost its state) is only noted."""
        for t, total in counters.items():
            mine = sent.get(t, 0.0)
            last = self._seen.get(t)
            others = 0.0 if last is None else total - last - mine
            if others > 1e-9:
                self._tags[t] = self.tag(t) + others
            self._seen[t] = total

    def counters(self) -> dict[str, float]:
        """The store's counters as this replica knows them: the last read plus what it has
        charged since (every replica ranks its sessions in the global queue by these)."""
        out = dict(self._seen)
        for t, c in self._outbox.items():
            out[t] = out.get(t, 0.0) + c
        return out

    def snapshot(self, tenants: Iterable[str]) -> dict[str, float]:
        """The counters of ``tenants``: a pass's working copy."""
        return {t: self.tag(t) for t in tenants}

    def __len__(self) -> int:
        """Tenants with a counter above the virtual time."""
        return len(self._tags)
