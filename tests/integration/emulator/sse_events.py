"""Calling the emulator and reading its event streams (OpenAI and Anthropic style) in tests."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer


def openai_frames(text: str) -> list[Any]:
    """Frames of an SSE body; asserts vLLM's framing (``data: ...`` + blank line, [DONE] last)."""
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames[:-1]]


async def post(
    http: aiohttp.ClientSession, server: TestServer, path: str, body: Any
) -> tuple[int, Any]:
    """(status, the JSON body or the stream's frames)."""
    async with http.post(server.make_url(path), json=body) as resp:
        text = await resp.text()
        if resp.content_type == "text/event-stream":
            return resp.status, openai_frames(text)
        return resp.status, json.loads(text) if text else None


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


def key_shape(obj: Any) -> Any:
    """Key structure of a JSON value (dict keys recursively, first list element): what a
    response must share with the fixture real vLLM sent."""
    if isinstance(obj, dict):
        return {k: key_shape(v) for k, v in obj.items()}
    if isinstance(obj, list) and obj:
        return [key_shape(obj[0])]
    return None
