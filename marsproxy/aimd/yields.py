"""Who yields to whom once admitted: sessions of a later service class, and sessions of a tenant
that asks for more than its weighted share of the admitted sessions while another tenant asks
for no more than its own (a *light* tenant).

The queue orders who is admitted next (``lanes.py``), but an arriving interactive session, or
a light tenant's, still finds the KV held by the sessions admitted before it, and vLLM does
not preempt a running request for a waiting one. So the sessions that yield give way twice:

- **KV fit**: a waiting session that would not yield once admitted (of the first class, its
  tenant within its share) is fitted against the forecast KV of the sessions that do not
  yield alone (``WorkerFit.protected_room``): the others' KV is theirs only until it is
  wanted;
- **engine time**: a yielding session's calls run at a lower priority (the engine preempts
  them first) and wait in the dispatch gate until they fit beside the forecast KV of the
  sessions that do not yield (``sched/core.py``), so those find room when their next call
  comes; on an idle worker, too, while one of those is due back from a short tool phase
  (``SchedulerCore._due_back``).

The tenants' part is max-min fairness: a light tenant is served as if alone, and the tenants
that ask for more than their share (their admitted and waiting sessions together) share what
is left and give way to it, even one that holds no more than its share of the admitted
sessions: its few sessions may still hold the KV the light tenant's calls need. A tenant
alone, or every tenant within its share, yields nothing: nobody is capped while the others
are idle. A tenant's share counts the sessions admitted on this replica that hold a slot: in a
call, or dormant within their KV hold. One that holds none (a one-shot task after its call,
dormant until its idle timeout; a session dormant past its hold) is *away*: it asks for nothing
until it sends another call (a batch key's thousands of dormant tasks made every other tenant
light).

Pure code: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from marsproxy.aimd.config import ServiceClasses
from marsproxy.aimd.order_index import QueueEntry

__all__ = ["Yields"]


class Yields:
    def __init__(self, classes: ServiceClasses, weight: Callable[[str], float],
                 waiting: Callable[[], Mapping[str, int]],
                 one_shot: Callable[[str], bool] = lambda _s: False) -> None:
        """``weight``: a tenant's weight; ``waiting``: the waiting sessions per tenant;
        ``one_shot``: whether an admitted session is a one-shot task (``PeakForecast``)."""
        self._classes = classes
        self._weight = weight
        self._waiting = waiting
        self._one_shot = one_shot
        self._of: dict[str, tuple[str, int]] = {}  # admitted session → (tenant, class rank)
        self._admitted: Counter[str] = Counter()  # tenant → admitted sessions, less the away
        self._later = 0  # admitted sessions of a later class, less the away
        self._away: set[str] = set()  # admitted sessions that hold no slot now

    def admitted(self, session: str, tenant: str, cls: str | None) -> None:
        if session in self._of:
            return
        self._of[session] = got = (tenant, self._classes.rank(cls or ""))
        self._count(got, 1)

    def ended(self, session: str) -> None:
        got = self._of.pop(session, None)
        if got is not None and session not in self._away:
            self._count(got, -1)
        self._away.discard(session)

    def away(self, session: str) -> None:
        """``session`` holds no slot now (dormant, its KV room released): it counts in its
        tenant's share again only once it is :meth:`back`."""
        got = self._of.get(session)
        if got is not None and session not in self._away:
            self._away.add(session)
            self._count(got, -1)

    def back(self, session: str) -> None:
        """``session`` sent another call: it counts in its tenant's share again."""
        if session in self._away:
            self._away.discard(session)
            self._count(self._of[session], 1)

    def _count(self, got: tuple[str, int], sign: int) -> None:
        tenant, rank = got
        self._admitted[tenant] += sign
        self._later += sign * (rank > 0)
        if self._admitted[tenant] <= 0:
            del self._admitted[tenant]

    def nobody(self) -> bool:
        """Whether no admitted session yields now: all of the first class, one tenant there
        (the common case, checked first so that a request pays nothing for the rest)."""
        if self._later or len(self._admitted) > 1:
            return False
        waiting = self._waiting()
        return len(waiting) == 0 or (len(waiting) == 1 and (
            not self._admitted or next(iter(waiting)) in self._admitted))

    def single_tenant(self, tenant: str) -> bool:
        """Whether no tenant but ``tenant`` has sessions admitted: then one waiting session of
        ``tenant`` changes no session's yielding (so no KV view) by waiting."""
        return not self._admitted or (len(self._admitted) == 1 and tenant in self._admitted)

    def over_share(self, tenant: str, extra: int = 0) -> bool:
        """Whether ``tenant`` asks for more than its weighted share of the admitted sessions
        (its whole demand: its admitted and waiting sessions; ``extra``: that many of them
        admitted now, out of its waiting ones) while another tenant's whole demand is within
        that tenant's share: a light tenant, which should never wait. Between tenants that
        each ask for more than their share, the queue's turns even out the shares (yielding
        there would only overcommit the KV)."""
        waiting = self._waiting()
        present = set(self._admitted) | {t for t, n in waiting.items() if n > 0}
        present.add(tenant)
        if len(present) < 2:
            return False
        total = sum(self._weight(t) for t in present)
        n = sum(self._admitted.values()) + extra
        demand = self._admitted[tenant] + max(extra, waiting.get(tenant, 0))
        if demand <= n * self._weight(tenant) / total:
            return False
        return any(self._admitted[u] + waiting.get(u, 0) <= n * self._weight(u) / total
                   for u in present if u != tenant)

    def rank(self, session: str) -> int:
        """0: the session yields to nobody; else how far it yields (its class's rank, plus
        one while its tenant asks for more than its share beside a light tenant)."""
        got = self._of.get(session)
        if got is None or self.nobody():
            return 0
        return got[1] + self.over_share(got[0])

    def yields(self, session: str) -> bool:
        return self.rank(session) > 0

    def first_class_task(self, session: str) -> bool:
        """Whether ``session`` is a one-shot task of the first class: its calls wait in the
        dispatch gate for no one's room, its tenant over its share or not (its KV is gone when
        its call ends); a later class's task still gives way, as it asked."""
        got = self._of.get(session)
        return got is not None and got[1] == 0 and self._one_shot(session)

    def protected(self, e: QueueEntry) -> bool:
        """Whether a waiting session would yield to nobody once admitted."""
        return self._classes.rank(e.cls) == 0 and not self.over_share(e.tenant, extra=1)
