"""Talking to workers: header filtering, timeouts, and one retry on connect failure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from marsproxy.config import UpstreamConfig, WorkerConfig

log = logging.getLogger("marsproxy.gateway.upstream")

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


def _connection_listed(headers: Mapping[str, str]) -> set[str]:
    listed = headers.get("connection", "")
    return {h.strip().lower() for h in listed.split(",") if h.strip()}


def request_headers(incoming: CIMultiDictProxy[str], *, identity: bool) -> CIMultiDict[str]:
    """Client headers to send upstream: all but hop-by-hop (Authorization goes unchanged)."""
    drop = HOP_BY_HOP | _RECOMPUTED_REQUEST | _connection_listed(incoming)
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in incoming.items() if k.lower() not in drop
    )
    if identity:
        # The relay reads usage from the bytes, so they must not come compressed.
        out["Accept-Encoding"] = "identity"
    return out


def response_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    drop = HOP_BY_HOP | _RECOMPUTED_RESPONSE | _connection_listed(upstream)
    return CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in drop)


# Chooses a worker among those not tried yet; None when there is none.
Picker = Callable[[Iterable[WorkerConfig]], WorkerConfig | None]


class UpstreamFailure(Exception):
    """No usable response from any worker; carries the status the client should get."""

    def __init__(self, status: int, code: str, message: str, upstream_s: float = 0.0) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.upstream_s = upstream_s  # time spent waiting on workers (not proxy overhead)


@dataclass
class Opened:
    worker: WorkerConfig
    response: aiohttp.ClientResponse
    upstream_s: float  # time waiting for the worker's headers (excluded from overhead)


class Upstream:
    """One pooled client session to all workers."""

    def __init__(
        self, cfg: UpstreamConfig, *, on_error: Callable[[WorkerConfig, str], None]
    ) -> None:
        self._cfg = cfg
        self._report = on_error
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._cfg.max_connections,
            keepalive_timeout=self._cfg.keepalive_timeout_s,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # pass-through bytes stay as the worker encoded them
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._cfg.connect_timeout_s),
        )

    async def close(self) -> None:
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
        loop = asyncio.get_running_loop()
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
            t0 = loop.time()
            try:
                async with asyncio.timeout(self._cfg.first_byte_timeout_s):
                    resp = await self.session.request(
                        method,
                        worker.url + path_qs,
                        headers=headers,
                        data=body,
                        allow_redirects=False,
                    )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                waited += loop.time() - t0
                last_error = f"cannot connect to worker {worker.label}: {exc}"
                log.warning("%s", last_error)
                self._report(worker, "connect")
                continue
            except TimeoutError as exc:
                self._report(worker, "first_byte_timeout")
                raise UpstreamFailure(
                    504,
                    "upstream_timeout",
                    f"worker {worker.label} sent no response headers within "
                    f"{self._cfg.first_byte_timeout_s} s",
                    waited + loop.time() - t0,
                ) from exc
            except aiohttp.ClientError as exc:
                self._report(worker, "protocol")
                raise UpstreamFailure(
                    502,
                    "upstream_error",
                    f"worker {worker.label} failed: {exc!r}",
                    waited + loop.time() - t0,
                ) from exc
            return Opened(worker, resp, waited + loop.time() - t0)
        raise UpstreamFailure(502, "upstream_connect_failed", last_error, waited)

    async def read_chunk(self, resp: aiohttp.ClientResponse) -> bytes:
        """Next body bytes (b"" at the end); ``TimeoutError`` after ``idle_timeout_s`` silence."""
        async with asyncio.timeout(self._cfg.idle_timeout_s):
            return await resp.content.readany()
