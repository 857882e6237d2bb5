"""Responses API reply ids: how they are kept (hashes, never the id), and which worker made each.

vLLM keeps a stored response on the server that made it (``VLLM_ENABLE_RESPONSES_API_STORE``):
a call naming it by ``previous_response_id``, or ``GET /v1/responses/{id}``, must reach that
worker, whatever became of the session that got it. :class:`ReplyWorkers` remembers the worker
of the latest replies, beyond their sessions' lives, and for a while the workers that said they
keep no reply of an id (so a client repeating an id no worker has does not make the proxy ask
them on every call).

Pure code: no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def reply_hash(response_id: str) -> bytes:
    """A fixed size whatever the worker's ids are; surrogateescape: any str hashes."""
    return hashlib.blake2b(response_id.encode("utf-8", "surrogateescape"), digest_size=16).digest()


def reply_key(tenant: str, response_id: str) -> str:
    """A reply id as replicas share it: its tenant and a hash, never the id itself."""
    return f"{tenant}:{reply_hash(response_id).hex()}"


@dataclass(frozen=True, slots=True)
class Denied:
    """Workers that answered they keep no reply of an id, and until when that is believed."""

    workers: frozenset[str]
    until: float


class ReplyWorkers:
    """Of each of the latest ``cap`` reply ids named (by tenant and hash): the worker that made
    it, or the workers that answered they keep none (:class:`Denied`); the least recently named
    is forgotten first."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._of: OrderedDict[tuple[str, bytes], str | Denied] = OrderedDict()

    def __len__(self) -> int:
        return len(self._of)

    def made(self, tenant: str, response_id: str, worker: str) -> None:
        self._keep((tenant, reply_hash(response_id)), worker)

    def denied(self, tenant: str, response_id: str, workers: frozenset[str],
               until: float) -> None:
        """``workers`` answered that they keep no reply ``response_id`` (vLLM's 404); believed
        until ``until``: a streamed reply's id is seen before its worker stores it, so a "no"
        may turn into a "yes" later. One that did not answer (down, slow) may have it."""
        key = (tenant, reply_hash(response_id))
        if not isinstance(self._of.get(key), str):  # a worker made it: that stands
            self._keep(key, Denied(workers, until))

    def worker(self, tenant: str, response_id: str) -> str | None:
        """The worker that made the reply (``None``: not known here)."""
        known = self._named(tenant, response_id)
        return known if isinstance(known, str) else None

    def deniers(self, tenant: str, response_id: str, now: float) -> frozenset[str]:
        """The workers that said, not long before ``now``, they keep no reply ``response_id``."""
        known = self._named(tenant, response_id)
        return known.workers if isinstance(known, Denied) and now < known.until else frozenset()

    def _named(self, tenant: str, response_id: str) -> str | Denied | None:
        key = (tenant, reply_hash(response_id))
        known = self._of.get(key)
        if known is not None:
            self._of.move_to_end(key)
        return known

    def _keep(self, key: tuple[str, bytes], known: str | Denied) -> None:
        self._of[key] = known
        self._of.move_to_end(key)
        while len(self._of) > self._cap:
            self._of.popitem(last=False)
