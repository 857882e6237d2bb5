"""Every policy preset runs the demo path end to end: emulated workers, the proxy with the
preset, agent sessions replayed from the packaged trace (streamed turns, tool phases). The
event stream shows per continuation its level, worker and hint, and per tool phase the
retention decision with its reason; fcfs stays a plain session-affine proxy."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from marsproxy.bench.agent import ReplayOptions, filler, replay_session
from marsproxy.bench.local import start_local
from marsproxy.config import load_config
from marsproxy.core.events import Dispatch, Event, RetentionDecision
from marsproxy.emulator.server import EmulatorOptions
from marsproxy.emulator.server import create_app as create_worker_app
from marsproxy.gateway.http.app import GATEWAY_KEY
from marsproxy.gateway.http.app import create_app as create_gateway_app
from marsproxy.policies import policy_names
from marsproxy.runs.trace import load_trace, sample_sessions

PRESETS = policy_names()


@pytest.mark.parametrize("policy", PRESETS)
async def test_preset_runs_the_demo_path(policy: str) -> None:
    workers = [await start_local(create_worker_app(EmulatorOptions(time_scale=0.05)))
               for _ in range(2)]
    cfg = load_config(None, environ={}, overrides={
        "policy": policy, "workers": [w.url for w in workers], "health": {"interval_s": 0.5},
        "probes": {"nvml": {"enabled": False}},
    })
    app = create_gateway_app(cfg)
    gw = app[GATEWAY_KEY]
    sub = gw.telemetry.bus.subscribe(lambda e: isinstance(e, Dispatch | RetentionDecision))
    proxy = await start_local(app)
    try:
        traces = sample_sessions(load_trace(None), 3, 1)
        async with aiohttp.ClientSession() as http:
            replay = ReplayOptions(base_url=proxy.url, model="tiny-emulated", token_scale=0.05,
                                   tool_time_scale=0.01, max_turns=3, seed=1)
            system = filler(replay.system_prompt_tokens, random.Random(1))
            results = await asyncio.gather(
                *(replay_session(http, t, replay, system) for t in traces))
    finally:
        await proxy.stop()
        for w in workers:
            await w.stop()
    assert all(r.ok for r in results), [r.session_id for r in results if not r.ok]
    events: list[Event] = sub.poll(limit=1 << 16)
    dispatches = [e for e in events if isinstance(e, Dispatch)]
    decisions = [e for e in events if isinstance(e, RetentionDecision)]
    assert len(dispatches) == sum(len(r.turns) for r in results)
    assert all(d.worker for d in dispatches)
    scfg = cfg.scheduler
    if policy == "fcfs":
        # A plain session-affine proxy: no level, nothing gated, no hint, no retention.
        assert {(d.level, d.hint, d.mode) for d in dispatches} == {(None, "none", "")}
        assert decisions == []
        assert {gw.scheduler.mode(w.label) for w in cfg.workers} == {"off"}
        return
    if scfg.priority_policy == "las":
        assert all(d.level is not None and 0 <= d.level <= 3 for d in dispatches)
    if scfg.priority_policy == "session_fcfs":
        assert all(d.level is None for d in dispatches)
    if scfg.priority_policy != "off":
        assert all(d.hint.startswith("gated") for d in dispatches)
    if scfg.retention_policy == "off":
        assert decisions == []
    else:
        # One decision per tool phase (every turn but each session's last), with its reason.
        assert len(decisions) >= len(results)
        assert all(d.reason and d.policy == scfg.retention_policy for d in decisions)
