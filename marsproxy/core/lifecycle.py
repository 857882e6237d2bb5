"""Session lifecycle for admission: QUEUED → ADMITTED (LLM and TOOL phases) → ENDED.

A session's first request waits in the admission queue (QUEUED). Once admitted on a worker it
holds a slot there in its calls and tool phases (freed between calls, others would push its
prefix out of the KV cache) until dormant past its KV hold, or done after one call where its
tenant's sessions never return; back, it is served at once. It ends on its final request, a
delete, or idle past a timeout scaled by its usual tool time. Pure code: no I/O.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator

from marsproxy.core.returns import ReturnTally
from marsproxy.core.session_record import (
    EndReason,
    LifecycleError,
    Phase,
    SessionRecord,
    SessionState,
)
from marsproxy.core.timeouts import idle_timeout_s, kv_hold_s


class SessionLifecycle:
    """The live sessions of the admission plane, and the counts per worker."""

    def __init__(self, idle_factor: float, idle_min_s: float, idle_max_s: float,
                 hold_min_s: float = 0.0, *, return_history: int, one_shot_crowd: int,
                 hold_reprefill_factor: float) -> None:
        self._idle_args = (idle_factor, idle_min_s, idle_max_s)
        self._hold_min_s = hold_min_s
        self._hold_reprefill_factor = hold_reprefill_factor
        self.returns = ReturnTally(return_history, one_shot_crowd)
        # (hold deadline, key) of dormant sessions whose KV budget is held (or watched), sorted.
        self._holds: list[tuple[float, str]] = []
        self._records: dict[str, SessionRecord] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._long_by_worker: dict[str, int] = {}
        self._held_by_worker: dict[str, int] = {}  # admitted sessions whose KV is held
        self._watched_by_worker: dict[str, int] = {}  # slots held without KV room (watched)
        self._lapsed_by_worker: dict[str, int] = {}  # of them, past a KV hold cut short
        # Per worker: admitted sessions with a request in flight, and a max-heap of when the
        # others went dormant ((-last_active, key); stale entries dropped when read), so that
        # neither question walks every session (a plain client's may number thousands).
        self._active_by_worker: dict[str, int] = {}
        self._dormant: dict[str, list[tuple[float, str]]] = {}
        # (idle deadline, key) of admitted sessions with nothing in flight, sorted, so a tick
        # finds the timed-out ones without scanning every session.
        self._idle: list[tuple[float, str]] = []
        self._placed: dict[str, int] = {}  # worker → sessions placed there so far
        self._incarnations = itertools.count(1)  # SessionRecord.incarnation

    # -- queries ----------------------------------------------------------------------------
    def get(self, key: str) -> SessionRecord | None:
        return self._records.get(key)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(self._records.values())

    def admitted_on(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def active_on(self, worker: str) -> int:
        """Sessions admitted on ``worker`` with a request in flight (in an LLM call)."""
        return self._active_by_worker.get(worker, 0)

    def dormant_since(self, worker: str) -> float | None:
        """When the last of the sessions admitted on ``worker`` went into its tool phase;
        ``None`` while any of them has a request in flight, or none is admitted there."""
        if not self._by_worker.get(worker) or self._active_by_worker.get(worker, 0):
            return None
        heap = self._dormant[worker]
        while heap:
            neg, key = heap[0]
            rec = self._records.get(key)
            # Only admitted sessions have a worker; an ended one is gone from the records.
            if (rec is not None and rec.worker == worker and rec.in_flight == 0
                    and rec.last_active == -neg):
                return max(0.0, -neg)
            heapq.heappop(heap)  # it went back to work, moved or ended since
        raise AssertionError(f"dormant sessions on {worker} missing from their index")

    def placed_on(self, worker: str) -> int:
        """Sessions placed on ``worker`` so far (a move counts on its target only): equally
        loaded workers take turns by it, as round robin spreads sessions without a proxy."""
        return self._placed.get(worker, 0)

    def spread_key(self, worker: str) -> tuple[int, int]:
        """Where a new session goes without admission control, least first."""
        return self.held_on(worker), self.placed_on(worker)

    def _place(self, worker: str, sign: int = 1) -> None:
        self._placed[worker] = self._placed.get(worker, 0) + sign

    def long_on(self, worker: str) -> int:
        return self._long_by_worker.get(worker, 0)

    def held_on(self, worker: str) -> int:
        """Sessions admitted on ``worker`` that hold KV room: in a call, or dormant and held."""
        return self._held_by_worker.get(worker, 0)

    def slotless_on(self, worker: str) -> int:
        """Sessions admitted on ``worker`` that hold no slot (outside :meth:`load_on`)."""
        return self.admitted_on(worker) - self.load_on(worker)

    def lapsed_on(self, worker: str) -> int:
        """Sessions holding a slot on ``worker`` past a KV hold cut short (``lapsed``): quiet
        longer than their tools usually take, they hold neither KV room nor a tool."""
        return self._lapsed_by_worker.get(worker, 0)

    def load_on(self, worker: str) -> int:
        """Sessions that hold a slot: in a call, dormant within their hold, or held without
        room (``watched``). What the window counts and placement balances."""
        return self._held_by_worker.get(worker, 0) + self._watched_by_worker.get(worker, 0)

    def sessions_on(self, worker: str) -> list[str]:
        return sorted(self._by_worker.get(worker, ()))

    # -- transitions --------------------------------------------------------------------------
    def queue(self, now: float, key: str, tenant: str, est_tokens: int, long: bool,
              final: bool = False) -> SessionRecord:
        """A new session's first request arrives and waits."""
        if key in self._records:
            raise LifecycleError(f"session {key!r} already exists")
        rec = SessionRecord(key, tenant, SessionState.QUEUED, now, est_tokens, long,
                            last_active=now, in_flight=1, final=final,
                            incarnation=next(self._incarnations))
        self._records[key] = rec
        return rec

    def add_waiter(self, key: str, final: bool = False) -> SessionRecord:
        """Another request of a session that is still queued: it waits for the same slot."""
        rec = self._require(key, SessionState.QUEUED)
        rec.in_flight += 1
        rec.final = rec.final or final
        return rec

    def remove_waiter(self, key: str) -> None:
        """One of several requests waiting for the session's slot went (its client left): it
        stops counting; the others still wait (the count never drops below one)."""
        rec = self._records.get(key)
        if rec is not None and rec.in_flight > 1:
            rec.in_flight -= 1

    def admit(self, now: float, key: str, worker: str) -> SessionRecord:
        rec = self._require(key, SessionState.QUEUED)
        rec.state = SessionState.ADMITTED
        rec.worker = worker
        rec.admitted_at = now
        rec.last_active = now
        rec.phase = Phase.LLM
        rec.turns += rec.in_flight
        self._count(rec, +1)
        self._place(worker)
        return rec

    def adopt(self, now: float, key: str, tenant: str, worker: str, est_tokens: int, long: bool,
              *, final: bool = False, turns: int = 0) -> SessionRecord:
        """A session admitted elsewhere (another replica) arrives with a request: it holds a
        live lease on ``worker`` already, so it is ADMITTED at once, never QUEUED."""
        if key in self._records:
            raise LifecycleError(f"session {key!r} already exists")
        rec = SessionRecord(key, tenant, SessionState.ADMITTED, now, est_tokens, long,
                            worker=worker, admitted_at=now, last_active=now, in_flight=1,
                            final=final, turns=turns + 1,
                            incarnation=next(self._incarnations))
        self._records[key] = rec
        self._count(rec, +1)
        self._place(worker)
        return rec

    def move(self, key: str, worker: str) -> SessionRecord:
        """An admitted session goes to another worker before any request of it was served."""
        rec = self._require(key, SessionState.ADMITTED)
        self._count(rec, -1)
        assert rec.worker is not None
        self._place(rec.worker, -1)
        rec.worker = worker
        self._count(rec, +1)
        self._place(worker)
        return rec

    def _count(self, rec: SessionRecord, sign: int) -> None:
        assert rec.worker is not None
        if sign > 0:
            self._by_worker.setdefault(rec.worker, set()).add(rec.key)
        else:
            self._by_worker[rec.worker].discard(rec.key)
        if rec.long:
            self._long_by_worker[rec.worker] = self._long_by_worker.get(rec.worker, 0) + sign
        if rec.kv_held:
            self._held(rec, sign)
        elif rec.watched:
            self._watched(rec, sign)
        self._activity(rec, sign)

    def _activity(self, rec: SessionRecord, sign: int) -> None:
        """Count an admitted session in (+1) or out of (-1) its worker's activity index, as it
        is now: in flight, or dormant since ``last_active``."""
        assert rec.worker is not None
        w = rec.worker
        if rec.in_flight > 0:
            self._active_by_worker[w] = self._active_by_worker.get(w, 0) + sign
            return
        if sign < 0:
            return  # its heap entry goes stale; dropped when read, or at the next rebuild
        heap = self._dormant.setdefault(w, [])
        heapq.heappush(heap, (-rec.last_active, rec.key))
        if len(heap) > 2 * len(self._by_worker.get(w, ())) + 64:  # too many stale entries
            self._dormant[w] = heap = [
                (-r.last_active, k) for k in self._by_worker.get(w, ())
                if (r := self._records[k]).in_flight == 0]
            heapq.heapify(heap)

    def _held(self, rec: SessionRecord, sign: int) -> None:
        assert rec.worker is not None
        self._held_by_worker[rec.worker] = self._held_by_worker.get(rec.worker, 0) + sign

    def _watched(self, rec: SessionRecord, sign: int) -> None:
        assert rec.worker is not None
        self._watched_by_worker[rec.worker] = self._watched_by_worker.get(rec.worker, 0) + sign
        if rec.lapsed:
            self._lapsed_by_worker[rec.worker] = self._lapsed_by_worker.get(rec.worker, 0) + sign

    def request(self, now: float, key: str, final: bool = False) -> SessionRecord:
        """A continuation of an admitted session: served at once, never held by the window."""
        rec = self._require(key, SessionState.ADMITTED)
        self._unidle(rec)
        self._unhold(rec)
        if rec.first_gap:  # back within its hold (or its idle timeout, where that is shorter)
            self._end_gap(rec, came_back=True)
        self._unwatch(rec)
        rec.slot_until = None
        if not rec.kv_held:
            rec.kv_held = True
            self._held(rec, +1)
        self._activity(rec, -1)
        rec.in_flight += 1
        rec.turns += 1
        rec.phase = Phase.LLM
        rec.last_active = now
        rec.final = rec.final or final
        self._activity(rec, +1)
        return rec

    def response_end(self, now: float, key: str, usual_tool_s: float | None,
                     reprefill_s: float | None = None) -> SessionRecord:
        """A request of an admitted session finished (well or not); a tool phase may begin.
        ``reprefill_s``: what rebuilding its context would take its worker (``None``: unknown)."""
        rec = self._require(key, SessionState.ADMITTED)
        self._activity(rec, -1)
        rec.in_flight = max(0, rec.in_flight - 1)
        rec.last_active = now
        self._activity(rec, +1)
        if rec.in_flight == 0:
            rec.phase = Phase.TOOL
            rec.idle_timeout_s = idle_timeout_s(usual_tool_s, *self._idle_args)
            self._unidle(rec)
            rec.idle_key = (rec.last_active + rec.idle_timeout_s, key)
            bisect.insort(self._idle, rec.idle_key)
            args = (usual_tool_s, self._idle_args[0], self._hold_min_s, rec.idle_timeout_s)
            slot = kv_hold_s(*args)  # the slot (its load): as if its prefix were dear
            hold = kv_hold_s(*args, reprefill_s, self._hold_reprefill_factor)
            rec.slot_until = rec.last_active + slot if slot > hold else None
            self._unhold(rec)
            if hold < rec.idle_timeout_s:  # else the idle timeout ends it first
                rec.hold_key = (rec.last_active + hold, key)
                bisect.insort(self._holds, rec.hold_key)
            if rec.turns == 1 and not rec.final:  # held only where its kind comes back
                rec.first_gap = True
                self.returns.gap_opened(rec.tenant)
                if rec.kv_held and not self.returns.likely(rec.tenant):
                    # Its hold deadline stays, to see whether it returns; its slot too,
                    # unless its tenant's sessions are known not to.
                    self._release(rec, keep_slot=not self.returns.one_shot(rec.tenant))
        return rec

    def end(self, now: float, key: str, reason: EndReason) -> SessionRecord | None:
        """The session ends (whatever its state); ``None`` if it was unknown or already gone."""
        rec = self._records.pop(key, None)
        if rec is None:
            return None
        self._unidle(rec)
        self._unhold(rec)
        if rec.state is SessionState.ADMITTED and rec.worker is not None:
            self._count(rec, -1)
        if rec.first_gap:  # a move says nothing of whether it came back
            rec.first_gap = False
            self.returns.gap_closed(rec.tenant)
            if reason is not EndReason.MOVED:
                self.returns.record(rec.tenant, False)
        rec.state = SessionState.ENDED
        rec.end_reason = reason
        rec.last_active = max(rec.last_active, now)
        return rec

    def idle_expired(self, now: float) -> list[SessionRecord]:
        """Admitted sessions idle past their timeout (still live; the caller ends them)."""
        end = bisect.bisect_right(self._idle, now, key=lambda k: k[0])
        return [self._records[key] for _, key in self._idle[:end]]

    def hold_expired(self, now: float) -> list[SessionRecord]:
        """Dormant sessions past their KV hold, each without KV room now (its forecast stops
        counting until its next request) and without a slot unless it keeps one until
        ``slot_until``; a first gap among them did not come back in time (one watched loses
        its slot). A watched session past ``slot_until`` loses its slot (not returned)."""
        end = bisect.bisect_right(self._holds, now, key=lambda k: k[0])
        due = [self._records[key] for _, key in self._holds[:end]]
        del self._holds[:end]
        for rec in due:
            rec.hold_key = None
            if rec.first_gap:
                self._end_gap(rec, came_back=False)
            slot, rec.slot_until = rec.slot_until, None
            if rec.kv_held and slot is not None and slot > now:
                self._release(rec, keep_slot=True, lapsed=True)
                rec.hold_key = (slot, rec.key)
                bisect.insort(self._holds, rec.hold_key)
            elif rec.kv_held:
                self._release(rec, keep_slot=False)
            else:
                self._unwatch(rec)
        return due

    def next_hold_end(self) -> float | None:
        """When the first KV hold (or slot kept past one) ends; ``None``: none runs."""
        return self._holds[0][0] if self._holds else None

    def release_hold(self, key: str) -> bool:
        """End a dormant session's KV hold before its deadline (it waits on its children);
        False when it is not dormant, or its hold is over already."""
        rec = self._records.get(key)
        if (rec is None or rec.state is not SessionState.ADMITTED or rec.in_flight > 0
                or not rec.kv_held or rec.worker is None):
            return False
        self._unhold(rec)
        self._release(rec, keep_slot=True)  # it is coming back
        return True

    def _release(self, rec: SessionRecord, *, keep_slot: bool, lapsed: bool = False) -> None:
        """Its forecast stops counting; ``keep_slot``: it still counts in ``load_on``
        (``lapsed``: past its KV hold)."""
        rec.kv_held = False
        self._held(rec, -1)
        if keep_slot:
            rec.watched, rec.lapsed = True, lapsed
            self._watched(rec, +1)

    def _unwatch(self, rec: SessionRecord) -> None:
        if rec.watched:
            rec.watched = False
            self._watched(rec, -1)
            rec.lapsed = False

    def _end_gap(self, rec: SessionRecord, came_back: bool) -> None:
        rec.first_gap = False  # it came back, or its hold deadline passed
        self.returns.gap_closed(rec.tenant)
        self.returns.record(rec.tenant, came_back)
        self._unwatch(rec)

    def _unhold(self, rec: SessionRecord) -> None:
        if rec.hold_key is None:
            return
        i = bisect.bisect_left(self._holds, rec.hold_key)
        if i < len(self._holds) and self._holds[i] == rec.hold_key:
            del self._holds[i]
        rec.hold_key = None

    def _unidle(self, rec: SessionRecord) -> None:
        if rec.idle_key is None:
            return
        i = bisect.bisect_left(self._idle, rec.idle_key)
        if i < len(self._idle) and self._idle[i] == rec.idle_key:
            del self._idle[i]
        rec.idle_key = None

    def _require(self, key: str, state: SessionState) -> SessionRecord:
        rec = self._records.get(key)
        if rec is None:
            raise LifecycleError(f"session {key!r} is unknown")
        if rec.state is not state:
            raise LifecycleError(f"session {key!r} is {rec.state}, not {state}")
        return rec
