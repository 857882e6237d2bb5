"""A new session's first prompt size from a worker's ``/tokenize`` (``admission.tokenize``).

Characters / ``chars_per_token`` overestimates the first prompt (JSON syntax, fields other than
the messages) until the first response's usage corrects it; with this on, the worker counts
the tokens instead, at the cost of one round trip per new session. Chat bodies send their
``messages``, completion bodies their ``prompt`` (vLLM's ``/tokenize`` takes both); other
routes and every failure fall back to the character estimate.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

log = logging.getLogger("marsproxy.gateway.shells.admission")


def tokenize_payload(body: bytes) -> dict[str, Any] | None:
    """What ``/tokenize`` needs from a request body; ``None`` when it cannot say."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    for field in ("messages", "prompt"):
        if field in obj:
            out: dict[str, Any] = {field: obj[field]}
            if "model" in obj:
                out["model"] = obj["model"]
            return out
    return None


async def count_tokens(
    http: aiohttp.ClientSession, base_url: str, body: bytes, timeout_s: float
) -> int | None:
    """Prompt tokens of ``body`` as the worker at ``base_url`` counts them, else ``None``."""
    payload = tokenize_payload(body)
    if payload is None:
        return None
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{base_url.rstrip('/')}/tokenize", json=payload) as r:
                if r.status != 200:
                    log.debug("tokenize at %s answered %d", base_url, r.status)
                    return None
                data = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("tokenize at %s failed: %r", base_url, exc)
        return None
    n = data.get("count") if isinstance(data, dict) else None
    return n if isinstance(n, int) and n >= 0 else None


async def first_prompt_tokens(
    http: aiohttp.ClientSession | None, healthy: list[str], body: bytes, timeout_s: float
) -> int | None:
    """A new session's first prompt counted by the first healthy worker (``None``: no worker,
    no client session, or no answer in time)."""
    if http is None or not healthy:
        return None
    return await count_tokens(http, healthy[0], body, timeout_s)
