"""A plain client direct to a worker and through marsproxy on defaults, side by side (prints
numbers, not a test).

    .venv/bin/python benchmarks/plain_clients.py [--concurrency 8] [--seconds 60] [--rounds 2]
        [--num-blocks 512] [--prompt-chars 2000] [--max-tokens 32] [--agents 0]
        [--light-agents 0]

The client is what a batch job with a stock OpenAI client sends: ``--concurrency`` loops, each
sending one chat call after another, every call a new task (a fresh random prompt, so no prefix
is shared), its API key, no session header, no final flag. One emulated worker (``marsproxy
emulate --profile tiny --num-blocks N``) serves every run; each round runs the client direct to it,
then through a fresh ``marsproxy serve --worker URL`` without a config file (the embedded
defaults). Per run: calls done (with the errors), mean, P50, P99 and worst call, and the mean
of the calls after the first 30 s (by then a key's one-shot tasks are known for what they are);
per round the proxy's mean over direct's, overall and after 30 s. "Never worse than no proxy"
is a ratio near 1.

``--agents N`` runs N agent loops beside the batch client, under another API key: each sends
sessions of ``AGENT_CALLS`` calls with an ``x-session-id``, a conversation that grows by the
reply and a tool result, ``AGENT_TOOL_S`` between calls and the final flag on the last. Both
clients' means are printed; the batch client must not pay for sharing the worker with agents.
``--light-agents K`` adds K more agent loops under a third key ("light"): beside the many
agents of ``--agents``, a light tenant, which max-min fairness serves as if alone (its calls'
mean against direct's is printed too).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from marsproxy.bench.procs import CLI, free_port, stop_all, wait_up


# After this long a key's one-shot tasks are known (kv_hold_min_s, 20 s, past the first ones):
# runs longer than that also print the mean of the calls that ended after it.
LEARNT_S = 30.0
AGENT_CALLS = 6
AGENT_TOOL_S = 0.3


@dataclass
class Run:
    latencies_s: list[float] = field(default_factory=list)
    ended_s: list[float] = field(default_factory=list)
    """When each call ended, from the run's start."""
    errors: dict[int, int] = field(default_factory=dict)

    def late(self) -> float | None:
        """Mean latency of the calls that ended after ``LEARNT_S`` (``None``: none did)."""
        late = [x for x, t in zip(self.latencies_s, self.ended_s) if t >= LEARNT_S]
        return statistics.mean(late) if late else None

    def line(self, name: str) -> str:
        lat = sorted(self.latencies_s)
        if not lat:
            return f"{name:>8}: no call done, errors {self.errors}"
        ms = [x * 1000 for x in lat]
        late = self.late()
        after = f", after {LEARNT_S:g} s {late * 1000:.1f} ms" if late else ""
        return (f"{name:>8}: {len(lat)} calls (errors {sum(self.errors.values())}), mean"
                f" {statistics.mean(ms):.1f} ms, P50 {ms[len(ms) // 2]:.1f}, P99"
                f" {ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.1f}, worst {ms[-1]:.1f}{after}")


async def client(url: str, concurrency: int, seconds: float, chars: int,
                 max_tokens: int, agents: dict[str, int]) -> tuple[Run, dict[str, Run]]:
    """The batch client's run and each agent key's (``agents``: loops per API key), side by
    side."""
    run, agent_runs, rnd = Run(), {key: Run() for key in agents}, random.Random()
    start = time.monotonic()
    end = start + seconds
    letters = string.ascii_lowercase + " "

    async def loop(session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            text = f"task {i}-{n}: " + "".join(rnd.choices(letters, k=chars))
            body = {"model": "tiny-emulated", "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": text}]}
            await call(session, run, body, {"Authorization": "Bearer batch"})

    async def call(session: aiohttp.ClientSession, into: Run, body: dict[str, object],
                   headers: dict[str, str]) -> str | None:
        t0 = time.monotonic()
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                headers=headers) as r:
            if r.status != 200:  # counted, whatever its body
                await r.read()
                into.errors[r.status] = into.errors.get(r.status, 0) + 1
                return None
            reply = await r.json()
        t1 = time.monotonic()
        into.latencies_s.append(t1 - t0)
        into.ended_s.append(t1 - start)
        return str(reply["choices"][0]["message"]["content"])

    async def agent(session: aiohttp.ClientSession, key: str, i: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            sid = f"{key}-{i}-{n}-{rnd.getrandbits(32):08x}"
            messages = [{"role": "user", "content": f"fix bug {sid}: "
                         + "".join(rnd.choices(letters, k=chars))}]
            for k in range(AGENT_CALLS):
                headers = {"Authorization": f"Bearer {key}", "x-session-id": sid}
                if k == AGENT_CALLS - 1:
                    headers["x-session-final"] = "true"
                body = {"model": "tiny-emulated", "max_tokens": max_tokens,
                        "messages": messages}
                reply = await call(session, agent_runs[key], body, headers)
                if reply is None:
                    break
                messages = [*messages, {"role": "assistant", "content": reply},
                            {"role": "user", "content": "tool output: "
                             + "".join(rnd.choices(letters, k=chars // 4))}]
                await asyncio.sleep(AGENT_TOOL_S)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(loop(session, i) for i in range(concurrency)),
                             *(agent(session, key, i) for key, n in agents.items()
                               for i in range(n)))
    return run, agent_runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0, help="per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=512, help="the worker's KV blocks")
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--agents", type=int, default=0,
                    help="agent loops beside the batch client, under another API key")
    ap.add_argument("--light-agents", type=int, default=0,
                    help="agent loops under a third API key (a light tenant)")
    ap.add_argument("--config", default=None,
                    help="marsproxy's config file (default: none, the embedded defaults)")
    a = ap.parse_args(argv)
    keys = {k: n for k, n in (("agents", a.agents), ("light", a.light_agents)) if n > 0}
    shape = (a.concurrency, a.seconds, a.prompt_chars, a.max_tokens, keys)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wport = free_port()
        worker = subprocess.Popen(
            [*CLI, "emulate", "--profile", "tiny", "--num-blocks", str(a.num_blocks),
             "--port", str(wport)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(worker)
        direct_url = f"http://127.0.0.1:{wport}"
        wait_up(f"{direct_url}/health", worker)
        print(f"{a.concurrency} at a time, {a.prompt_chars}-character prompts, {a.max_tokens}"
              f" tokens out, {a.seconds:g} s per run, worker tiny with {a.num_blocks} blocks"
              + "".join(f", {n} {k} beside" for k, n in keys.items()))
        for r in range(a.rounds):
            direct, direct_agents = asyncio.run(client(direct_url, *shape))
            pport = free_port()
            proxy = subprocess.Popen(
                [*CLI, "serve", "--worker", direct_url, "--port", str(pport),
                 *(["--config", a.config] if a.config else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_up(f"http://127.0.0.1:{pport}/readyz", proxy)
                proxied, proxied_agents = asyncio.run(
                    client(f"http://127.0.0.1:{pport}", *shape))
            finally:
                stop_all([proxy])
            print(f"round {r}:\n{direct.line('direct')}\n{proxied.line('marsproxy')}")
            if direct.latencies_s and proxied.latencies_s:
                ratio = statistics.mean(proxied.latencies_s) / statistics.mean(direct.latencies_s)
                p_late, d_late = proxied.late(), direct.late()
                after = (f"; after {LEARNT_S:g} s {p_late / d_late:.2f}x"
                         if p_late and d_late else "")
                print(f"   mean marsproxy / direct: {ratio:.2f}x{after}")
            for k in keys:
                d, p = direct_agents[k], proxied_agents[k]
                print(f"{d.line(k)} (direct)\n{p.line(k)} (marsproxy)")
                if d.latencies_s and p.latencies_s:
                    ratio = statistics.mean(p.latencies_s) / statistics.mean(d.latencies_s)
                    print(f"   {k}' mean call marsproxy / direct: {ratio:.2f}x")
    finally:
        stop_all(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
