"""Requests held for admission: a future per waiting request, answered when its session is
admitted or refused.

A refusal can come while the session's own request is still on its way to waiting (between
the plane's answer and the wait): it is kept for that request (``unclaimed``) instead of lost.
"""

from __future__ import annotations

import asyncio

from marsproxy.gateway.shells.admission_types import Granted, Refused, Verdict


class HeldRequests:
    def __init__(self) -> None:
        self._waiters: dict[str, list[asyncio.Future[Verdict]]] = {}
        self._unclaimed: dict[str, Refused] = {}  # refusals that found no waiter yet
        self._arriving: dict[str, int] = {}  # requests between the plane's answer and waiting

    # A pair of calls (try/finally at the caller), not a context manager: it runs on every
    # new session's request, where contextlib's generator cost more than the bookkeeping.
    def arriving(self, key: str) -> None:
        """A request of ``key`` is on its way to waiting (a refusal meanwhile is its); the
        caller calls :meth:`arrived` when it is there (or gone)."""
        self._arriving[key] = self._arriving.get(key, 0) + 1

    def arrived(self, key: str) -> None:
        left = self._arriving[key] - 1
        if left:
            self._arriving[key] = left
        else:
            del self._arriving[key]

    def expects(self, key: str) -> bool:
        """Whether a refusal of ``key`` would reach a request (waiting, or on its way)."""
        return key in self._waiters or key in self._arriving

    def unclaimed(self, key: str) -> Refused | None:
        return self._unclaimed.pop(key, None)

    def future(self, key: str) -> asyncio.Future[Verdict]:
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        return fut

    def others(self, key: str, fut: asyncio.Future[Verdict] | None) -> bool:
        """Whether requests of ``key`` other than ``fut`` still wait (``fut`` is dropped)."""
        left = [f for f in self._waiters.get(key, []) if f is not fut and not f.done()]
        if left:
            self._waiters[key] = left
            return True
        self._waiters.pop(key, None)
        return False

    def grant(self, key: str, verdict: Granted) -> None:
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(verdict)

    def refuse(self, key: str, verdict: Refused) -> bool:
        """Answer ``key``'s waiting requests; True when some did wait (count the refusal)."""
        futs = [f for f in self._waiters.pop(key, []) if not f.done()]
        if not futs and key in self._arriving:
            # Refused while its own request was still on the way to waiting: it takes this.
            self._unclaimed.setdefault(key, verdict)
            return False
        for fut in futs:
            fut.set_result(verdict)
        return bool(futs)

    def waiting(self) -> list[str]:
        """Sessions with requests waiting."""
        return list(self._waiters)
