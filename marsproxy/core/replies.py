"""Responses API reply ids: how they are kept (hashes, never the id), and which worker made each.

vLLM keeps a stored response on the server that made it (``VLLM_ENABLE_RESPONSES_API_STORE``):
a call naming it by ``previous_response_id``, or ``GET /v1/responses/{id}``, must reach that
worker, whatever became of the session that got it. :class:`ReplyWorkers` remembers the worker
of the latest replies, beyond their sessions' lives.

Pure code: no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


def reply_hash(response_id: str) -> bytes:
    """A fixed size whatever the worker's ids are; surrogateescape: any str hashes."""
    return hashlib.blake2b(response_id.encode("utf-8", "surrogateescape"), digest_size=16).digest()


def reply_key(tenant: str, response_id: str) -> str:
    """A reply id as replicas share it: its tenant and a hash, never the id itself."""
    return f"{tenant}:{reply_hash(response_id).hex()}"


class ReplyWorkers:
    """The worker that made each of the latest ``cap`` replies (by tenant and hash); the least
    recently named is forgotten first."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._of: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._of)

    def made(self, tenant: str, response_id: str, worker: str) -> None:
        key = (tenant, reply_hash(response_id))
        self._of[key] = worker
        self._of.move_to_end(key)
        while len(self._of) > self._cap:
            self._of.popitem(last=False)

    def worker(self, tenant: str, response_id: str) -> str | None:
        """The worker that made the reply (``None``: not known here)."""
        key = (tenant, reply_hash(response_id))
        worker = self._of.get(key)
        if worker is not None:
            self._of.move_to_end(key)
        return worker
