"""The system under test of ``marsproxy bench live``: its setup, and the worker (emulated) and
proxy processes of one policy's run, each up until its block ends."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from marsproxy.bench.live_vllm import VllmFacts
from marsproxy.bench.procs import CLI, free_port, wait_up
from marsproxy.emulator.profiles import EngineProfile, get_profile
from marsproxy.runs import options

CALL_TIMEOUT_S = 900.0
"""What an agent allows one call once admitted, on top of the queue deadline."""


@dataclass(frozen=True, slots=True)
class LiveSetup:
    profile: str = "tiny"
    time_scale: float = 1.0
    workers: int = 1
    num_blocks: int | None = None
    max_model_len: int | None = None
    vllm_urls: tuple[str, ...] = ()
    vllm_priority: bool | str = "auto"
    """The real workers' ``workers[].priority`` in the proxy config (true: they run
    ``--scheduling-policy priority``)."""
    vllm: VllmFacts | None = None
    """Calibrated facts of the first real worker (all are assumed alike)."""
    tool_cpus: float = 0.0
    """CPUs the proxy assumes for tools (probes.cpu.tool_cpus); 0: this host's."""
    report_tools: bool = True
    """Agents report tool_start/tool_end (`bench live` turns it off for plain clients)."""
    plain_clients: bool = False
    """Agents send nothing special: no session id, no final flag (and no tool events)."""
    tool_calls: bool = False
    """Agents act through tool calls (a forced call on every turn but the last, which
    answers in text), so the proxy can read the end of each task from its replies."""
    min_tool_cpu_s: float = 0.05
    system_prompt_tokens: int = 60
    request_timeout_s: float = 900.0
    """The agents' limit on one call, admission wait included (``bench live``: the queue
    deadline plus ``CALL_TIMEOUT_S``)."""
    start_timeout_s: float = 60.0
    state_every_s: float = 1.0
    """Read the proxy's ``GET /mars/v1/state`` this often during a run (0: never)."""
    sets: dict[str, Any] = field(default_factory=dict)
    kv_events: bool = False
    """Emulated workers publish KV events (``--kv-events-config``) and the proxy subscribes."""
    vllm_kv_events: tuple[dict[str, str], ...] = ()
    """The real workers' ``kv_events`` entries, in ``vllm_urls`` order (they publish them
    themselves: ``vllm serve --kv-events-config``); empty: the proxy subscribes to none."""

    def engine_profile(self) -> EngineProfile:
        return get_profile(self.profile, num_blocks=self.num_blocks,
                           max_model_len=self.max_model_len)


@dataclass(frozen=True, slots=True)
class Started:
    """A proxy the benchmark started: where it answers, and its process (for its CPU use)."""

    url: str
    pid: int


@contextlib.contextmanager
def run_process(args: list[str], log: Path, url: str,
                timeout_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``args`` until the block ends; yields the process once ``url`` answers 200.

    The child gets no ``MARSPROXY_*`` variables: its whole config is the file the benchmark
    wrote (as :func:`options.proxy_config` reads it), not what the caller's shell holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARSPROXY_")}
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_up(url, proc, timeout_s)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _kv_events(args: list[str], kv: dict[str, dict[str, str]], url: str) -> None:
    """Publish KV events on two free ports; ``kv[url]``: the proxy's ``kv_events`` entry."""
    pub, replay = free_port(), free_port()
    args += ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})]
    kv[url] = {"endpoint": f"tcp://127.0.0.1:{pub}",
               "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}


@contextlib.contextmanager
def start_workers(setup: LiveSetup, priority: bool, logs: Path,
                  kv: dict[str, dict[str, str]] | None = None) -> Iterator[list[str]]:
    """``kv``: filled with each worker's ``kv_events`` entry (with ``setup.kv_events``)."""
    if setup.vllm_urls:
        if kv is not None:
            kv.update(zip(setup.vllm_urls, setup.vllm_kv_events, strict=False))
        yield list(setup.vllm_urls)
        return
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(setup.workers):
            port = free_port()
            args = [*CLI, "emulate", "--profile", setup.profile, "--port", str(port),
                    "--time-scale", str(setup.time_scale),
                    "--scheduling-policy", "priority" if priority else "fcfs"]
            if setup.num_blocks is not None:
                args += ["--num-blocks", str(setup.num_blocks)]
            if setup.max_model_len is not None:
                args += ["--max-model-len", str(setup.max_model_len)]
            url = f"http://127.0.0.1:{port}"
            if setup.kv_events and kv is not None:
                _kv_events(args, kv, url)
            stack.enter_context(run_process(args, logs / f"worker{i}.log", f"{url}/health",
                                         setup.start_timeout_s))
            urls.append(url)
        yield urls


def _worker_entries(workers: list[str], setup: LiveSetup, priority: bool) -> list[Any]:
    if setup.vllm_urls:
        return [{"url": u, "name": f"vllm{i}", "priority": setup.vllm_priority}
                for i, u in enumerate(workers)]
    if priority:
        # Emulated workers started with --scheduling-policy priority are declared so: the proxy
        # then sends levels in the body, as the simulator's default worker mode, instead of
        # holding continuations in its gated dispatch queue.
        return [{"url": u, "priority": True} for u in workers]
    return list(workers)


@contextlib.contextmanager
def start_proxy(policy: str, workers: list[str], setup: LiveSetup, out: Path,
                priority: bool = False, kv: dict[str, dict[str, str]] | None = None,
                ) -> Iterator[Started]:
    """``marsproxy serve --policy POLICY`` in front of ``workers`` until the block ends."""
    port = free_port()
    entries = _worker_entries(workers, setup, priority)
    if kv:
        entries = [{**(e if isinstance(e, dict) else {"url": e}), "kv_events": kv[w]}
                   for e, w in zip(entries, workers, strict=True)]
    tree: dict[str, Any] = {**options.policy_sets(policy, setup.sets), "workers": entries}
    if setup.vllm is not None:
        # The proxy estimates a new session's first prompt from its characters.
        tree.setdefault("admission", {}).setdefault("tuning", {}).setdefault(
            "chars_per_token", setup.vllm.chars_per_token)
    tree.setdefault("health", {})["interval_s"] = 0.5
    tree.setdefault("server", {})["log_level"] = "warning"
    if setup.tool_cpus > 0:
        tree.setdefault("probes", {}).setdefault("cpu", {})["tool_cpus"] = setup.tool_cpus
    cfg = out / f"proxy-{policy}.yaml"
    cfg.write_text(yaml.safe_dump(tree, sort_keys=False))
    args = [*CLI, "serve", "--config", str(cfg), "--policy", options.preset_of(policy),
            "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with run_process(args, out / f"proxy-{policy}.log", f"{url}/readyz",
                     setup.start_timeout_s) as proc:
        yield Started(url, proc.pid)
