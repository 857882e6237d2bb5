"""Talking to workers: header filtering, timeouts, and one retry on connect failure."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from marsproxy.config import UpstreamConfig, WorkerConfig
from marsproxy.gateway.shells.deadlines import Deadlines

log = logging.getLogger("marsproxy.gateway.http.upstream")

# RFC 9110 §7.6.1 hop-by-hop headers, plus those the HTTP libraries recompute.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
    }
)
# content-encoding: aiohttp's server already decoded a gzip/deflate/br request body, so the
# bytes forwarded are plain and must not claim an encoding.
_RECOMPUTED_REQUEST = frozenset({"host", "content-length", "content-encoding"})
_RECOMPUTED_RESPONSE = frozenset({"content-length", "date", "server"})


_DROP_REQUEST = tuple(HOP_BY_HOP | _RECOMPUTED_REQUEST)
_DROP_RESPONSE = tuple(HOP_BY_HOP | _RECOMPUTED_RESPONSE)


def _filtered(headers: Mapping[str, str], drop: tuple[str, ...]) -> CIMultiDict[str]:
    """A copy without ``drop`` and without the headers the Connection header lists.

    Copy, then remove: multidict does both in C, where a filtering comprehension with a
    ``lower()`` per header cost ten times as much on every request.
    """
    out: CIMultiDict[str] = CIMultiDict(headers)
    for name in drop:
        out.popall(name, None)
    listed = headers.get("connection")
    if listed:
        for name in listed.split(","):
            if name.strip():
                out.popall(name.strip(), None)
    return out


def request_headers(incoming: CIMultiDictProxy[str], *, identity: bool) -> CIMultiDict[str]:
    """Client headers to send upstream: all but hop-by-hop (Authorization goes unchanged)."""
    out = _filtered(incoming, _DROP_REQUEST)
    if identity:
        # The relay reads usage from the bytes, so they must not come compressed.
        out["Accept-Encoding"] = "identity"
    return out


def credentials(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's key alone (``Authorization`` or ``x-api-key``), for the proxy's own requests
    to a worker on the client's behalf (its stored responses' routes)."""
    return {k: v for k in ("Authorization", "x-api-key") if (v := headers.get(k))}


def response_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return _filtered(upstream, _DROP_RESPONSE)


# Chooses a worker among those not tried yet; None when there is none.
Picker = Callable[[Iterable[WorkerConfig]], WorkerConfig | None]


class UpstreamFailure(Exception):
    """No usable response from any worker; carries the status the client should get."""

    def __init__(self, status: int, code: str, message: str, upstream_s: float = 0.0) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.upstream_s = upstream_s  # time spent waiting on workers (not proxy overhead)


class BodyReader:
    """Reads one response body in chunks; ``TimeoutError`` after ``idle_s`` of silence.

    One timer per response, re-armed only when it fires early: a chunk costs a clock read,
    where an ``asyncio.timeout`` per chunk cost about 10 µs (a timer scheduled and cancelled),
    a tenth of what relaying an SSE chunk costs. The silence counts from the start of each
    read, as with a timeout around each read: time spent writing to the client is not silence.
    """

    def __init__(self, resp: aiohttp.ClientResponse, idle_s: float) -> None:
        self._resp = resp
        self._idle = idle_s
        self._loop: asyncio.AbstractEventLoop | None = None  # once a read has to wait
        self._since = 0.0  # start of the read in progress
        self._waiter: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def read(self) -> bytes:
        """Next body bytes; b"" at the end."""
        content = self._resp.content
        # What has arrived already needs no wait, hence no timer: a small non-streaming body
        # usually comes in the same packet as the headers.
        data = content.read_nowait()
        if data:
            return data
        if content.at_eof():
            self.close()
            return b""
        task = asyncio.current_task()
        assert task is not None
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._since = loop.time()
        self._waiter = task
        if self._timer is None:
            self._timer = loop.call_at(self._since + self._idle, self._expire)
        try:
            data = await content.readany()
        except asyncio.CancelledError:
            if self._fired and task.uncancel() == 0:
                raise TimeoutError(f"no body bytes for {self._idle} s") from None
            raise
        finally:
            self._waiter = None
        if not data:
            self.close()
        return data

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._waiter is None:
            return  # between reads: the next read arms a new timer
        due = self._since + self._idle
        assert self._loop is not None  # set by the read that armed the timer
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._expire)
            return
        self._fired = True
        self._waiter.cancel()


@dataclass
class Opened:
    worker: WorkerConfig
    response: aiohttp.ClientResponse
    upstream_s: float  # time waiting for the worker's headers (excluded from overhead)
    body: BodyReader


class Upstream:
    """One pooled client session to all workers."""

    def __init__(
        self, cfg: UpstreamConfig, *, on_error: Callable[[WorkerConfig, str], None]
    ) -> None:
        self._cfg = cfg
        self._report = on_error
        self.session: aiohttp.ClientSession | None = None
        self._first_byte = Deadlines(cfg.first_byte_timeout_s)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._cfg.max_connections,
            keepalive_timeout=self._cfg.keepalive_timeout_s,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # pass-through bytes stay as the worker encoded them
            # One session serves every client: a cookie a worker sets for one client goes to
            # that client (in the relayed Set-Cookie) and must never ride on another's request.
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._cfg.connect_timeout_s),
        )

    async def close(self) -> None:
        self._first_byte.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def open(
        self,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        body: bytes,
        pick: Picker,
    ) -> Opened:
        """Send the request to ``pick()``'s worker; on connect failure once more to another.

        ``pick`` gets the workers already tried (to exclude) and returns a worker or ``None``.
        """
        assert self.session is not None, "Upstream.start() was not awaited"
        # The wait is timed with perf_counter: uvloop's loop.time() is the loop's cached
        # millisecond clock, so a sub-millisecond wait read as 0 or 1 ms (and the overhead
        # header, the wall time less this wait, as anything from 0 to 1 ms too much).
        clock = time.perf_counter
        tried: list[WorkerConfig] = []
        attempts = 2 if self._cfg.retry_connect_once else 1
        last_error = "no healthy worker"
        waited = 0.0
        while len(tried) < attempts:
            worker = pick(tried)
            if worker is None:
                if not tried:
                    raise UpstreamFailure(503, "no_healthy_worker", "no healthy worker available")
                break
            tried.append(worker)
            t0 = clock()
            wait = self._first_byte.start()
            try:
                try:
                    resp = await self.session.request(
                        method,
                        worker.url + path_qs,
                        headers=headers,
                        data=body,
                        allow_redirects=False,
                    )
                finally:
                    self._first_byte.end(wait)
            except asyncio.CancelledError as exc:
                if not wait.timed_out():
                    raise
                raise self._first_byte_timeout(worker, waited + clock() - t0) from exc
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                waited += clock() - t0
                last_error = f"cannot connect to worker {worker.label}: {exc}"
                log.warning("%s", last_error)
                self._report(worker, "connect")
                continue
            except TimeoutError as exc:  # none expected from aiohttp beyond the above
                raise self._first_byte_timeout(worker, waited + clock() - t0) from exc
            except aiohttp.ClientError as exc:
                self._report(worker, "protocol")
                raise UpstreamFailure(
                    502,
                    "upstream_error",
                    f"worker {worker.label} failed: {exc!r}",
                    waited + clock() - t0,
                ) from exc
            reader = BodyReader(resp, self._cfg.idle_timeout_s)
            return Opened(worker, resp, waited + clock() - t0, reader)
        raise UpstreamFailure(502, "upstream_connect_failed", last_error, waited)

    def _first_byte_timeout(self, worker: WorkerConfig, upstream_s: float) -> UpstreamFailure:
        self._report(worker, "first_byte_timeout")
        return UpstreamFailure(
            504,
            "upstream_timeout",
            f"worker {worker.label} sent no response headers within "
            f"{self._cfg.first_byte_timeout_s} s",
            upstream_s,
        )
