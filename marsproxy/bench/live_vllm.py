"""``marsproxy bench live --vllm-url``: what the benchmark learns from, and does to, a real vLLM.

Before the runs (:func:`calibrate`), on the idle server:

- the served model name and ``max_model_len`` (``GET /v1/models``) and the KV capacity
  (``vllm:cache_config_info`` on ``/metrics``): workloads are sized to them;
- the tokenizer's characters per token on the replay's filler text (``POST /tokenize``): the
  agents size their messages with it, and the proxy's ``admission.tuning.chars_per_token`` is
  set to it;
- the engine's speed, timed with token-id prompts of random ids (no prefix-cache hit): a
  one-token call (the fixed cost per call), then streamed calls of ``P`` prompt tokens and
  ``N`` output tokens: prefill speed from the first token's time, decode speed from the rest.
  Best of two each. The ideal time of a session
  (:func:`ideal_seconds`) is **computed** from these three numbers, not from an emulator profile.

Between policies (:func:`reset_prefix_cache`): ``POST /reset_prefix_cache``, so one policy's
cached prefixes do not help the next. vLLM serves that route only with
``VLLM_SERVER_DEV_MODE=1`` in the server's environment; without it the benchmark goes on and
says so in the report. Counters read from ``/metrics`` are per policy (after − before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from marsproxy.bench.agent import filler
from marsproxy.probes.vllm_metrics import MetricsParseError, parse_vllm_metrics
from marsproxy.runs.workload import PlannedSession

# Token ids from here on are ordinary BPE merges in a small vocab, not special tokens.
_FIRST_ID = 100


@dataclass(frozen=True, slots=True)
class VllmFacts:
    model: str
    max_model_len: int
    kv_capacity_tokens: int | None
    chars_per_token: float
    call_s: float
    """Fixed cost of one call: a one-token prompt, one output token, HTTP included."""
    prefill_s_per_token: float
    decode_s_per_token: float
    calibration_context: int
    """Prompt length of the prefill and decode measurements (decode cost grows with context)."""

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        for name, per in (("prefill", self.prefill_s_per_token),
                          ("decode", self.decode_s_per_token)):
            d[f"{name}_tok_s"] = round(1 / per) if per > 0 else None
        return d


async def _timed_completion(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                            max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed call."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first: float | None = None
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            text = await r.text()
            raise RuntimeError(f"{url}: calibration call answered {r.status}: {text[:200]}")
        async for line in r.content:
            if first is None and line.startswith(b"data:") and b'"text"' in line:
                first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (end if first is None else first), end


async def _calibrate(url: str, seed: int) -> VllmFacts:
    rng = random.Random(f"calibrate:{seed}")
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.get(f"{url}/v1/models") as r:
            r.raise_for_status()
            card = (await r.json())["data"][0]
        model, max_len = str(card["id"]), int(card.get("max_model_len") or 0)
        if max_len <= 0:
            raise RuntimeError(f"{url}/v1/models does not say max_model_len")
        kv_tokens = None
        async with http.get(f"{url}/metrics") as r:
            if r.status == 200:
                # An unparsable page leaves the KV size unknown (reported as such).
                with contextlib.suppress(MetricsParseError):
                    kv_tokens = parse_vllm_metrics(await r.text(), 0.0).kv_capacity_tokens
        sample = filler(2000, rng)
        async with http.post(f"{url}/tokenize", json={"model": model, "prompt": sample}) as r:
            r.raise_for_status()
            count = int((await r.json())["count"])
        chars_per_token = len(sample) / max(1, count)

        ctx = max(16, min(1536, max_len // 2))
        vocab_hi = 1000  # every model here has a vocab of at least this

        fresh = random.Random()  # new ids every time: no prefix-cache hit, even on a rerun

        def ids(n: int) -> list[int]:
            return [fresh.randrange(_FIRST_ID, vocab_hi) for _ in range(n)]

        await _timed_completion(http, url, model, ids(32), 2)  # warm-up
        call = min([(await _timed_completion(http, url, model, ids(1), 1))[1]
                    for _ in range(2)])
        # Streamed, so prefill (to the first token) and decode (after it) are timed apart.
        n_out = 64
        runs = [await _timed_completion(http, url, model, ids(ctx), n_out) for _ in range(2)]
        prefill = min(first for first, _ in runs)
        decode = min(end - first for first, end in runs)
    return VllmFacts(
        model=model, max_model_len=max_len, kv_capacity_tokens=kv_tokens,
        chars_per_token=round(chars_per_token, 3), call_s=round(call, 4),
        prefill_s_per_token=max(0.0, prefill - call) / ctx,
        decode_s_per_token=decode / (n_out - 1),
        calibration_context=ctx,
    )


def calibrate(url: str, seed: int = 0) -> VllmFacts:
    """The facts of the (idle) vLLM at ``url``; a few seconds of its time."""
    return asyncio.run(_calibrate(url, seed))


def ideal_seconds(session: PlannedSession, facts: VllmFacts) -> tuple[float, float]:
    """(LLM seconds, tool seconds) of ``session`` alone on the idle server: per call the fixed
    cost, the uncached prompt (the previous call's prompt and reply are cached) at the measured
    prefill speed and the other output tokens at the measured decode speed."""
    llm = 0.0
    context = 0
    for t in session.turns:
        uncached = max(1, t.input_tokens - context)
        llm += (facts.call_s + uncached * facts.prefill_s_per_token
                + max(0, t.output_tokens - 1) * facts.decode_s_per_token)
        context = t.input_tokens + t.output_tokens
    return llm, session.tool_s_total


async def reset_prefix_cache(http: aiohttp.ClientSession, url: str,
                             timeout_s: float = 60.0) -> bool | None:
    """Empties the worker's prefix cache: True when done, None when the route is missing (the
    server runs without VLLM_SERVER_DEV_MODE=1). vLLM refuses while blocks are held (requests
    still finishing), so it is retried until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.post(f"{url}/reset_prefix_cache") as r:
            if r.status in (404, 405):
                return None
            text = await r.text()
        # 0.32 answers {"success": bool}; older servers an empty 200.
        ok = r.status == 200 and (not text.strip() or bool(json.loads(text).get("success")))
        if ok:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(1.0)
