"""What the end-to-end tests of the KV index share: plain HTTP calls and a bounded wait."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        body: bytes = r.read()
    return body


def chat(url: str, session: str, messages: list[dict[str, str]], max_tokens: int) -> None:
    """One chat call of ``session`` (its `x-session-id`) that must succeed."""
    body = json.dumps({"model": "tiny-emulated", "max_tokens": max_tokens, "ignore_eos": True,
                       "messages": messages})
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(), headers={
        "content-type": "application/json", "x-session-id": session})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def until(what: str, probe: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """``probe()`` once it is truthy; an AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
