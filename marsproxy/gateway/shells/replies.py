"""Where calls that name a stored Responses reply go: the worker that made it, the only one
that keeps it (vLLM's response store is per server).

A call continuing a reply (``previous_response_id``) and a stored response's own routes (``GET
/v1/responses/{id}``, ``cancel``) must reach that worker, whatever became of the session that
got it. It is known, in this order: from this replica (the worker of each recent reply,
:class:`~marsproxy.core.replies.ReplyWorkers`, beyond its session), from the store (another
replica's reply, with the session to join: ``replicas.py``), or, where neither knows the id
(another replica's reply whose entry has not landed yet, a proxy restart), from the workers
themselves: vLLM answers ``GET /v1/responses/{id}`` with 200 only where it keeps the reply, so
the proxy asks every healthy worker at once and takes the one that has it (:func:`worker_keeping`).
A worker that answered 404 is not asked of that id again for a health interval: a client
repeating an id no worker keeps (lost to a restart, or made up) costs a round of questions per
``health.interval_s``, not one per call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from urllib.parse import quote

import aiohttp

from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.core.identity import tenant_of
from marsproxy.core.replies import ReplyWorkers
from marsproxy.core.sessions import Turn
from marsproxy.gateway.http.health import WorkerHealth
from marsproxy.gateway.http.routes import stored_response_id
from marsproxy.gateway.http.upstream import Picker, credentials
from marsproxy.gateway.shells.admission import AdmissionShell
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.replicas import ReplyLink
from marsproxy.gateway.shells.sessions import ObservedSessions

log = logging.getLogger("marsproxy.gateway.shells.replies")


class Replies:
    def __init__(
        self, cfg: MarsConfig, workers: Mapping[str, WorkerConfig], health: WorkerHealth,
        sessions: ObservedSessions, admission: AdmissionShell | None,
        http: Callable[[], aiohttp.ClientSession | None], metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._workers, self._health, self._sessions = workers, health, sessions
        self._admission, self._http = admission, http
        self._metrics = metrics
        self._probe_timeout_s = cfg.health.timeout_s
        self._denial_s = cfg.health.interval_s
        self._now = clock
        self.made_by = ReplyWorkers(cfg.sessions.max_sessions)

    def made(self, tenant: str, response_id: str, key: str, url: str) -> None:
        """``key``'s call got ``response_id`` from the worker at ``url``: remembered, and
        published for the other replicas."""
        label = self._workers[url].label
        self.made_by.made(tenant, response_id, label)
        if self._admission is not None:
            self._admission.replicas.publish_reply(tenant, response_id, key, label)

    async def find(self, tenant: str, response_id: str,
                   headers: Mapping[str, str]) -> ReplyLink:
        """What is known of a reply a call names: the session to join (``key``: the store's,
        for another replica's reply; ``None``: the session table's, or none) and the worker
        that made it (this replica's memory, the store's, or the workers' answer; ``None``:
        nowhere)."""
        worker = self.made_by.worker(tenant, response_id)
        if self._sessions.of_response(tenant, response_id) is not None:
            return ReplyLink(None, worker)
        if worker is not None:
            self._looked_up("here")
            return ReplyLink(None, worker)
        if self._admission is not None:
            link = await self._admission.replicas.reply_session(tenant, response_id)
            if link is not None:
                self._looked_up("store")
                return link
        label = await self._ask(tenant, response_id, headers)
        self._looked_up("none" if label is None else "workers")
        if label is not None:
            self.made_by.made(tenant, response_id, label)
        return ReplyLink(None, label)

    def link(self, turn: Turn, found: ReplyLink | None) -> ReplyLink | None:
        """What admission needs of a request continuing the reply ``found`` describes
        (``None``: it continues none): the session it joined (``None``: a new one) and the
        worker that made the reply, where healthy (down: placed as any; that worker answers
        as vLLM would without the proxy)."""
        if found is None:
            return None
        worker = found.worker if self._url(found.worker) is not None else None
        joined = turn.session if turn.source == "response" else None
        return None if joined is None and worker is None else ReplyLink(joined, worker)

    async def picker(self, path: str, headers: Mapping[str, str], any_worker: Picker,
                     to: Callable[[str], WorkerConfig]) -> Picker:
        """Where a pass-through request goes: a stored response's routes to the worker that made
        it; the rest, and those whose worker is unknown or down, as ``any_worker`` says."""
        rid = stored_response_id(path)
        if rid is None:
            return any_worker
        tenant = tenant_of(headers.get("Authorization") or headers.get("x-api-key"))
        worker = (await self.find(tenant, rid, headers)).worker

        def pick(tried: Iterable[WorkerConfig]) -> WorkerConfig | None:
            url = self._url(worker)
            if url is not None and all(w.url != url for w in tried):
                return to(url)
            return any_worker(tried)

        return pick

    def _looked_up(self, source: str) -> None:
        self._metrics.reply_lookups.labels(source).inc()

    def _url(self, label: str | None) -> str | None:
        """The healthy worker labelled ``label`` (``None``: none, or down)."""
        return next((u for u, w in self._workers.items()
                     if w.label == label and self._health.is_healthy(u)), None)

    async def _ask(self, tenant: str, response_id: str,
                   headers: Mapping[str, str]) -> str | None:
        """The label of the worker that has the reply, as the workers answer (with two or more
        healthy: with one there is nothing to choose). Those that said they keep none are not
        asked again."""
        http = self._http()
        healthy = [u for u in self._workers if self._health.is_healthy(u)]
        if http is None or len(healthy) < 2:
            return None
        deniers = self.made_by.deniers(tenant, response_id, self._now())
        urls = [u for u in healthy if self._workers[u].label not in deniers]
        if not urls:
            return None
        url, denied = await worker_keeping(http, urls, response_id, credentials(headers),
                                           self._probe_timeout_s)
        if url is not None:
            return self._workers[url].label
        if denied:
            self.made_by.denied(tenant, response_id,
                                deniers | {self._workers[u].label for u in denied},
                                until=self._now() + self._denial_s)
        return None


async def worker_keeping(
    http: aiohttp.ClientSession, urls: Sequence[str], response_id: str,
    headers: Mapping[str, str], timeout_s: float,
) -> tuple[str | None, list[str]]:
    """The url of the worker that answers 200 for ``response_id`` (``None``: none does, in
    ``timeout_s``), and those that answered 404 (they keep no such reply). ``headers``: the
    caller's credentials, as the worker checks them."""
    denied: list[str] = []

    async def has(url: str) -> str | None:
        try:
            async with http.get(f"{url.rstrip('/')}/v1/responses/{quote(response_id, safe='')}",
                                headers=headers) as r:
                if r.status == 404:
                    denied.append(url)
                return url if r.status == 200 else None
        except (aiohttp.ClientError, ValueError) as exc:
            log.info("asking %s for reply %s failed: %r", url, response_id[:64], exc)
            return None

    tasks = [asyncio.create_task(has(u)) for u in urls]
    try:
        async with asyncio.timeout(timeout_s):
            for found in asyncio.as_completed(tasks):
                url = await found
                if url is not None:
                    return url, denied
    except TimeoutError:
        log.info("no worker answered for reply %s within %.1f s (health.timeout_s)",
                 response_id[:64], timeout_s)
    finally:
        for t in tasks:
            t.cancel()  # the others' answers are not needed
    return None, denied
