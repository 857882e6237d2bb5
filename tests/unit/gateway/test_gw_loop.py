"""Choosing the event loop of `marsproxy serve` (server.event_loop)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from marsproxy.config import ConfigError
from marsproxy.gateway.http.loop import loop_factory, run

uvloop = pytest.importorskip("uvloop")


async def _loop_type() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_and_uvloop_run_on_uvloop() -> None:
    assert loop_factory("auto") is uvloop.new_event_loop
    assert run(_loop_type, "auto").startswith("uvloop")
    assert run(_loop_type, "uvloop").startswith("uvloop")


def test_asyncio_runs_on_the_default_loop() -> None:
    assert loop_factory("asyncio") is None
    assert run(_loop_type, "asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_factory("auto") is None
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_factory("uvloop")
