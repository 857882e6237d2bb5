"""What the live page reads from ``/mars/v1/state`` beyond the counts: who waits in the
admission queue, how long, why and with which Retry-After; the overload marks; each session's
age, level and retained KV. One emulated worker with an admission window of one session."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from marsproxy.config import load_config
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.gateway.http.app import start


async def test_state_shows_who_waits_why_and_each_sessions_kv(run_app: Any) -> None:
    runner, worker = await run_app(create_app(EmulatorOptions(profile="tiny", time_scale=0.05)))
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": worker, "name": "w0"}],
        "server": {"port": 0},
        "health": {"interval_s": 0.1},
        "probes": {"vllm": {"period_s": 0.05}, "nvml": {"enabled": False}},
        "admission": {"window_init": 1, "window_min": 1, "window_max": 1,
                      "tuning": {"idle_admit": False, "kv_enter": 0.8, "kv_leave": 0.7}},
        "scheduler": {"priority_policy": "las"},  # levels to show (session order has none)
    })
    proxy = await start(cfg)
    url = f"http://127.0.0.1:{proxy.port}"
    body = {"model": "tiny-emulated", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}]}
    try:
        async with aiohttp.ClientSession() as http:
            async def chat(sid: str) -> int:
                async with http.post(f"{url}/v1/chat/completions", json=body,
                                     headers={"x-session-id": sid}) as r:
                    await r.read()
                    return r.status

            async def state() -> dict[str, Any]:
                async with http.get(f"{url}/mars/v1/state?sessions=1") as r:
                    return await r.json()  # type: ignore[no-any-return]

            assert await chat("holder") == 200
            waiter = asyncio.create_task(chat("waiter"))
            for _ in range(200):
                doc = await state()
                q = doc["admission"]["queue"]
                # (until the first control tick with fresh pressure the worker reads stale)
                if q["waiting"] and q["why"] == "w0: full 1/1 (window)":
                    break
                await asyncio.sleep(0.02)
            adm = doc["admission"]
            assert adm["marks"]["kv_enter"] == 0.8 and adm["marks"]["kv_leave"] == 0.7
            assert adm["workers"]["w0"]["binds"] == "window"
            (w,) = adm["queue"]["waiting"]
            assert w["session"] == "waiter" and w["waited_s"] >= 0 and w["bypasses"] == 0
            assert w["est_tokens"] > 0 and w["retry_after_s"] >= 1
            assert adm["queue"]["why"] == "w0: full 1/1 (window)"
            rows = {d["id"]: d for d in doc["sessions"]["details"]}
            held = rows["holder"]
            assert held["level"] == 0 and held["worker"] == "w0"
            assert held["age_s"] >= held["since_s"] >= 0
            assert held["retained_blocks"] >= 0
            assert rows["waiter"]["level"] is None  # no call dispatched yet

            async with http.delete(f"{url}/mars/v1/sessions/holder") as r:
                assert r.status == 200
            assert await asyncio.wait_for(waiter, 30) == 200
            doc = await state()
            assert doc["admission"]["queue"]["waiting"] == []
            assert doc["admission"]["queue"]["why"] == ""
    finally:
        await proxy.stop()
        await runner.cleanup()
