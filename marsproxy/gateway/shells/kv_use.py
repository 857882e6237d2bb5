"""The request path's use of the workers' KV indexes (docs/kv-events.md, "What it is used for").

The proxy sees text; the indexes match token ids. So for each scheduled chat or completions
request, while some worker's index is usable and ``probes.kv_events.tokenize`` is ``auto``, the
prompt is tokenized once by a worker with KV events (vLLM's ``/tokenize``, with the fields that
shape the chat template: messages, tools, generation prompt, template arguments). The ids are
kept only for the request's lifetime; nothing of a prompt is stored. With them:

- the plane hears, for a new session, how many leading tokens each indexed worker holds
  (prefix placement) and, for each call, how many its worker holds (retention verified);
- the call's ``cached_tokens`` is predicted before dispatch and compared with the usage after:
  ``marsproxy_kv_predictions_total{worker,outcome}`` (``exact``, ``within_block``, ``off``).

Any failure (no usable index, ``/tokenize`` slow or refusing) leaves the request as without
KV events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.gateway.shells.kv_events import KVEventsShell
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.probes.kv_index import prediction_outcome

log = logging.getLogger("marsproxy.gateway.shells.kv_use")

# Fields of a chat request that change what its chat template renders.
_CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                "chat_template", "chat_template_kwargs", "documents", "add_special_tokens")


def tokenize_request(route: str, obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` body that gives the token ids of this request's prompt (None: a route
    or prompt form it cannot render)."""
    out: dict[str, Any] = {}
    if route == "chat" and isinstance(obj.get("messages"), list):
        out = {k: obj[k] for k in _CHAT_FIELDS if k in obj}
    elif route == "completions" and isinstance(obj.get("prompt"), str):
        out = {"prompt": obj["prompt"]}
        if "add_special_tokens" in obj:
            out["add_special_tokens"] = obj["add_special_tokens"]
    else:
        return None
    if "model" in obj:
        out["model"] = obj["model"]
    return out


@dataclass(slots=True)
class Prediction:
    worker: str
    predicted: int
    block_size: int


class KVUse:
    def __init__(self, cfg: MarsConfig, kv: KVEventsShell, metrics: GatewayMetrics,
                 http: Callable[[], aiohttp.ClientSession | None],
                 block_size_of: Callable[[str], int | None] = lambda _: None) -> None:
        self.cfg = cfg.probes.kv_events
        self.tuning = cfg.probes.tuning.kv_events
        self.kv = kv
        self.metrics = metrics
        self._http = http
        self._block_size_of = block_size_of  # as scraped: an index that saw no block yet
        self._indexed: dict[str, WorkerConfig] = {w.label: w for w in cfg.workers if w.kv_events}

    def active(self) -> bool:
        return self.cfg.tokenize == "auto" and any(
            self.kv.index(label) is not None for label in self._indexed)

    async def token_ids(self, route: str, obj: Mapping[str, Any],
                        prefer: str | None = None) -> list[int] | None:
        """The prompt's token ids from a worker with a usable index (``prefer`` first)."""
        payload = tokenize_request(route, obj)
        http = self._http()
        if payload is None or http is None:
            return None
        labels = sorted(self._indexed, key=lambda w: w != prefer)
        label = next((w for w in labels if self.kv.index(w) is not None), None)
        if label is None:
            return None
        url = self._indexed[label].url.rstrip("/") + "/tokenize"
        t = time.perf_counter()
        try:
            async with asyncio.timeout(self.tuning.tokenize_timeout_s):
                async with http.post(url, json=payload) as r:
                    data = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("tokenize at %s failed: %r", url, exc)
            data = None
        self.metrics.kv_tokenize_seconds.labels().inc(time.perf_counter() - t)
        ids = data.get("tokens") if isinstance(data, dict) else None
        ok = isinstance(ids, list) and all(type(i) is int for i in ids)
        self.metrics.kv_tokenize.labels("ok" if ok else "failed").inc()
        return ids if ok else None

    def prefix(self, ids: list[int] | None) -> dict[str, int] | None:
        """Resident prefix tokens of ``ids`` per worker with a usable index (None: none)."""
        if ids is None:
            return None
        out = {}
        for label in self._indexed:
            n = self.kv.resident_prefix_tokens(label, ids)
            if n is not None:
                out[label] = n
        return out or None

    def resident(self, label: str, ids: list[int] | None) -> int | None:
        return None if ids is None else self.kv.resident_prefix_tokens(label, ids)

    def predict(self, label: str, ids: list[int] | None) -> Prediction | None:
        """The call's ``cached_tokens`` as the worker's index predicts it now."""
        ix = self.kv.index(label)
        if ids is None or ix is None:
            return None
        bs = ix.block_size or self._block_size_of(label)
        if bs is None:
            return None
        return Prediction(label, ix.predicted_cached_tokens(ids), bs)

    def compare(self, p: Prediction | None, cached_tokens: int | None) -> str | None:
        """The engine's answer is in: count the prediction's outcome."""
        if p is None or cached_tokens is None:
            return None
        outcome = prediction_outcome(p.predicted, cached_tokens, p.block_size)
        self.metrics.kv_predictions.labels(p.worker, outcome).inc()
        return outcome

    def session_blocks(self, label: str) -> dict[str, int] | None:
        ix = self.kv.index(label)
        return None if ix is None else ix.session_block_counts()
