"""What one replica shares with the others through the window store: session records.

Every confirmed session has a record in the store (worker, token counts, attained service,
tool-time estimate). A request of a session this replica does not know loads it and, while its
lease is live, *claims* the lease and *adopts* the session on the same worker (never queued,
not a new admission); the replica that held it finds the lease gone at its next heartbeat and
forgets its copy. Sessions identified by history chaining are per replica (their index is
local): their store keys carry the replica id, so replicas never mix them up, and they are
never adopted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from marsproxy.aimd.stores import WindowStore, wall_clock_ms
from marsproxy.core.replies import reply_key
from marsproxy.policy.plane import ControlPlane
from marsproxy.probes.tool_phases import ToolPhaseTracker

log = logging.getLogger("marsproxy.gateway.shells.admission")


@dataclass(frozen=True, slots=True)
class ReplyLink:
    """A request continues a reply (``previous_response_id``): the session that got it (this
    replica's key; ``None``: not known any more) and the worker that made it, the only one that
    keeps it (``None``: unknown)."""

    key: str | None
    worker: str | None


class Replicas:
    def __init__(self, plane: ControlPlane, store: WindowStore, tracker: ToolPhaseTracker,
                 in_key_order: Callable[[str, Callable[[], Awaitable[None]]], None],
                 now: Callable[[], float]) -> None:
        self.plane, self.store, self.tracker = plane, store, tracker
        self._in_key_order, self._now = in_key_order, now
        # Store key -> the newest record of it not sent yet (its save waits its turn).
        self._unsent: dict[str, dict[str, Any]] = {}
        # Carried in the session record: tokens served (attained service) and the tool-time
        # estimate of a session adopted from another replica (this one has no history of it).
        self.attained: dict[str, int] = {}
        self._carried_tool_s: dict[str, float] = {}
        # Tenant counters live in the store too: the admission queue keeps its charges for it.
        self.shares = plane.admission.queue.shares
        self.shares.shared = self.on

    @staticmethod
    def shared(key: str) -> bool:
        """Whether ``key`` names the session on every replica (an explicit id)."""
        return key.split("/", 2)[1:2] == ["id"]

    def store_key(self, key: str) -> str:
        # Chain and anonymous ids are counters of this replica's table: scope them to it. One
        # joined through another replica's reply id is kept under that replica's store key.
        if self.shared(key) or "@" in key:
            return key
        return f"{key}@{self.store.replica_id}"

    def core_key(self, skey: str) -> str:
        return skey.removesuffix(f"@{self.store.replica_id}")

    @property
    def on(self) -> bool:
        # One replica on the in-process store: nobody else could read a record.
        return self.store.mode != "memory"

    def carried_tool_s(self, key: str) -> float | None:
        """The usual tool time another replica knew of an adopted session (``None``: none)."""
        return self._carried_tool_s.get(key)

    def usual_tool_s(self, key: str) -> float | None:
        usual = self.tracker.predicted_duration(key)
        return usual if usual is not None else self._carried_tool_s.get(key)

    def served(self, key: str, tokens: int) -> None:
        if self.plane.held(key) is not None:
            self.attained[key] = self.attained.get(key, 0) + tokens

    def forget(self, key: str) -> None:
        self.attained.pop(key, None)
        self._carried_tool_s.pop(key, None)

    def counters(self) -> dict[str, float]:
        """The tenants' shared virtual token counters, as this replica last read them."""
        return self.shares.counters()

    async def exchange_counters(self) -> bool:
        """Send this replica's tenant charges to the store and take in every replica's: one
        round trip per control tick. Store away: the charges wait, the local counters carry
        on alone (False)."""
        sent = self.shares.take_charges()
        got = await self.store.exchange_counters(sent)
        if got is None:
            self.shares.restore(sent)
            return False
        self.shares.sync(got, sent)
        return True

    async def parent_elsewhere(self, parent: str | None) -> bool:
        """Whether ``parent``, unknown here, is a session admitted on another replica: its
        record is in the store (agent trees across replicas)."""
        if (parent is None or not self.on or not self.shared(parent)
                or not self.plane.cfg.sessions.trees
                or self.plane.admission.sessions.get(parent) is not None):
            return False
        return await self.store.load_session(self.store_key(parent)) is not None

    def save(self, key: str) -> None:
        if not self.on:
            return
        rec = self.plane.admission.sessions.get(key)
        worker = self.plane.held(key)
        if rec is None or worker is None:
            return
        record: dict[str, Any] = {
            "worker": worker,
            "tenant": rec.tenant,
            "turns": rec.turns,
            "est_tokens": rec.est_tokens,
            "correction": self.plane.estimator.correction(key),
            "attained_tokens": self.attained.get(key, 0),
            "usual_tool_s": self.usual_tool_s(key),
            "idle_timeout_s": rec.idle_timeout_s,
            "replica": self.store.replica_id,
        }
        # After the key's earlier store calls, as the shell orders them: an ended session's
        # record lands before its end deletes it, so before the id's next session is granted,
        # and no record lands over a newer one. Saves issued while one waits keep the newest.
        skey = self.store_key(key)
        waiting = skey in self._unsent
        self._unsent[skey] = record
        if not waiting:
            self._in_key_order(skey, lambda: self._send(skey))

    async def _send(self, skey: str) -> None:
        record = self._unsent.pop(skey, None)
        if record is not None:
            await self.store.save_session(skey, record)

    async def adopt(self, key: str, tenant: str, chars: int, final: bool,
                    by_reply: bool = False) -> str | None:
        """A session another replica admitted: claim its lease, serve it on its worker;
        returns the worker (``None``: nothing to adopt). ``by_reply``: the request names a
        reply id of the session (any session may have gone to another replica since)."""
        if not self.on or not (by_reply or self.shared(key)):
            return None
        skey = self.store_key(key)
        rec = await self.store.load_session(skey)
        core = self.plane.admission
        if rec is None or core.sessions.get(key) is not None:
            return None
        worker = rec.get("worker")
        correction = rec.get("correction")
        if isinstance(correction, int | float):
            self.plane.estimator.restore(key, float(correction))
        if worker not in core.workers or not await self.store.claim(worker, skey,
                                                                    wall_clock_ms()):
            return None  # its lease is gone (ended, expired): it queues like a new session
        if core.sessions.get(key) is not None:
            return None  # another request of it got here first: it is a continuation now
        self.plane.adopt(self._now(), key, tenant, worker, chars=chars, final=final,
                         turns=int(rec.get("turns", 0)), correction=None)
        self.attained[key] = int(rec.get("attained_tokens", 0))
        usual = rec.get("usual_tool_s")
        if isinstance(usual, int | float):
            self._carried_tool_s[key] = float(usual)
        log.debug("adopted session %s on %s from replica %s", key, worker, rec.get("replica"))
        return str(worker)

    def publish_reply(self, tenant: str, response_id: str, key: str, worker: str) -> None:
        """``key``'s call got the reply ``response_id`` from ``worker``: a next call naming it
        may reach another replica, which finds the session and the worker by it (sent in the
        key's store-call order)."""
        if not self.on:
            return
        skey, reply = self.store_key(key), reply_key(tenant, response_id)
        value = json.dumps({"session": skey, "worker": worker}, separators=(",", ":"))
        self._in_key_order(skey, lambda: self.store.save_reply(reply, value))

    async def reply_session(self, tenant: str, response_id: str) -> ReplyLink | None:
        """The session (this replica's key for it) whose call got ``response_id`` on any
        replica and the worker that made it, as the store knows them (``None``: not known, or
        one replica)."""
        if not self.on:
            return None
        raw = await self.store.load_reply(reply_key(tenant, response_id))
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
            worker = rec.get("worker")
            return ReplyLink(self.core_key(str(rec["session"])),
                             worker if isinstance(worker, str) else None)
        except (ValueError, KeyError, AttributeError):  # not an entry this version writes
            log.warning("reply entry %r in the store is not readable; the call is placed as"
                        " a new session's", raw[:200])
            return None

    async def end_elsewhere(self, key: str) -> bool:
        """``DELETE`` of a session this replica does not hold: end it in the store, wherever
        it lives. False: no such session."""
        skey = self.store_key(key)
        rec = await self.store.load_session(skey)
        if rec is None:
            return False
        worker = rec.get("worker")
        if worker in self.plane.workers:
            await self.store.release(str(worker), skey, any_owner=True)
        else:
            await self.store.delete_session(skey)
        return True
