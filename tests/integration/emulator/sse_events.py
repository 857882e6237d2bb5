"""Reading the emulator's Anthropic-style event streams in tests."""

from __future__ import annotations

import json
from typing import Any


def anthropic_events(text: str) -> list[tuple[str, Any]]:
    """(event, data) pairs; asserts vLLM's framing: ``event:`` line, ``data:`` line, blank."""
    assert text.endswith("\n\n")
    out = []
    for frame in text.split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == name[7:]
        out.append((name[7:], obj))
    return out
