"""Replay one agent session from a trace against an OpenAI-compatible URL, as an agent would.

Each turn sends the whole append-only chat history (system prompt, task, then every reply and
tool observation), sized so that the prompt matches the trace's ``input_tokens`` under the
emulated tokenizer (4 bytes per token; for a real model, ``ReplayOptions.chars_per_token``
measured with its tokenizer, and each turn sized from the prompt tokens the server counted),
streams the answer, then waits out the tool phase. With ``ReplayOptions.tool_calls`` the agent
acts through tool calls: each reply but the last is a call of :data:`RUN_TOOL`, and the
observation goes back as that call's ``tool`` message.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from marsproxy.runs.trace import SessionTrace
from marsproxy.runs.workload import PlannedSession, WorkloadSpec, build_workload

BYTES_PER_TOKEN = 4
_WORDS = (
    "def", "self", "return", "import", "class", "pytest", "assert", "value", "error", "path",
    "config", "line", "test", "file", "module", "patch", "diff", "token", "cache", "queue",
)


def filler(n_tokens: int, rng: random.Random, chars_per_token: float = BYTES_PER_TOKEN) -> str:
    """Deterministic text of ``n_tokens`` × ``chars_per_token`` ASCII characters (exactly
    ``n_tokens`` tokens under the emulated tokenizer; about that many under a real one whose
    ratio on this text was measured)."""
    n_chars = max(1, round(max(1, n_tokens) * chars_per_token))
    parts: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(_WORDS) + " "
        parts.append(w)
        size += len(w)
    return "".join(parts)[:n_chars]


@dataclass
class TurnResult:
    ok: bool
    status: int
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    overhead_ms: float | None = None
    error: str = ""
    sent_at: float = 0.0  # perf_counter() when the request went out


@dataclass
class SessionResult:
    session_id: str
    turns: list[TurnResult] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.turns) and all(t.ok for t in self.turns)


@dataclass(frozen=True)
class ReplayOptions:
    base_url: str
    model: str
    token_scale: float = 1.0
    tool_time_scale: float = 1.0
    max_turns: int | None = None
    system_prompt_tokens: int = 600
    seed: int = 0
    session_header: str = "x-session-id"
    request_timeout_s: float = 300.0
    chars_per_token: float = BYTES_PER_TOKEN
    """Filler characters per token of the server's tokenizer (4: the emulator's)."""
    follow_usage: bool = False
    """Size each continuation from the prompt and completion tokens the server reported for
    the previous call (a real tokenizer counts the re-sent reply and the chat template's
    markers its own way), so prompts track the trace's lengths instead of drifting."""
    plain: bool = False
    """Send no session id and no final flag, as a plain OpenAI client: the proxy finds each
    session from its conversation and ends it on its answer (with ``tool_calls``) or when it
    idles."""
    tool_calls: bool = False
    """The agent acts through tool calls, as OpenAI tool-calling agents do: every request
    carries one tool definition (:data:`RUN_TOOL`); each turn but the last forces a call
    (``tool_choice: "required"``), the last answers in text (``tool_choice: "none"``). A reply's
    call goes back into the history as the assistant message's ``tool_calls``, and the tool's
    observation as a ``tool`` message (sized as the ``user`` message it replaces)."""


RUN_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command in the task's workspace and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}
"""The one tool a ``tool_calls`` agent offers."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call read from a streamed reply (its deltas joined)."""

    id: str
    name: str
    arguments: str

    def message(self, content: str) -> dict[str, Any]:
        """The assistant message that carries this call back in the history."""
        return {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [{"id": self.id, "type": "function",
                            "function": {"name": self.name, "arguments": self.arguments}}],
        }


ToolRunner = Callable[[float, str], Awaitable[None]]
ToolReporter = Callable[[str, str, str], Awaitable[None]]


async def sleep_tool(seconds: float, kind: str) -> None:
    """Tool phase as a wait; benchmarks substitute real CPU work."""
    await asyncio.sleep(seconds)


def _mix_headers(plan: PlannedSession) -> dict[str, str]:
    """A mixed workload's group (``runs/mix.py``): its service class, or its tenant's own key
    (the proxy's tenant is a hash of the key: ``core/identity.py``)."""
    headers = {}
    if plan.cls is not None:
        headers["x-session-class"] = plan.cls
    if plan.tenant:
        headers["Authorization"] = f"Bearer sk-bench-{plan.tenant}"
    return headers


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


async def _send_turn(
    http: aiohttp.ClientSession,
    opts: ReplayOptions,
    headers: dict[str, str],
    messages: list[dict[str, Any]],
    max_tokens: int,
    tool_choice: str | None = None,
) -> tuple[TurnResult, str, ToolCall | None]:
    """One streamed call: its result, the reply's text and the tool call it made (if any).
    ``tool_choice`` (with :data:`RUN_TOOL`) is sent only when given."""
    body: dict[str, Any] = {
        "model": opts.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tool_choice is not None:
        body["tools"] = [RUN_TOOL]
        body["tool_choice"] = tool_choice
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    call_id, call_name, call_args = "", "", []
    usage: dict[str, Any] = {}
    async with http.post(
        f"{opts.base_url}/v1/chat/completions", json=body, headers=headers
    ) as resp:
        overhead = resp.headers.get("x-marsproxy-overhead-ms")
        if resp.status != 200:
            err = (await resp.text())[:300]
            return (TurnResult(False, resp.status, None, time.perf_counter() - t0, error=err),
                    "", None)
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
                for call in delta.get("tool_calls") or ():
                    if call.get("index", 0) != 0:
                        continue  # one call per reply is all this agent acts on
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    call_id = call.get("id") or call_id
                    fn = call.get("function") or {}
                    call_name = fn.get("name") or call_name
                    call_args.append(fn.get("arguments") or "")
    details = usage.get("prompt_tokens_details") or {}
    result = TurnResult(
        ok=True,
        status=200,
        ttft_s=ttft,
        latency_s=time.perf_counter() - t0,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        overhead_ms=float(overhead) if overhead else None,
    )
    made = ToolCall(call_id, call_name, "".join(call_args)) if call_id or call_name else None
    return result, "".join(text), made


def plan_from_trace(trace: SessionTrace, opts: ReplayOptions) -> PlannedSession:
    """A trace session as a planned one, with the options' scales and turn cap."""
    spec = WorkloadSpec(token_scale=opts.token_scale, tool_time_scale=opts.tool_time_scale,
                        max_turns=opts.max_turns, min_input_tokens=1)
    return build_workload([trace], spec).sessions[0]


async def replay_session(
    http: aiohttp.ClientSession,
    trace: SessionTrace,
    opts: ReplayOptions,
    shared_system_prompt: str,
    tool: ToolRunner = sleep_tool,
) -> SessionResult:
    """Drive one trace session to its end (scaled by ``opts``); see :func:`replay_plan`."""
    return await replay_plan(http, plan_from_trace(trace, opts), opts, shared_system_prompt, tool)


async def replay_plan(
    http: aiohttp.ClientSession,
    plan: PlannedSession,
    opts: ReplayOptions,
    shared_system_prompt: str,
    tool: ToolRunner = sleep_tool,
    on_tool: ToolReporter | None = None,
) -> SessionResult:
    """Drive one planned session to its end; stops at the first failed turn (as an agent
    would). ``on_tool(session, "tool_start" | "tool_end", kind)`` reports tool phases."""
    rng = random.Random(f"{opts.seed}:{plan.id}")
    turns = plan.turns
    result = SessionResult(session_id=plan.id, started=time.perf_counter())
    first = turns[0].input_tokens
    own = filler(max(1, first - opts.system_prompt_tokens - plan.shared_tokens), rng,
                 opts.chars_per_token)
    if plan.group is not None:  # the text its group shares comes first (runs/workload.py)
        own = filler(plan.shared_tokens, random.Random(f"group:{plan.group}"),
                     opts.chars_per_token) + own
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": shared_system_prompt},
        {"role": "user", "content": own},
    ]
    sent_tokens = first
    # Following the usage: how many tokens a continuation's prompt came out over its plan (the
    # template's wrapping of the reply and the observation, the reply re-encoded): the next
    # observation is that much shorter, so prompts keep to the trace's lengths.
    drift, expected = 0, 0
    call: ToolCall | None = None  # the previous reply's tool call
    for i, turn in enumerate(turns):
        if i > 0:
            n_obs = max(1, turn.input_tokens - sent_tokens - drift)
            expected = sent_tokens + n_obs
            observation = filler(n_obs, rng, opts.chars_per_token)
            if call is not None:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": observation})
            else:
                messages.append({"role": "user", "content": observation})
            sent_tokens = max(turn.input_tokens, sent_tokens + 1)
        headers = _mix_headers(plan)
        if not opts.plain:
            headers[opts.session_header] = plan.id
            if i == len(turns) - 1:
                headers["x-session-final"] = "true"
        tool_choice = None
        if opts.tool_calls:
            tool_choice = "required" if i < len(turns) - 1 else "none"
        sent = time.perf_counter()
        try:
            tr, reply, call = await _send_turn(
                http, opts, headers, messages, turn.output_tokens, tool_choice)
        except (aiohttp.ClientError, TimeoutError) as exc:
            tr, reply, call = TurnResult(False, 0, None, 0.0, error=repr(exc)), "", None
        tr.sent_at = sent
        result.turns.append(tr)
        if not tr.ok:
            break
        if call is not None:
            messages.append(call.message(reply))
        else:
            messages.append({"role": "assistant", "content": reply})
        if opts.follow_usage and tr.prompt_tokens > 0:
            if i > 0:
                drift = tr.prompt_tokens - expected
            sent_tokens = tr.prompt_tokens + tr.completion_tokens
        else:
            sent_tokens += tr.completion_tokens
        if turn.tool_s is not None and i < len(turns) - 1:
            if on_tool is not None:
                # The tool does not wait for its start report (an agent's telemetry should not
                # delay its work); the end report goes out before the next call, in order.
                await asyncio.gather(on_tool(plan.id, "tool_start", turn.tool),
                                     tool(turn.tool_s, turn.tool))
            else:
                await tool(turn.tool_s, turn.tool)
            if on_tool is not None:
                await on_tool(plan.id, "tool_end", turn.tool)
    result.ended = time.perf_counter()
    return result
