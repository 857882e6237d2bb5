"""The event bus: fan-out, filters, bounded loss for slow readers, no publisher blocking."""

from __future__ import annotations

import asyncio
import contextlib

from marsproxy.core.events import LlmEnd, SessionEnd, ToolStart, event_to_dict
from marsproxy.telemetry.bus import EventBus


def test_every_subscriber_sees_every_event_in_order() -> None:
    bus = EventBus(capacity=16)
    a, b = bus.subscribe(), bus.subscribe()
    for i in range(5):
        bus.publish(ToolStart(ts=float(i), session="s", tool="pytest"))
    assert [e.ts for e in a.poll()] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [e.ts for e in b.poll()] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert a.poll() == []


def test_subscription_starts_at_the_next_event() -> None:
    bus = EventBus()
    bus.publish(SessionEnd(ts=1.0))
    sub = bus.subscribe()
    bus.publish(SessionEnd(ts=2.0))
    assert [e.ts for e in sub.poll()] == [2.0]


def test_slow_subscriber_loses_oldest_and_the_loss_is_counted() -> None:
    bus = EventBus(capacity=4)
    slow, fast = bus.subscribe(), bus.subscribe()
    for i in range(3):
        bus.publish(SessionEnd(ts=float(i)))
    assert len(fast.poll()) == 3
    for i in range(3, 10):
        bus.publish(SessionEnd(ts=float(i)))
    got = slow.poll()
    assert [e.ts for e in got] == [6.0, 7.0, 8.0, 9.0]  # the newest `capacity` events
    assert slow.dropped == 6 and bus.dropped_total == 6
    assert [e.ts for e in fast.poll()] == [6.0, 7.0, 8.0, 9.0]
    assert fast.dropped == 3 and bus.dropped_total == 9
    assert bus.published_total == 10


def test_filter_applies_per_subscriber() -> None:
    bus = EventBus()
    only_llm = bus.subscribe(lambda e: e.type == "llm_end")
    bus.publish(ToolStart(ts=1.0))
    bus.publish(LlmEnd(ts=2.0, prompt_tokens=5))
    assert [e.type for e in only_llm.poll()] == ["llm_end"]


async def test_waiting_subscribers_wake_on_publish() -> None:
    bus = EventBus()
    subs = [bus.subscribe() for _ in range(3)]
    tasks = [asyncio.create_task(s.get_batch()) for s in subs]
    await asyncio.sleep(0)
    assert not any(t.done() for t in tasks)
    bus.publish(LlmEnd(ts=1.0))
    done = await asyncio.gather(*tasks)
    assert all(len(b) == 1 for b in done)


async def test_cancelled_waiter_does_not_break_others() -> None:
    bus = EventBus()
    s1, s2 = bus.subscribe(), bus.subscribe()
    t1 = asyncio.create_task(s1.get_batch())
    t2 = asyncio.create_task(s2.get_batch())
    await asyncio.sleep(0)
    t1.cancel()
    await asyncio.sleep(0)
    bus.publish(LlmEnd(ts=1.0))
    assert len(await asyncio.wait_for(t2, 1.0)) == 1


async def test_iteration_closes_the_subscription() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    assert bus.subscribers == 1
    bus.publish(LlmEnd(ts=1.0))
    gen = sub.__aiter__()
    async with contextlib.aclosing(gen):
        async for ev in gen:
            assert ev.ts == 1.0
            break
    assert bus.subscribers == 0


def test_event_wire_form() -> None:
    d = event_to_dict(LlmEnd(ts=3.0, session="t:s", worker="w0", prompt_tokens=10,
                             cached_tokens=8, completion_tokens=2))
    assert d["type"] == "llm_end" and d["cached_tokens"] == 8 and d["worker"] == "w0"


def test_without_subscribers_events_are_counted_not_kept() -> None:
    bus = EventBus(capacity=16)
    sub = bus.subscribe()
    bus.publish(SessionEnd(ts=1.0))
    sub.close()
    for i in range(3):
        bus.publish(SessionEnd(ts=float(10 + i)))  # nobody can read these
    bus.skip()  # what the request path does instead of building an event
    assert bus.published_total == 5
    assert len(bus._ring) == 0
    later = bus.subscribe()  # starts at the next event, as ever
    bus.publish(SessionEnd(ts=20.0))
    bus.publish(SessionEnd(ts=21.0))
    assert [e.ts for e in later.poll()] == [20.0, 21.0]
    assert later.dropped == 0 and bus.dropped_total == 0
    assert bus.published_total == 7
