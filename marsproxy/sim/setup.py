"""How a simulation is set up: the engines, the tools' host and the agents' manners."""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.emulator.profiles import EngineProfile
from marsproxy.sched.tickets import Mode


@dataclass(frozen=True, slots=True)
class SimSetup:
    profile: EngineProfile
    workers: int = 1
    tool_cpus: float = 16.0
    busy_cpus: float = 0.0
    """Of the ``tool_cpus`` cores, those taken by other work on the tools' host (the engine's
    host process, the proxy, the agents): tools share ``tool_cpus - busy_cpus`` of them while
    the proxy counts ``tool_cpus``, as on a live host where they all run side by side."""
    system_prompt_tokens: int = 600
    worker_mode: Mode = "priority"
    """How workers order continuations (with a priority policy): ``priority`` — engines
    schedule by the body's ``priority`` (vLLM ``--scheduling-policy priority``); ``gated`` —
    FCFS engines, the scheduler core's dispatch gate releases continuations in level order."""
    report_tools: bool = True
    """Agents report tool_start/tool_end with the tool kind (else the tracker infers phases)."""
    send_final: bool = True
    """Agents flag their last call as final; else (a plain OpenAI client) the proxy holds each
    session until its idle timeout, and the run goes on until the last one has ended."""
    tool_calls: bool = True
    """Agents act through tool calls (OpenAI function calling, Anthropic tool use): each reply
    but a session's last calls a tool, the last answers, and the proxy reads which; else they
    act in text (Aider, SWE-agent) and no reply says anything of the session's end."""
    pressure_every: int = 5
    """A pressure_sample event every this many control ticks (the gateway: every 5th scrape)."""
    time_scale: float = 1.0
    """Seconds of the run per modelled engine second (as the emulator's --time-scale), so a
    simulation can mirror a live run on slowed-down emulated workers."""
    horizon_s: float = 1e7
    """Give up at this virtual time (a policy that deadlocks must not hang the run)."""
    call_overhead_s: float = 0.0
    """Seconds between a tool phase's end and the agent's next call reaching the proxy: what
    the agent, the HTTP stacks and the proxy spend per call outside the engine and the tools.
    The session holds its admission slot meanwhile. Zero by default; a live run on a busy
    2-core host spends some 10–15 ms."""
    state_every_s: float = 0.0
    """Keep a state snapshot (the admission core's part of ``/mars/v1/state`` and each
    engine's counts) at the first control tick this many virtual seconds after the last one,
    as ``bench live`` polls the proxy's state; 0: none."""
    kv_events: bool = False
    """Workers publish KV events: the plane hears what the gateway's KV indexes would tell it
    (resident prefixes for placement and retention, resident blocks per session;
    :mod:`marsproxy.sim.kv_view`). Off: the plane hears none of it, as without events."""
