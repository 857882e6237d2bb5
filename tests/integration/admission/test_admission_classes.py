"""Service classes and tenant shares through the gateway: the x-session-class header, the
order it buys, and the refusals that name their reason in x-marsproxy-reason."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.integration.admission.conftest import Stack, StackFactory


async def _chat(s: Stack, session: str, *, key: str = "k", cls: str | None = None,
                final: bool = False) -> tuple[int, dict[str, str], dict[str, Any]]:
    headers = {"x-session-id": session, "Authorization": f"Bearer {key}"}
    if cls is not None:
        headers["x-session-class"] = cls
    if final:
        headers["x-session-final"] = "true"
    body = {"model": "tiny-emulated", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    async with s.http.post(s.url("/v1/chat/completions"), json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


async def _queued(s: Stack, n: int) -> bool:
    return await s.queue_length() == n


async def test_interactive_is_admitted_ahead_of_an_earlier_batch_session(
    make_stack: StackFactory,
) -> None:
    s = await make_stack(window=1)
    assert (await _chat(s, "holder"))[0] == 200  # holds the only slot across its tool phase
    batch = asyncio.create_task(_chat(s, "b", cls="batch"))
    await s.until(lambda: _queued(s, 1))
    inter = asyncio.create_task(_chat(s, "i", cls="interactive"))
    await s.until(lambda: _queued(s, 2))
    assert (await _chat(s, "holder", final=True))[0] == 200
    assert (await asyncio.wait_for(inter, 10))[0] == 200
    assert not batch.done() and await s.queue_length() == 1
    assert (await _chat(s, "i", cls="interactive", final=True))[0] == 200
    assert (await asyncio.wait_for(batch, 10))[0] == 200


async def test_an_unknown_class_is_400_with_its_reason(make_stack: StackFactory) -> None:
    s = await make_stack(window=1)
    status, headers, body = await _chat(s, "x", cls="platinum")
    assert status == 400
    assert body["error"]["code"] == headers["x-marsproxy-reason"] == "unknown_session_class"


async def test_a_tenant_over_its_queue_share_gets_429_while_others_wait(
    make_stack: StackFactory,
) -> None:
    s = await make_stack(window=1, queue_max=4)
    assert (await _chat(s, "holder", key="a"))[0] == 200
    waiting = [asyncio.create_task(_chat(s, f"a{i}", key="a")) for i in range(2)]
    await s.until(lambda: _queued(s, 2))  # alone, "a" may fill the queue
    waiting.append(asyncio.create_task(_chat(s, "b0", key="b")))
    await s.until(lambda: _queued(s, 3))
    status, headers, body = await _chat(s, "a2", key="a")  # 2 of its share of 2 wait
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == headers["x-marsproxy-reason"] == "tenant_over_share"
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
