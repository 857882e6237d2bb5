"""The emulator's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (vLLM 0.32's
Anthropic Messages surface) over the emulated engine."""

from __future__ import annotations

import uuid

from aiohttp import web

from marsproxy.emulator import anthropic_api as anth
from marsproxy.emulator.http_util import Frames, error_response, json_response, read_json, serve_one
from marsproxy.emulator.openai_api import ApiError
from marsproxy.emulator.openai_request import ParsedRequest, check_prompt_length
from marsproxy.emulator.request import FinishedEvent, RequestError
from marsproxy.emulator.runner import EngineRunner
from marsproxy.emulator.tokenizer import filler_chunk, filler_text
from marsproxy.emulator.tool_calls import tool_call_id


class MessagesHandlers:
    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.model = runner.profile.model_name
        self.block = runner.profile.block_size

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            req = anth.parse_messages(await read_json(request), self.model, count_only=True)
        except ApiError as exc:
            return error_response(exc)
        return json_response(anth.count_tokens_response(len(req.parsed.prompt_token_ids)))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            parsed = anth.parse_messages(await read_json(request), self.model).parsed
        except ApiError as exc:
            return error_response(exc)
        try:  # vLLM's message for a prompt over the context, in the Anthropic shape
            check_prompt_length(len(parsed.prompt_token_ids),
                                self.runner.profile.effective_max_model_len, text=True)
        except ApiError as exc:
            return error_response(anth.AnthropicError(400, exc.message, "BadRequestError"))
        # vLLM answers with the id of the chat request it made of the Messages request.
        rid = "chatcmpl-" + uuid.uuid4().hex[:16]
        try:
            stream = self.runner.submit(rid, parsed.prompt_token_ids, parsed.max_tokens, False, 0)
        except RequestError as exc:
            return error_response(anth.AnthropicError(400, str(exc), "BadRequestError"))
        tool = parsed.tool

        def body(fin: FinishedEvent) -> dict[str, object]:
            reason = fin.finish_reason
            return anth.full_response(
                rid, self.model, filler_text(0, fin.completion_tokens),
                reason if tool is None else tool.finish_reason(reason),
                anth.usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens,
                           self.block),
                tool, tool_call_id() if tool is not None else "")

        return await serve_one(request, self.runner, rid, stream, streamed=parsed.stream,
                               frames=self._frames(rid, parsed), body=body)

    def _frames(self, rid: str, parsed: ParsedRequest) -> Frames:
        """vLLM's event sequence: ``message_start`` (with the prompt's size), one block (start, a
        delta per token, stop), ``message_delta`` with the stop reason and usage,
        ``message_stop``. The block is text, or with a forced tool choice a ``tool_use`` block
        whose ``input_json_delta``s join to the call's arguments."""
        tool, prompt = parsed.tool, len(parsed.prompt_token_ids)
        call_id = tool_call_id() if tool is not None else ""

        def frames(sent: int, avail: int, fin: FinishedEvent | None) -> tuple[list[bytes], int]:
            parts: list[bytes] = []
            if sent == 0 and avail > 0:
                parts.append(anth.message_start(rid, self.model, prompt))
                parts.append(anth.block_start(0) if tool is None
                             else anth.tool_block_start(0, call_id, tool.name))
            if tool is None:
                parts.extend(anth.text_delta(0, filler_chunk(i)) for i in range(sent, avail))
            else:
                last = avail - 1 if fin is not None else -1
                parts.extend(anth.json_delta(0, tool.piece(filler_chunk(i), i == 0, i == last))
                             for i in range(sent, avail))
            if fin is not None:
                reason = fin.finish_reason if tool is None else tool.finish_reason(
                    fin.finish_reason)
                parts.append(anth.finish_events(reason, anth.usage(
                    fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens, self.block)))
            return parts, avail

        return frames
