"""Cutting a server-sent event stream into events, whatever the chunking.

Pure code: no I/O.
"""

from __future__ import annotations

import re

_HOLD_FROM = 1 << 16  # an event in progress this long: later reads are held, not joined
_BLANK = re.compile(rb"\r\n\r\n|\n\n|[\r\n]\r\n?")  # two line ends: CR LF, LF or CR (SSE)


class SSESplitter:
    """Cuts a byte stream at event boundaries (a blank line), whatever the chunking."""

    def __init__(self) -> None:
        self._buf = b""  # the start of an event in progress
        # A long event's later reads, joined once one can end it (joining each to all before
        # it was quadratic in an event of mebibytes), and the last 3 bytes held.
        self._held: list[bytes] = []
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Complete events (each with its terminating blank line) found so far."""
        if not self._buf:
            buf = data
        elif self._held or len(self._buf) >= _HOLD_FROM:
            tail = self._tail if self._held else self._buf[-3:]
            seam = tail + data[:3]  # a boundary across the cut
            if not (_blank(data) or _blank(seam)):
                self._held.append(data)
                self._tail = data[-3:] if len(data) >= 3 else (tail + data)[-3:]
                return []
            buf = b"".join((self._buf, *self._held, data))
            self._held = []
        else:
            buf = self._buf + data
        events: list[bytes] = []
        start = 0
        if b"\r" in buf:  # CR LF or lone CR line ends; a CR last may yet start a CR LF
            for m in _BLANK.finditer(buf, 0, len(buf) - buf.endswith(b"\r")):
                events.append(buf[start:m.end()])
                start = m.end()
        else:  # vLLM's framing: LF only
            while (end := buf.find(b"\n\n", start)) >= 0:
                events.append(buf[start:end + 2])
                start = end + 2
        self._buf = buf[start:]
        return events

    def idle(self) -> bool:
        """No partial event is buffered: the next chunk starts at an event boundary."""
        return not self._buf

    def flush(self) -> bytes:
        """Bytes left after the stream ended without a final blank line."""
        rest = b"".join((self._buf, *self._held)) if self._held else self._buf
        self._buf, self._held = b"", []
        return rest


def _blank(data: bytes) -> bool:  # holds a blank line (or a CR last: feed's cut looks again)
    return b"\n\n" in data or (b"\r" in data and _BLANK.search(data) is not None)
