"""A gateway in front of the fake worker of conftest.py, as the relay tests start and call it.

Shared by test_gw_relay_fake.py (forwarding, usage) and test_gw_relay_errors.py (errors,
timeouts, cancellation): one file would be over the 400-line limit.
"""

from __future__ import annotations

from typing import Any

from marsproxy.config import MarsConfig, load_config
from marsproxy.gateway.http.app import Running, start


def config(workers: list[str], **sections: Any) -> MarsConfig:
    over: dict[str, Any] = {"workers": workers, "server": {"port": 0}}
    for k, v in sections.items():
        over[k] = {**over.get(k, {}), **v}
    return load_config(None, environ={}, overrides=over)


async def gateway(cfg: MarsConfig) -> Running:
    return await start(cfg)


def url(g: Running, path: str) -> str:
    return f"http://127.0.0.1:{g.port}{path}"


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
