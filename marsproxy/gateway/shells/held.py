"""Requests held for admission: a future per waiting request, answered when its session is
admitted or refused.

A refusal can come while the session's own request is still on its way to waiting (between
the plane's answer and the wait): it is kept for that request (its session's incarnation:
``arrived`` hands it over) instead of lost, and never goes to a later session of the same id.
A session's waiting requests are answered as the plane decides its end, before any await
(``StoreConfirmations._answer``), so those of a key are always its live session's.
"""

from __future__ import annotations

import asyncio

from marsproxy.gateway.shells.admission_types import Granted, Refused, Verdict


class HeldRequests:
    def __init__(self) -> None:
        self._waiters: dict[str, list[asyncio.Future[Verdict]]] = {}
        # Refusals that found no waiter yet, per session (key, incarnation) on its way.
        self._unclaimed: dict[tuple[str, int | None], Refused] = {}
        # Requests between the plane's answer and waiting, per key and incarnation.
        self._arriving: dict[str, dict[int | None, int]] = {}

    # A pair of calls (try/finally at the caller), not a context manager: it runs on every
    # new session's request, where contextlib's generator cost more than the bookkeeping.
    def arriving(self, key: str, incarnation: int | None) -> None:
        """A request of ``key`` (session ``incarnation``) is on its way to waiting (a refusal
        meanwhile is its); the caller calls :meth:`arrived` when it is there (or gone)."""
        on_way = self._arriving.setdefault(key, {})
        on_way[incarnation] = on_way.get(incarnation, 0) + 1

    def arrived(self, key: str, incarnation: int | None) -> Refused | None:
        """It is there (or gone): the refusal its session got meanwhile, if any (taken by the
        first of its requests to arrive)."""
        on_way = self._arriving[key]
        if left := on_way[incarnation] - 1:
            on_way[incarnation] = left
        else:
            del on_way[incarnation]
            if not on_way:
                del self._arriving[key]
        return self._unclaimed.pop((key, incarnation), None)

    def expects(self, key: str) -> bool:
        """Whether a refusal of ``key`` would reach a request (waiting, or on its way)."""
        return key in self._waiters or key in self._arriving

    def future(self, key: str) -> asyncio.Future[Verdict]:
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        return fut

    def others(self, key: str, fut: asyncio.Future[Verdict] | None,
               incarnation: int | None) -> bool:
        """Whether requests of session ``incarnation`` of ``key`` other than ``fut`` still
        wait or are on their way (``fut`` is dropped; ``None``: the one gone was on its way)."""
        left = [f for f in self._waiters.get(key, []) if f is not fut and not f.done()]
        if left:
            self._waiters[key] = left
            return True
        self._waiters.pop(key, None)
        on_way = self._arriving.get(key, {}).get(incarnation, 0)
        return on_way > (1 if fut is None else 0)

    def grant(self, key: str, verdict: Granted) -> None:
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(verdict)

    def refuse(self, key: str, verdict: Refused) -> bool:
        """Answer ``key``'s waiting requests; True when some did wait (count the refusal)."""
        futs = [f for f in self._waiters.pop(key, []) if not f.done()]
        if not futs and key in self._arriving:
            # Refused while its own request was still on the way to waiting: it takes this.
            for incarnation in self._arriving[key]:
                self._unclaimed.setdefault((key, incarnation), verdict)
            return False
        for fut in futs:
            fut.set_result(verdict)
        return bool(futs)

    def waiting(self) -> list[str]:
        """Sessions with requests waiting."""
        return list(self._waiters)
