#!/usr/bin/env python3
"""Capture vLLM's KV event stream from a real vLLM 0.32 (tiny model) into a fixture.

Starts the tiny model with ``--kv-events-config`` (PUB + replay sockets on loopback) and
``--enable-prompt-tokens-details``, subscribes, sends chat requests one at a time (three sessions
sharing a system prompt, later turns extending earlier ones, then unrelated prompts that evict,
then the first session again), and writes ``tests/fixtures/vllm-0.32-kv-events.json``:

- ``frames``: every live frame as ``[topic, seq, payload (base64)]``
- ``replay``: the replay socket's answer to a request from seq 0 (the same frame form, the end
  marker last)
- ``requests``: per request its session, prompt token ids, ``cached_tokens`` from the response's
  usage and ``after_seq`` (the last sequence number received before it was sent)
- ``sources``: the body of ``GET /kv_event_sources``

Run with the project's venv (pyzmq, msgpack, httpx):
    .venv/bin/python scripts/real-vllm/capture_kv_events.py [OUT_FILE]
Env: PORT (default 47623), ZMQ_PORT (default PORT+1; replay PORT+2), NUM_BLOCKS (default 40),
     BLOCK_SIZE (default 32; the CPU backend needs a multiple of 32),
     MODEL_DIR (default $REAL_VLLM_HOME/models/tiny).
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HOME = Path(os.environ.get("MARS_REAL_VLLM_HOME")
            or Path.home() / ".cache" / "marsproxy" / "real-vllm")
SETTLE_S = 0.4  # no frame for this long after a response: the engine's last step is published


def kv_events_config(zmq_port: int, topic: str = "kv") -> dict[str, Any]:
    """vLLM binds its PUB socket only to an endpoint with a wildcard host (else it connects)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{zmq_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{zmq_port + 1}", "topic": topic}


class Capture:
    """A SUB socket in a thread that keeps every frame it receives."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.frames: list[list[bytes]] = []
        self.last_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                self.frames.append(self.sub.recv_multipart())
                self.last_at = time.monotonic()

    def last_seq(self) -> int:
        return int.from_bytes(self.frames[-1][1], "big") if self.frames else -1

    def settle(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() - self.last_at < SETTLE_S and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(SETTLE_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def replay_from(endpoint: str, start: int, timeout_s: float = 5.0) -> list[list[bytes]]:
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[list[bytes]] = []
    try:
        while d.poll(int(timeout_s * 1000)):
            msg = d.recv_multipart()
            out.append(msg[1:])
            if int.from_bytes(msg[2], "big", signed=True) == -1:
                break
    finally:
        d.close(linger=0)
        ctx.term()
    return out


def _words(rng: random.Random, n: int) -> str:
    vocab = ["alpha", "beta", "gamma", "delta", "kernel", "queue", "thread", "buffer", "socket",
             "parse", "render", "commit", "branch", "merge", "token", "block", "cache", "prefix"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def scenario(seed: int = 7) -> list[tuple[str, list[dict[str, str]]]]:
    """(session, messages) in sending order: shared system prompt, growing turns, evictors."""
    rng = random.Random(seed)
    system = {"role": "system", "content": "You are a coding agent. " + _words(rng, 120)}
    convs: dict[str, list[dict[str, str]]] = {
        s: [system, {"role": "user", "content": f"task {s}: " + _words(rng, 60)}]
        for s in ("a", "b", "c")
    }
    order: list[tuple[str, list[dict[str, str]]]] = []
    for turn in range(2):
        for s in ("a", "b", "c"):
            if turn:
                convs[s] = [*convs[s], {"role": "assistant", "content": _words(rng, 8)},
                            {"role": "user", "content": "tool output " + _words(rng, 50)}]
            order.append((s, list(convs[s])))
    for i in range(4):  # unrelated prompts: push the sessions' blocks out
        order.append((f"x{i}", [{"role": "user", "content": f"other {i} " + _words(rng, 260)}]))
    convs["a"] = [*convs["a"], {"role": "assistant", "content": _words(rng, 8)},
                  {"role": "user", "content": "more " + _words(rng, 30)}]
    order.append(("a", list(convs["a"])))
    order.append(("b", list(convs["b"])))
    return order


def run_scenario(base: str, cap: Capture, model: str = "tiny") -> list[dict[str, Any]]:
    """Send the scenario one request at a time; per request what the engine reported."""
    out: list[dict[str, Any]] = []
    with httpx.Client(timeout=120) as client:
        for session, messages in scenario():
            cap.settle()
            after = cap.last_seq()
            r = client.post(f"{base}/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": 4, "ignore_eos": True,
                "temperature": 0, "session_id": session, "return_token_ids": True,
            })
            r.raise_for_status()
            body = r.json()
            details = body["usage"].get("prompt_tokens_details") or {}
            out.append({"session": session, "after_seq": after,
                        "prompt_token_ids": body.get("prompt_token_ids"),
                        "prompt_tokens": body["usage"]["prompt_tokens"],
                        "cached_tokens": details.get("cached_tokens") or 0})
        cap.settle()
    return out


def _b64(frames: list[list[bytes]]) -> list[list[str]]:
    return [[base64.b64encode(f).decode() for f in fr] for fr in frames]


def dumps(doc: dict[str, Any]) -> str:
    """JSON with one line per top-level key and per frame or request (diffs stay readable)."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list):
            items = ",\n  ".join(json.dumps(v, separators=(",", ":")) for v in value)
            lines.append(f' "{key}": [\n  {items}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> int:
    out_file = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        REPO / "tests" / "fixtures" / "vllm-0.32-kv-events.json")
    port = int(os.environ.get("PORT", "47623"))
    zport = int(os.environ.get("ZMQ_PORT", str(port + 1)))
    model_dir = os.environ.get("MODEL_DIR", str(HOME / "models" / "tiny"))
    cfg = kv_events_config(zport)
    env = {**os.environ, "SERVED_MODEL_NAME": "tiny",
           "NUM_BLOCKS": os.environ.get("NUM_BLOCKS", "40"),
           "BLOCK_SIZE": os.environ.get("BLOCK_SIZE", "32")}
    # vLLM refuses a max model length its whole cache cannot hold
    env["MAX_MODEL_LEN"] = str((int(env["NUM_BLOCKS"]) - 4) * int(env["BLOCK_SIZE"]))
    subprocess.run([str(HERE / "start.sh"), model_dir, str(port), "--kv-events-config",
                    json.dumps(cfg), "--enable-prompt-tokens-details"], env=env, check=True)
    try:
        base = f"http://127.0.0.1:{port}"
        cap = Capture(f"tcp://127.0.0.1:{zport}", cfg["topic"])
        time.sleep(1.0)  # the SUB socket's subscription reaches the publisher
        requests = run_scenario(base, cap)
        replay = replay_from(cfg["replay_endpoint"], 0)
        sources = httpx.get(f"{base}/kv_event_sources", timeout=10).json()
        cap.close()
    finally:
        subprocess.run([str(HERE / "stop.sh"), str(port)], check=False)
    doc = {"vllm": "0.32.0", "kv_events_config": cfg, "block_size": int(env["BLOCK_SIZE"]),
           "num_blocks": int(env["NUM_BLOCKS"]), "sources": sources,
           "frames": _b64(cap.frames), "replay": _b64(replay), "requests": requests}
    out_file.write_text(dumps(doc))
    hits = sum(1 for r in requests if r["cached_tokens"])
    print(f"wrote {out_file}: {len(cap.frames)} frames, {len(replay)} replayed,"
          f" {len(requests)} requests ({hits} with cached tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
