"""Example agent for the compose stacks: a few coding-agent-like sessions through marsproxy.

Each session has its own id (sent as ``x-session-id`` through the openai SDK's
``default_headers``), appends to its chat history turn by turn, streams every reply, "runs a
tool" between calls (a sleep), and marks its last call with ``x-session-final: true``.

Environment: OPENAI_BASE_URL (e.g. http://marsproxy:8080/v1), OPENAI_API_KEY, MODEL,
AGENT_SESSIONS (default 4), AGENT_TURNS (default 3), AGENT_TOOL_SECONDS (default 0.5).
Needs only the ``openai`` package.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from typing import Any

from openai import AsyncOpenAI


async def run_session(n: int, model: str, turns: int, tool_s: float) -> str:
    session_id = f"compose-agent-{n}-{uuid.uuid4().hex[:8]}"
    client = AsyncOpenAI(default_headers={"x-session-id": session_id})
    messages: list[Any] = [
        {"role": "system", "content": "You are a coding agent. Answer with one shell command."},
        {"role": "user", "content": f"Task {n}: make the failing test in tests/test_{n}.py pass."},
    ]
    for turn in range(1, turns + 1):
        final = turn == turns
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-session-final": "true"} if final else None,
        )
        reply = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                reply.append(chunk.choices[0].delta.content)
        messages.append({"role": "assistant", "content": "".join(reply)})
        if not final:
            await asyncio.sleep(tool_s)  # the tool runs
            messages.append({"role": "user", "content": f"exit code 1 after turn {turn}"})
    await client.close()
    print(f"{session_id}: {turns} turns done", flush=True)
    return session_id


async def main() -> int:
    model = os.environ.get("MODEL", "coder")
    sessions = int(os.environ.get("AGENT_SESSIONS", "4"))
    turns = int(os.environ.get("AGENT_TURNS", "3"))
    tool_s = float(os.environ.get("AGENT_TOOL_SECONDS", "0.5"))
    await asyncio.gather(*(run_session(i, model, turns, tool_s) for i in range(sessions)))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
