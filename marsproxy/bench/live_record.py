"""What ``marsproxy bench live`` reads during a run besides the agents' answers: the proxy's
event stream and state snapshots, and the workers' preemption and prefix-cache counters."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


async def record_events(http: aiohttp.ClientSession, url: str, sink: list[dict[str, Any]],
                         ready: asyncio.Event) -> None:
    """Reads ``GET /mars/v1/events`` (NDJSON) into ``sink`` until cancelled.

    Each event is stamped with its arrival here (``recv_ts``, epoch seconds): the stream is
    live, so that is within milliseconds of its publication, and one clock for all events
    (the gateway stamps admission events with its monotonic clock, others with wall time)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with http.get(f"{url}/mars/v1/events", params={"format": "ndjson"},
                        timeout=timeout) as resp:
        resp.raise_for_status()
        ready.set()
        async for line in resp.content:
            if line.strip():
                ev = json.loads(line)
                ev["recv_ts"] = time.time()
                sink.append(ev)


async def record_state(http: aiohttp.ClientSession, url: str, sink: list[dict[str, Any]],
                        every_s: float) -> None:
    """Reads ``GET /mars/v1/state`` into ``sink`` every ``every_s`` until cancelled: the
    window, caps, the fit's factor and the queue, which the event stream does not carry.
    Each snapshot gets ``recv_ts`` (epoch seconds); a failed read leaves a row with ``error``
    instead (the run goes on: the state is for reading afterwards, not for the replay)."""
    while True:
        row: dict[str, Any] = {"recv_ts": time.time()}
        try:
            async with http.get(f"{url}/mars/v1/state") as r:
                r.raise_for_status()
                row.update(await r.json())
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            row["error"] = repr(exc)
        sink.append(row)
        await asyncio.sleep(every_s)


WORKER_COUNTERS = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


async def worker_counters(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    """Preemptions and prefix-cache counters summed over the workers (their /metrics); read
    before and after a policy's run on real workers, which outlive it."""
    out = dict.fromkeys(WORKER_COUNTERS.values(), 0.0)
    for url in urls:
        try:
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
        except aiohttp.ClientError:
            continue  # a worker without metrics adds nothing
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in WORKER_COUNTERS:
                    out[WORKER_COUNTERS[s.name]] += s.value
    return out
