"""The emulator's ``POST /v1/chat/completions`` and ``POST /v1/completions`` over the emulated
engine.

A request asks for ``n`` choices of each of its prompts (completions may send several); each
choice is one engine request, as vLLM's engine runs each sequence of a request on its own, and
the choices are numbered prompt by prompt (``prompt × n + sample``). Usage counts each prompt
once and the tokens of every choice; a stream sends each choice's chunks with its ``index``
(chat: every choice's role chunk first), each choice's last chunk with its ``finish_reason``,
then the usage chunk and ``[DONE]`` once all are done. What vLLM's engine refuses as it takes a
streamed request is a 200 stream of one error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from marsproxy.emulator import openai_api as api
from marsproxy.emulator import openai_request as req
from marsproxy.emulator import tool_calls as tools
from marsproxy.emulator.http_util import (
    SSE_HEADERS,
    error_response,
    json_response,
    pump_steps,
    read_json,
    sse,
    wait_update,
)
from marsproxy.emulator.logprobs import ChoiceLogprobs, prompt_logprobs, prompt_tokens
from marsproxy.emulator.request import FinishedEvent, RequestError
from marsproxy.emulator.runner import EngineRunner, TokenStream
from marsproxy.emulator.tokenizer import filler_chunk, filler_text


@dataclass
class _Choice:
    index: int
    rid: str  # its engine request
    prompt: req.Prompt
    stream: TokenStream
    sent: int = 0  # tokens written (streamed)
    closed: bool = False  # its last chunk is written
    call_id: str = ""  # a forced tool call's id
    lp: ChoiceLogprobs | None = None  # when the request asks for logprobs

    @property
    def fin(self) -> FinishedEvent:
        assert self.stream.finished is not None
        return self.stream.finished


class OpenAIHandlers:
    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.model = runner.profile.model_name

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: api.Kind) -> web.StreamResponse:
        try:
            parsed = req.parse_request(
                kind, await read_json(request), self.model,
                self.runner.profile.effective_max_model_len)
        except api.ApiError as exc:
            return error_response(exc)
        if parsed.engine_error is not None:  # streamed (not streamed, parse_request raised)
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            # vLLM writes it with json.dumps' default spacing, unlike its chunks
            await resp.write(f"data: {json.dumps(parsed.engine_error.body())}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:16]
        prompts = parsed.prompts()
        many = len(prompts) * parsed.n > 1
        event = asyncio.Event()  # wakes the handler for a token of any of its choices
        choices: list[_Choice] = []
        try:
            for prompt in prompts:
                for _ in range(parsed.n):
                    sub = f"{rid}-{len(choices)}" if many else rid
                    stream = self.runner.submit(
                        sub, prompt[0], parsed.max_tokens, parsed.ignore_eos, parsed.priority,
                        parsed.session_id, event)
                    choices.append(_Choice(len(choices), sub, prompt, stream,
                                           call_id=tools.tool_call_id() if parsed.tool else "",
                                           lp=_logprobs(parsed, prompt)))
            self.runner.server_load += 1
            try:
                if parsed.stream:
                    return await self._stream(request, parsed, rid, choices)
                try:
                    while any(c.stream.finished is None for c in choices):
                        await wait_update(choices[0].stream, request)
                except ConnectionResetError:
                    return web.Response(status=499)  # nobody reads it; aborted below
                return json_response(self._full(parsed, rid, choices))
            finally:
                self.runner.server_load -= 1
        except RequestError as exc:
            return error_response(api.bad_request(str(exc)))
        finally:
            for c in choices:
                self.runner.release(c.rid)

    def _full(
        self, parsed: req.ParsedRequest, rid: str, choices: list[_Choice]
    ) -> dict[str, Any]:
        tool, out = parsed.tool, []
        # the request's prompt_logprobs, per prompt (each of its n choices carries its own)
        asked = [] if parsed.prompt_logprobs is None else [
            prompt_logprobs(toks, parsed.prompt_logprobs) for toks in parsed.scored]
        for c in choices:
            fin = c.fin
            shown = 0 if parsed.echo_only else fin.completion_tokens
            text = (c.prompt[1] or "") + filler_text(0, shown)
            lp = None if c.lp is None else c.lp.of(0, shown, shows_prompt=True)
            if tool is None:
                prompt_lp = None
                if asked and parsed.kind == "completion":
                    prompt_lp = asked[c.index // parsed.n]
                elif c.lp is not None and c.prompt[2] is not None:
                    prompt_lp = prompt_logprobs(c.lp.prompt, c.lp.top)
                out.append(api.choice(parsed.kind, c.index, text, fin.finish_reason,
                                      logprobs=lp, prompt_logprobs=prompt_lp))
            else:  # a forced tool choice: the generated text becomes the call's arguments
                out.append(api.choice(parsed.kind, c.index, "", tool.finish_reason(
                    fin.finish_reason), tool_calls=[tools.tool_call(tool, c.call_id, text)],
                    logprobs=lp))
        u = self._usage(parsed, choices)
        return api.full_response(parsed.kind, rid, int(time.time()), self.model, out, u,
                                 prompt_logprobs=asked[0] if asked and parsed.kind == "chat"
                                 else None)

    def _usage(
        self, parsed: req.ParsedRequest, choices: list[_Choice], streamed: bool = False
    ) -> dict[str, Any]:
        """Each prompt once, every choice's tokens; the cache figures of the last prompt's
        first choice (vLLM reports one request output's)."""
        ref = choices[-parsed.n].fin
        created = api.created_cache_tokens(
            ref.prompt_tokens, ref.cached_tokens, self.runner.profile.block_size)
        prompt = sum(len(p[0]) for p in parsed.prompts())
        completion = sum(c.fin.completion_tokens for c in choices)
        return api.usage(parsed.kind, prompt, completion, ref.cached_tokens, created, streamed)

    async def _stream(
        self, request: web.Request, parsed: req.ParsedRequest, rid: str, choices: list[_Choice]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        # A client that went away mid-stream ends the handler quietly; release() aborts.
        with contextlib.suppress(ConnectionResetError):
            await self._pump(resp, request, parsed, rid, int(time.time()), choices)
        return resp

    async def _pump(
        self, resp: web.StreamResponse, request: web.Request, parsed: req.ParsedRequest,
        rid: str, created: int, choices: list[_Choice],
    ) -> None:
        """Write the choices' tokens as SSE events until all have finished."""
        kind, tool, model = parsed.kind, parsed.tool, self.model
        # Chunks that differ by more than their text are built one by one.
        slow = parsed.continuous_usage or parsed.logprobs is not None
        continuous = parsed.continuous_usage
        # Every token chunk of a choice is the same JSON except its text: build it once.
        frame_parts: list[tuple[bytes, bytes]] = []
        for c in choices:
            if tool is None:
                template = api.chunk(kind, rid, created, model, "\x00", index=c.index)
            else:  # a forced tool choice: each token appends its text to the call's arguments
                template = tools.tool_chunk(rid, created, model, tool, "\x00", index=c.index)
            head, tail = ("data: " + json.dumps(template, separators=(",", ":"))).split(
                '"\\u0000"')
            frame_parts.append((head.encode(), (tail + "\n\n").encode()))

        def frame(obj: dict[str, Any], c: _Choice, done: int) -> bytes:
            """An event; with continuous_usage_stats it carries the choice's usage so far."""
            if continuous:
                obj = api.with_usage(obj, api.running_usage(kind, len(c.prompt[0]), done))
            return sse(obj)

        def token_chunk(c: _Choice, i: int, reason: str | None) -> dict[str, Any]:
            """Token ``i``'s chunk; ``reason`` on the last one (with the fingerprint when no
            usage chunk follows); a completions echo prefixes the first with the prompt."""
            last, piece = reason is not None, filler_chunk(i)
            echo_ids = c.prompt[2] if i == 0 else None
            lp = None if c.lp is None else c.lp.of(i, 1, shows_prompt=echo_ids is not None)
            if tool is not None:
                obj = tools.tool_chunk(rid, created, model, tool, tool.piece(piece, i == 0, last),
                                       finish_reason=reason, index=c.index, logprobs=lp)
                if last and not parsed.include_usage:
                    obj["system_fingerprint"] = api.SYSTEM_FINGERPRINT
                return obj
            if echo_ids is not None:  # a prompt scoring shows the prompt alone
                piece = (c.prompt[1] or "") + ("" if parsed.echo_only else piece)
            return api.chunk(kind, rid, created, model, piece, reason,
                             fingerprint=last and not parsed.include_usage,
                             prompt_token_ids=echo_ids, index=c.index, logprobs=lp)

        def choice_frames(c: _Choice) -> list[bytes]:
            fin, avail, sent = c.stream.finished, c.stream.available, c.sent
            parts: list[bytes] = []
            if c.closed or avail == sent:
                return parts
            if sent == 0 and tool is not None:  # the call is named first
                parts.append(frame(tools.tool_chunk(rid, created, model, tool, "", c.call_id,
                                                    index=c.index), c, 1))
            head_b, tail_b = frame_parts[c.index]
            last = avail - 1 if fin is not None else avail
            for i in range(sent, last):
                if slow or (i == 0 and c.prompt[2] is not None):
                    parts.append(frame(token_chunk(c, i, None), c, i + 1))
                elif tool is None:
                    parts.append(head_b + json.dumps(filler_chunk(i)).encode() + tail_b)
                else:
                    parts.append(head_b + json.dumps(
                        tool.piece(filler_chunk(i), i == 0, False)).encode() + tail_b)
            if fin is not None:
                reason = fin.finish_reason if tool is None else tool.finish_reason(
                    fin.finish_reason)
                parts.append(frame(token_chunk(c, avail - 1, reason), c, avail))
                c.closed = True
            c.sent = avail
            return parts

        started = False

        def step() -> tuple[list[bytes], bool]:
            nonlocal started
            parts: list[bytes] = []
            if not started and any(c.stream.available for c in choices):
                started = True
                if kind == "chat":  # vLLM's first chunk of each choice: the role
                    parts.extend(frame(api.chunk(kind, rid, created, model, "", role=True,
                                                 index=c.index), c, 0) for c in choices)
            for c in choices if started else ():
                parts.extend(choice_frames(c))
            done = all(c.closed for c in choices)
            if done:
                if parsed.include_usage:
                    u = self._usage(parsed, choices, streamed=True)
                    parts.append(sse(api.usage_chunk(kind, rid, created, model, u)))
                parts.append(b"data: [DONE]\n\n")
            return parts, done

        await pump_steps(resp, request, choices[0].stream, step)


def _logprobs(parsed: req.ParsedRequest, prompt: req.Prompt) -> ChoiceLogprobs | None:
    """A choice's logprobs writer when the request asks for logprobs; an echo scores its
    prompt too (vLLM asks the engine for the prompt's logprobs then)."""
    if parsed.logprobs is None:
        return None
    echoed = () if prompt[2] is None else tuple(prompt_tokens(prompt[2], prompt[1]))
    return ChoiceLogprobs(parsed.kind, parsed.logprobs, echoed, parsed.echo_only)
