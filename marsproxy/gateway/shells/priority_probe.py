"""The start-up probe of ``priority: auto`` workers (what it sends: :mod:`marsproxy.sched.probe`).

Three ``/v1/completions`` requests with token-id prompts straight to the worker (not through
the relay, so no session sees them), timed on the event loop's clock. Costs about 1.5
``long_tokens`` of prefill once per worker start. Never raises: a failure reads as gated.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import aiohttp

from marsproxy.config import WorkerConfig
from marsproxy.probes.vllm_metrics import MetricsParseError, parse_vllm_metrics
from marsproxy.sched.config import SchedulerConfig
from marsproxy.sched.probe import ProbeReading, plan, read

log = logging.getLogger("marsproxy.gateway.shells.priority_probe")

_SEND_GAP_S = 0.002  # keeps the arrival order A, B, C at the worker (C must arrive during A)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    honours_priority: bool
    reason: str
    failed: bool = False  # could not run (worker unreachable, errors), as opposed to a reading


async def _json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        r.raise_for_status()
        return await r.json(content_type=None)


async def _facts(http: aiohttp.ClientSession, base: str) -> tuple[str, int | None, int | None]:
    models = await _json(http, base + "/v1/models")
    first = models["data"][0]
    max_len = first.get("max_model_len")
    kv_tokens = None
    try:
        async with http.get(base + "/metrics") as r:
            if r.status == 200:
                kv_tokens = parse_vllm_metrics(await r.text(), 0.0).kv_capacity_tokens
    except (aiohttp.ClientError, MetricsParseError):
        pass  # unknown KV size: the plan only uses the context length
    return str(first["id"]), max_len if isinstance(max_len, int) else None, kv_tokens


async def _complete(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> float:
    async with http.post(base + "/v1/completions", json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"probe request answered {r.status}: {text[:200]}")
    return loop.time()


async def probe_priority(
    http: aiohttp.ClientSession, worker: WorkerConfig, cfg: SchedulerConfig
) -> ProbeResult:
    """Whether ``worker`` orders waiting requests by the body's ``priority``."""
    try:
        async with asyncio.timeout(cfg.tuning.probe_timeout_s):
            reading = await _run(http, worker.url, cfg.tuning.probe_min_lead)
    except TimeoutError:
        reading = ProbeReading(False, f"probe timed out after {cfg.tuning.probe_timeout_s} s")
    except (aiohttp.ClientError, RuntimeError, KeyError, IndexError, TypeError,
            ValueError) as exc:
        log.info("worker %s: priority probe failed: %r", worker.label, exc)
        return ProbeResult(False, f"probe failed: {exc!r}", failed=True)
    mode = "priority" if reading.honours_priority else "gated"
    log.info("worker %s: priority probe → %s (%s)", worker.label, mode, reading.reason)
    return ProbeResult(reading.honours_priority, reading.reason)


async def _run(http: aiohttp.ClientSession, base: str, min_lead: float) -> ProbeReading:
    model, max_len, kv_tokens = await _facts(http, base)
    p = plan(max_len, kv_tokens)
    if p is None:
        return ProbeReading(False, f"worker too small to probe (max_model_len {max_len},"
                                   f" KV {kv_tokens} tokens)")
    rng = random.Random()  # fresh ids each run: no prefix-cache hit may shorten a prefill

    def body(n: int, priority: int) -> dict[str, Any]:
        return {"model": model, "prompt": [rng.randrange(100, 1000) for _ in range(n)],
                "max_tokens": 1, "ignore_eos": True, "temperature": 0, "priority": priority}

    loop = asyncio.get_running_loop()
    a = asyncio.create_task(_complete(http, base, body(p.blocker_tokens, 0), loop))
    await asyncio.sleep(_SEND_GAP_S)
    b = asyncio.create_task(_complete(http, base, body(p.long_tokens, 1), loop))
    await asyncio.sleep(_SEND_GAP_S)
    c = asyncio.create_task(_complete(http, base, body(p.short_tokens, 0), loop))
    try:
        blocker_done, long_done, short_done = await asyncio.gather(a, b, c)
    finally:
        for t in (a, b, c):
            t.cancel()
    return read(blocker_done, long_done, short_done, min_lead)
