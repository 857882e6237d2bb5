"""A worker that writes scripted raw bytes: HTTP framing a misbehaving worker gets wrong.

Answers the proxy's probes (``/health``, ``/metrics``, ``/v1/models``) like the fake worker of
conftest.py; every other request gets ``script``: a list of ``bytes`` (written and drained on
their own, so each is its own TCP write), ``float`` (a pause in seconds) and ``CLOSE`` (the
connection ends there, whatever the framing said).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

CLOSE = "close"
Step = bytes | float | str

_PROBES = {
    b"/health": (b"text/plain", b""),
    b"/metrics": (b"text/plain", b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"),
    b"/v1/models": (b"application/json", json.dumps({"object": "list", "data": [
        {"id": "fake", "object": "model", "max_model_len": 4096}]}).encode()),
}


def head(status: int = 200, ctype: str = "text/event-stream", **extra: str) -> bytes:
    """A response head; chunked unless ``extra`` names a framing (``content_length``)."""
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}"]
    if "content_length" in extra:
        lines.append(f"Content-Length: {extra['content_length']}")
    else:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of ``data``."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


LAST_CHUNK = b"0\r\n\r\n"


def chunked(*data: bytes) -> list[Step]:
    """``data`` as one HTTP chunk each (one TCP write each), then the last chunk."""
    return [*(chunk(d) for d in data), LAST_CHUNK]


@dataclass
class RawWorker:
    script: list[Step] = field(default_factory=list)
    requests: int = 0
    open_streams: int = 0  # scripted responses being written now
    url: str = ""
    _server: asyncio.Server | None = None

    async def start(self) -> RawWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                raw = await reader.readuntil(b"\r\n\r\n")
                path = raw.split(b" ", 2)[1].split(b"?")[0].rstrip(b"/")
                length = 0
                for line in raw.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if path in _PROBES:
                    ctype, body = _PROBES[path]
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype
                                 + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                    await writer.drain()
                    continue
                self.requests += 1
                if not await self._play(writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _play(self, writer: asyncio.StreamWriter) -> bool:
        """The script; False once it closed the connection."""
        self.open_streams += 1
        try:
            for step in self.script:
                if step == CLOSE:
                    return False
                if isinstance(step, float):
                    await asyncio.sleep(step)
                else:
                    assert isinstance(step, bytes)
                    writer.write(step)
                    await writer.drain()
            return True
        finally:
            self.open_streams -= 1
