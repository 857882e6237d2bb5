"""The event loop ``marsproxy serve`` runs on: uvloop when installed (``server.event_loop``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from marsproxy.config import ConfigError

log = logging.getLogger("marsproxy.gateway.http.loop")

T = TypeVar("T")
LoopChoice = Literal["auto", "uvloop", "asyncio"]


def loop_factory(choice: LoopChoice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "server.event_loop is uvloop, but uvloop is not installed"
                " (pip install 'marsproxy[fast]', or set it to auto)"
            ) from None
        return None
    return uvloop.new_event_loop


def run(main: Callable[[], Coroutine[Any, Any, T]], choice: LoopChoice) -> T:
    """Run ``main()`` to completion on the chosen loop."""
    factory = loop_factory(choice)  # before the coroutine exists: a ConfigError leaks nothing
    log.info("event loop: %s", "asyncio" if factory is None else "uvloop")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())
