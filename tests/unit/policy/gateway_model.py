"""A model of the gateway around a bare ``ControlPlane``: the calls its shells make, in their order.

What ``test_plane_properties.py`` drives. One replica with the in-memory store (a proposal is
confirmed at the next carry, as ``StoreConfirmations._carry_now`` does), the real session table
(``ObservedSessions``: final turns, idle expiry and ``DELETE`` end sessions through
``Gateway.session_over``), placement pinned at admission with failover to a healthy worker, and
each request's path as ``gateway/http/relay.py`` walks it:

- ``request``: the table's turn and ``request_arrived`` (the tool tracker), a tick first when
  nothing is known yet (``wants_tick``), ``plane.request``, the carry; then granted (the plane
  holds its slot), refused, or held until a carry confirms or refuses it;
- ``proceed``: a granted request is scheduled (``SchedulerShell.prepare``: ``call_start`` and a
  release on its worker), or its client leaves first (``served_nothing``), or no healthy worker
  is left (the relay's 503, then ``call_end`` with no ticket);
- ``finish``: the call ends, well or not (``Gateway.call_ended``), then the table's finish
  (a final turn ends the session) and ``response_ended``;
- ``leave``: a client leaves while held for admission (``AdmissionShell._abandon``) or in the
  dispatch gate (``plane.cancel``, then the call's end with no ticket);
- ``tick``: time passes: the admission shell's timer at each KV hold's end while sessions wait
  (``expire_now``), the admission tick, the scheduler's tick, a held call's release timer, the
  table's idle expiry;
- ``delete``: ``DELETE /mars/v1/sessions/{id}`` at any moment (its id may be reused at once,
  while calls of the ended session still run: they end as that session's, not the new one's);
- ``lost``: the store lost a session's lease (``AdmissionShell.tick``: another replica took it).

Pure test code: it only calls the plane and the table, in virtual time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marsproxy.aimd.admission import DecisionKind
from marsproxy.config import load_config
from marsproxy.core.answers import ReplyKind
from marsproxy.core.sessions import Session, Turn
from marsproxy.gateway.shells.admission_types import END_REASONS
from marsproxy.gateway.shells.sessions import EndReason as TableReason
from marsproxy.gateway.shells.sessions import ObservedSessions
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import ControlPlane, Outcome, Phase
from marsproxy.sched.tickets import Ticket

TENANT = "anon"
TABLE_TTL_S = 120.0  # sessions.idle_ttl_s: short, so that the table's expiry shows up


@dataclass(eq=False)
class Req:
    key: str
    turn: Turn
    final: bool
    gen: int  # the incarnation of its session (a key may start anew after its session ended)
    state: str = "held"  # held, granted, gated, running, done
    ticket: Ticket | None = None
    admitted: bool = False
    incarnation: int | None = None  # the plane's (Answer.incarnation, as Granted carries it)


@dataclass
class Worker:
    healthy: bool = True
    stale: bool = False
    kv_usage: float = 0.0


@dataclass
class GatewayModel:
    policy: str
    n_workers: int
    gated: bool = True  # the workers' mode: the proxy's gate, or the engine's priority
    now: float = 0.0
    reqs: list[Req] = field(default_factory=list)
    gens: dict[str, int] = field(default_factory=dict)
    placed: dict[str, str] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [f"w{i}" for i in range(self.n_workers)]
        cfg = load_config(None, environ={}, overrides={
            "policy": self.policy,
            "workers": [{"url": f"http://127.0.0.1:{9 + i}", "name": n}
                        for i, n in enumerate(names)],
            "admission": {"tuning": {"kv_hold_min_s": 1.0}},
            "sessions": {"idle_ttl_s": TABLE_TTL_S},
        })
        self.plane = ControlPlane(cfg, names, tool_cpus=2.0)
        for n in names:
            self.plane.scheduler.set_mode(n, "gated" if self.gated else "priority")
        self.workers = {n: Worker() for n in names}
        self.table = ObservedSessions(idle_ttl_s=TABLE_TTL_S, max_sessions=100_000,
                                      on_forget=lambda k: self.placed.pop(k, None),
                                      on_end=self._table_ended)

    # -- what the plane hears of the workers -------------------------------------------------
    def observed(self) -> dict[str, WorkerObservation]:
        return {n: WorkerObservation(
            healthy=w.healthy, stale=w.stale, kv_usage=w.kv_usage, total_blocks=256,
            block_size=16, running=self.plane.scheduler.in_flight(n), preemptions_total=0.0,
            prefill_tokens_per_s=5000.0, sampled_at=self.now, max_num_seqs=2)
            for n, w in self.workers.items()}

    def healthy(self) -> list[str]:
        return [n for n, w in self.workers.items() if w.healthy]

    # -- carrying out (StoreConfirmations._carry_now, the in-memory store) -------------------
    def carry(self, out: Outcome) -> None:
        for e in out.expired:
            self._refuse(e.session)
        for e in out.ended:
            self._refuse(e.session)
        for key, _ in self.plane.pending():
            if self.plane.confirm(self.now, key) is not None:
                for r in self._of(key, "held"):
                    r.state, r.admitted = "granted", True

    def _refuse(self, key: str) -> None:
        for r in self._of(key, "held"):
            self._done(r, ok=False)

    def _of(self, key: str, state: str) -> list[Req]:
        return [r for r in self.reqs if r.key == key and r.state == state]

    def _done(self, r: Req, *, ok: bool, answered: bool = False) -> None:
        r.state = "done"
        self.table.finish(r.turn, ok=ok, reply=None, now=self.now)
        sess = self.table.of(r.turn)
        if ok and not answered and sess is not None and not sess.in_flight:
            self.plane.tracker.response_ended(r.key, self.now)  # Gateway.response_ended

    def _table_ended(self, sess: Session, reason: TableReason, _d: float,
                     _s: float | None) -> None:
        out = self.plane.session_end(self.now, sess.key, END_REASONS[reason])
        self.carry(out)

    def _running(self, released: list[Ticket]) -> None:
        calls = {t.call for t in released}
        for r in self.reqs:
            if r.state == "gated" and r.ticket is not None and r.ticket.call in calls:
                r.state = "running"

    # -- a request arrives -------------------------------------------------------------------
    def request(self, key: str, *, final: bool, chars: int, parent: str | None) -> Req:
        turn = self.table.start(tenant=TENANT, explicit_id=key.split("/id/")[1],
                                history=None, final=final, now=self.now)
        self.plane.tracker.request_started(key, self.now)  # Gateway.request_arrived
        if self.plane.phase(key) is Phase.ENDED:
            self.gens[key] = self.gens.get(key, 0) + 1
        r = Req(key, turn, final, self.gens.get(key, 0))
        self.reqs.append(r)
        if not self.healthy():  # no admission: the relay's 503, a call end without a ticket
            self._no_worker(r)
            return r
        p = self.plane
        if not p.cfg.admission.enabled:
            ans = p.request(self.now, key, TENANT, chars=chars, final=final, parent=parent)
            r.incarnation = ans.incarnation
            if ans.kind is DecisionKind.ADMITTED and ans.worker is not None:
                self._granted(r, ans.worker)
            else:
                self._done(r, ok=False)
            return r
        if p.wants_tick(key):
            self.carry(p.tick(self.now, self.observed(), at=self.now, cpu=None))
        ans = p.request(self.now, key, TENANT, chars=chars, final=final, parent=parent)
        r.incarnation = ans.incarnation
        if ans.kind is DecisionKind.REJECT:
            self.carry(ans.outcome)
            self._done(r, ok=False)
            return r
        refused = {e.session for e in ans.outcome.expired} | {
            e.session for e in ans.outcome.ended}
        self.carry(ans.outcome)  # held.arriving: a refusal meanwhile is this request's
        worker = p.held(key)
        if r.state != "held":
            return r
        if worker is not None:
            self._granted(r, worker)
        elif key in refused or p.admission.sessions.get(key) is None:
            self._done(r, ok=False)
        return r

    def _granted(self, r: Req, worker: str) -> None:
        r.state, r.admitted = "granted", True
        if self.workers[worker].healthy:  # Gateway.admitted_to
            self.placed[r.key] = worker

    def _no_worker(self, r: Req) -> None:
        self.plane.call_end(self.now, r.key, None, incarnation=r.incarnation, ok=False,
                            admitted=r.admitted, prompt_tokens=None, continues=self._goes_on(r))
        self._done(r, ok=False)

    def _goes_on(self, r: Req) -> bool:
        return not r.final and self.table.of(r.turn) is not None

    # -- the admitted request goes (SchedulerShell.prepare) ----------------------------------
    def proceed(self, r: Req, *, leave: bool, chars: int, gate: bool) -> None:
        p = self.plane
        if leave:  # AdmissionShell._abandon: admitted as its client left, served nothing
            end = p.call_end(self.now, r.key, None, incarnation=r.incarnation, ok=False,
                             admitted=True, prompt_tokens=None)
            self.carry(end.outcome)
            self._done(r, ok=False)
            return
        worker = self.placed.get(r.key)
        if worker is None or not self.workers[worker].healthy:  # placement's failover
            healthy = self.healthy()
            if not healthy:
                self._no_worker(r)
                return
            worker = self.placed[r.key] = min(
                healthy, key=lambda w: sum(1 for v in self.placed.values() if v == w))
        t = p.call_start(self.now, r.key, worker, chars=chars, gate=gate)
        r.ticket, r.state = t, "running"
        if t is not None and t.gated:
            r.state = "gated"
            self._running(p.release(self.now, [worker]))

    def leave_gate(self, r: Req) -> None:
        assert r.ticket is not None
        self._running(self.plane.cancel(self.now, r.ticket))
        self._finish(r, None, ok=False, reply=None)

    def leave_held(self, r: Req) -> None:
        """AdmissionShell._abandon with its future cancelled before any grant."""
        r.state = "left"
        p = self.plane
        if self._of(r.key, "held"):  # others wait for the same session: this one goes
            p.waiter_left(r.key)
        elif p.held(r.key) is not None:
            pass  # it holds its slot already (the shell's race with a grant)
        elif p.admission.sessions.get(r.key) is not None:
            self.carry(p.withdraw(self.now, r.key))
        self._done(r, ok=False)

    def finish(self, r: Req, *, ok: bool, reply: ReplyKind | None, moved: bool) -> None:
        t = r.ticket
        if moved and t is not None and len(self.workers) > 1:  # failover after a refused connect
            self.plane.scheduler.moved(t.call, next(w for w in self.workers if w != t.worker))
        self._finish(r, t, ok=ok, reply=reply)

    def _finish(self, r: Req, t: Ticket | None, *, ok: bool, reply: ReplyKind | None) -> None:
        end = self.plane.call_end(
            self.now, r.key, t, incarnation=r.incarnation, ok=ok, admitted=r.admitted,
            prompt_tokens=300 if ok else None, completion_tokens=40 if ok else 0,
            cached_tokens=100 if ok else 0, chars=1200, engine_s=0.5,
            continues=self._goes_on(r), reply=reply if ok else None)
        self._running(end.released)
        self.carry(end.outcome)
        self._done(r, ok=ok, answered=end.answered)

    # -- time, health, the admin API -----------------------------------------------------------
    def tick(self, dt: float) -> None:
        p, end = self.plane, self.now + dt
        while (at := p.next_deadline()) is not None and at <= end:  # AdmissionShell.expire_now
            self.now = max(self.now, at)
            self.carry(p.expire(self.now))
        self.now = end
        self.carry(p.tick(self.now, self.observed(), at=self.now, cpu=None))
        self._running(p.sched_tick(self.now, self.observed())[1])
        p.kv_events.clear()  # SchedulerShell.kv_facts publishes them
        at = p.scheduler.next_release_at()
        if at is not None and at <= self.now:  # SchedulerShell.release_now
            self._running(p.release(self.now))
        self.table.expire(self.now)

    def delete(self, key: str) -> None:
        self.table.end(key, self.now)

    def lost(self, key: str) -> None:
        worker = self.plane.held(key)
        if worker is not None:
            self.carry(self.plane.lost(self.now, key, worker))

    def live(self, state: str) -> list[Req]:
        return [r for r in self.reqs if r.state == state]
