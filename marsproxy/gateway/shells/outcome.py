"""Per-request bookkeeping of the relay: the overhead clock, the outcome, and the request's
events on the bus (dispatch, first_token, llm_end or rejected).

Publishing here is a dataclass construction and a ring append per event; nothing is done per
subscriber on the request path. With no subscriber at all (no sink, no ``/mars/v1/events``
stream), an event could never be read, so it is only counted, not built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from aiohttp import web

from marsproxy.config import WorkerConfig
from marsproxy.core.answers import ReplyKind
from marsproxy.core.canon import Reply
from marsproxy.core.events import Dispatch, FirstToken, LlmEnd, Rejected
from marsproxy.core.sessions import Turn
from marsproxy.gateway.http.errors import error_response
from marsproxy.gateway.http.sse import Usage
from marsproxy.gateway.shells.kv_use import Prediction
from marsproxy.gateway.shells.scheduler import Prepared
from marsproxy.gateway.shells.service import Gateway

OVERHEAD_HEADER = "x-marsproxy-overhead-ms"

Pick = Callable[[Iterable[WorkerConfig]], WorkerConfig | None]


class Clock:
    """The proxy's own time on one request: wall time less the wait for the worker
    (``upstream_s``) and the time the request was deliberately held (``held_s``: the admission
    queue, the gated dispatch queue).

    The header says the time until the response leaves (:meth:`header` freezes it): a response
    with a body (JSON, errors) is sent before the work after it, a stream's header before its
    body. :meth:`total_s` adds that after-work (the end of the call and of the session, the
    release, the accounting) for the histogram. A response never sent is stamped with all.
    """

    __slots__ = ("_tail_t", "frozen_s", "held_s", "t0", "upstream_s")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.upstream_s = 0.0
        self.held_s = 0.0  # waiting for admission or a dispatch slot: not the proxy's cost
        self.frozen_s: float | None = None  # overhead as sent in a stream's header
        self._tail_t: float | None = None  # when the work after the response began

    def overhead_s(self) -> float:
        """Overhead up to now (not counting any of the stream's body)."""
        if self.frozen_s is not None:
            return self.frozen_s
        return max(0.0, time.perf_counter() - self.t0 - self.upstream_s - self.held_s)

    def header(self) -> dict[str, str]:
        """The overhead header as of now; for a stream, what it says is final."""
        self.frozen_s = self.overhead_s()
        return {OVERHEAD_HEADER: f"{self.frozen_s * 1000:.3f}"}

    def tail_begins(self) -> None:
        """The response is done (sent, or handed to the server to send): after-work starts."""
        self._tail_t = time.perf_counter()

    def total_s(self) -> float:
        """All the proxy's time on the request, after-work included: what the
        ``marsproxy_proxy_overhead_seconds`` histogram observes."""
        if self.frozen_s is not None and self._tail_t is not None:
            return self.frozen_s + time.perf_counter() - self._tail_t
        return max(0.0, time.perf_counter() - self.t0 - self.upstream_s - self.held_s)

    def stamp(self, resp: web.StreamResponse | None) -> float:
        """:meth:`total_s`, also written into ``resp``'s header when it is not sent yet."""
        if resp is None or resp.prepared:
            return self.total_s()
        self.frozen_s = None  # not sent yet: the live count, after-work and all
        total = self.total_s()
        resp.headers[OVERHEAD_HEADER] = f"{total * 1000:.3f}"
        return total


class Outcome:
    """What happened to one request, for metrics, the session table and the event stream."""

    def __init__(self, route_label: str, *, scheduled: bool) -> None:
        self.route = route_label
        self.scheduled = scheduled
        self.status = 500
        self.ok = False
        self.usage: Usage | None = None
        self.body: bytes | None = None  # a JSON reply: read for usage once it has left
        self.reply: Reply | None = None
        self.reply_kind: ReplyKind | None = None  # called a tool, or answered (core/answers.py)
        self.offers_tools = False  # the request carried tools: an agent loop's call
        self.response_id: str | None = None  # a Responses reply's (previous_response_id)
        self.stores = True  # the request did not set `store: false`: its reply id may be named
        self.credentials: dict[str, str] | None = None  # a background call's (background.py)
        self.session: str | None = None
        self.turn = 0
        self.turn_ref: Turn | None = None  # scheduled requests, once their session is known
        self.worker: WorkerConfig | None = None  # the worker it was last sent to
        self.code: str | None = None  # error code when the proxy answered itself
        self.ttft_s: float | None = None
        self.admitted = False  # admission let it through (its end is reported to the core)
        self.prompt_chars = 0
        self.incarnation: int | None = None  # the plane's session it was admitted into
        self.prepared: Prepared | None = None  # how the scheduler sent it (level, hint)
        self.kv_prediction: Prediction | None = None  # its cached tokens as the index predicted


def error(
    clock: Clock,
    out: Outcome,
    status: int,
    code: str,
    message: str,
    retry_after: int | None = None,
) -> web.Response:
    headers = clock.header()
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    out.status, out.code = status, code
    return error_response(status, message, code=code, headers=headers)


class RequestEvents:
    """The request path's hooks into the gateway's counters and the event bus."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def picker(self, out: Outcome, pick: Pick) -> Pick:
        """``pick``, also counting the request on its worker and publishing ``dispatch``."""
        gw = self.gw

        def choose(tried: Iterable[WorkerConfig]) -> WorkerConfig | None:
            worker = pick(tried)
            if worker is None:
                return None
            if out.worker is not None:  # a retry after a failed connect: moved elsewhere
                gw.in_flight_by_worker[out.worker.url] -= 1
            out.worker = worker
            gw.in_flight_by_worker[worker.url] += 1
            if out.scheduled and not gw.telemetry.bus.subscribers:
                gw.telemetry.bus.skip()  # nobody to read it: not built
            elif out.scheduled:
                p = out.prepared
                t = None if p is None else p.ticket
                gw.telemetry.publish(
                    Dispatch(
                        ts=gw.telemetry.wall(),
                        session=out.session,
                        worker=worker.label,
                        route=out.route,
                        turn=out.turn,
                        level=None if t is None else t.level,
                        hint="none" if p is None else p.hint,
                        priority=None if t is None else t.priority,
                        mode="" if t is None else gw.scheduler.core.modes[worker.label],
                        uncached_tokens=None if t is None else t.uncached_tokens,
                        queued_s=0.0 if t is None else t.waited_s(),
                    )
                )
            return worker

        return choose

    def first_token(self, out: Outcome, clock: Clock) -> None:
        if out.ttft_s is not None:
            return
        out.ttft_s = ttft = time.perf_counter() - clock.t0
        self.gw.metrics.ttft.labels(out.route).observe(ttft)
        bus = self.gw.telemetry.bus
        if not bus.subscribers:
            bus.skip()  # nobody to read it: not built
            return
        bus.publish(
            FirstToken(
                ts=self.gw.telemetry.wall(),
                session=out.session,
                worker=None if out.worker is None else out.worker.label,
                ttft_s=ttft,
            )
        )

    def counted(self, out: Outcome) -> None:
        """The reply's tokens, and the KV index's prediction against what the engine cached
        (accounting: a worker's odd counts fail it, never the end of the call)."""
        gw, u, p = self.gw, out.usage, out.kv_prediction
        if u is not None:
            gw.metrics.tokens.labels("prompt").inc(u.prompt_tokens)
            gw.metrics.tokens.labels("completion").inc(u.completion_tokens)
        if (gw.kv_use is not None and p is not None and out.ok and u is not None
                and out.worker is not None and out.worker.label == p.worker):
            gw.kv_use.compare(p, u.cached_tokens)

    def ended(self, out: Outcome, clock: Clock) -> None:
        """After the response: ``llm_end`` if a worker got it, else ``rejected`` if refused."""
        gw = self.gw
        if out.worker is not None:
            gw.in_flight_by_worker[out.worker.url] -= 1
            if out.scheduled and not gw.telemetry.bus.subscribers:
                gw.telemetry.bus.skip()  # nobody to read it: not built
            elif out.scheduled:
                u = out.usage or Usage()
                gw.telemetry.publish(
                    LlmEnd(
                        ts=gw.telemetry.wall(),
                        session=out.session,
                        worker=out.worker.label,
                        status=out.status,
                        latency_s=time.perf_counter() - clock.t0,
                        prompt_tokens=u.prompt_tokens,
                        cached_tokens=u.cached_tokens,
                        completion_tokens=u.completion_tokens,
                    )
                )
        elif out.code is not None:
            gw.telemetry.publish(
                Rejected(
                    ts=gw.telemetry.wall(),
                    session=out.session,
                    reason=out.code,
                    status=out.status,
                )
            )
