"""Reading and validating an OpenAI chat or completions body as vLLM 0.32 does (no I/O).

vLLM checks a request in stages, and the first failing stage answers: the request model's
``before`` validators on the raw body (tool usage, logprobs, ``stream_options``,
``response_format``; completions: the prompt's presence), the typed fields (``request_fields``:
FastAPI's 400 ``Bad Request``), the model name (404), ``max_tokens`` against ``max_model_len``,
the prompt and its length, then the sampling parameters' ranges (``SamplingParams``), and last
what the engine checks when it takes the request (``logprobs`` against ``--max-logprobs``, then
token ids out of the vocabulary): a 400 when not streamed, an error event in a 200 stream
otherwise (:attr:`ParsedRequest.engine_error`). The emulator keeps that order and vLLM's words
(``VLLMValidationError``: 400 ``BadRequestError``, the message with its ``(parameter=...,
value=...)`` suffix).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from marsproxy.emulator.logprobs import (
    MAX_LOGPROBS,
    Token,
    chat_prompt_tokens,
    prompt_tokens,
    too_many,
)
from marsproxy.emulator.openai_api import (
    ApiError,
    Kind,
    bad_request,
    model_not_found,
    validation_error,
)
from marsproxy.emulator.request_fields import ChatFields, CompletionFields, read_fields
from marsproxy.emulator.tokenizer import VOCAB_SIZE, PromptError, encode_chat, encode_text
from marsproxy.emulator.tool_calls import ForcedTool, ToolChoiceError, parse_tool_choice

MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS default
GREEDY_EPS = 1e-5  # a temperature below it samples greedily
EMPTY_CONVERSATION = (
    "Cannot apply chat template to an empty conversation. Provide at least one message."
)


Prompt = tuple[list[int], str | None, list[int] | None]


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    model: str
    prompt_token_ids: list[int]
    max_tokens: int | None
    ignore_eos: bool
    priority: int
    stream: bool
    include_usage: bool
    session_id: str | None = None  # vLLM 0.32's field: carried into the KV events
    tool: ForcedTool | None = None  # the reply is this tool call instead of text
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    echo: str | None = None  # completions' echo of a text prompt: the reply starts with it
    echo_ids: list[int] | None = None  # echo's prompt ids (the first streamed chunk's)
    n: int = 1  # choices per prompt
    # completions with several prompts: the others, each (ids, echo, echo_ids) as above
    more_prompts: tuple[Prompt, ...] = ()
    # per token, this many most likely (chat: top_logprobs with logprobs; completions: logprobs)
    logprobs: int | None = None
    # completions' echo with max_tokens 0 (prompt scoring): the engine runs one token (vLLM's
    # max_tokens 1), the reply shows the prompt alone
    echo_only: bool = False
    # the engine's refusal: a 400 before the response, or an error event in a stream
    engine_error: ApiError | None = None
    # the request's prompt_logprobs (not streamed): this many most likely per prompt token,
    # and each prompt's tokens (in prompts()' order) to score
    prompt_logprobs: int | None = None
    scored: tuple[tuple[Token, ...], ...] = ()

    def prompts(self) -> list[Prompt]:
        """Every prompt (ids, echoed text, echoed ids); each gets ``n`` choices."""
        return [(self.prompt_token_ids, self.echo, self.echo_ids), *self.more_prompts]


def check_prompt_length(n: int, max_model_len: int, text: bool) -> None:
    """vLLM's answer to a prompt that leaves no room for output. A text prompt (chat, a string)
    is tokenized with truncation at ``max_model_len + 1``, so its count reads "at least"."""
    if n > max_model_len:
        shown = max_model_len + 1 if text else n
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your"
            f" prompt contains {'at least ' if text else ''}{shown} input tokens, which exceeds"
            " this limit even without any output tokens. Please reduce the length of the input"
            " prompt.", "input_tokens", shown)
    if n == max_model_len:
        raise validation_error("max_tokens must be at least 1, got 0.", "max_tokens", 0)


def _raw_checks(kind: Kind, body: Mapping[str, Any]) -> ForcedTool | None:
    """The request model's ``before`` validators, on the body as sent, in the order pydantic
    runs them (the last defined first); the chat's forced tool call."""
    tool = None
    if kind == "chat":
        try:
            tool = parse_tool_choice(body)
        except ToolChoiceError as exc:
            raise validation_error(exc.message, exc.parameter) from exc
        _check_logprobs(body, "top_logprobs")
    else:
        prompt = body.get("prompt")
        if (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
                and len(prompt) > MAX_PROMPTS):
            raise validation_error(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of"
                f" {MAX_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS"
                " environment variable.", "prompt")
        embeds = body.get("prompt_embeds")
        if prompt in (None, "") and embeds in (None, []):
            raise validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if body.get("stream_options") and not body.get("stream"):
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", "stream_options")
    if kind == "completion":
        _check_logprobs(body, "logprobs")
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema" \
            and fmt.get("json_schema") is None:
        raise validation_error(
            "When response_format type is 'json_schema', the 'json_schema' field must be"
            " provided.", "response_format")
    return tool


def _check_logprobs(body: Mapping[str, Any], top: str) -> None:
    """``check_logprobs``: ``top`` is chat's ``top_logprobs`` or completions' ``logprobs``."""
    for name in ("prompt_logprobs", top):
        val = body.get(name)
        if val is not None and not isinstance(val, (int, float)):
            raise validation_error(f"`{name}` must be an integer.", name, val)
    prompt_lp = body.get("prompt_logprobs")
    if prompt_lp is not None:
        if body.get("stream") and (prompt_lp > 0 or prompt_lp == -1):
            raise validation_error(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_lp < 0 and prompt_lp != -1:
            raise validation_error(
                "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs",
                prompt_lp)
    val = body.get(top)
    if val is not None and val < 0 and val != -1:
        raise validation_error(f"`{top}` must be a positive value or -1.", top, val)
    if top == "top_logprobs" and val is not None and (val == -1 or val > 0) \
            and not body.get("logprobs"):
        raise validation_error(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")


def parse_request(
    kind: Kind, body: Any, served_model: str, max_model_len: int | None = None
) -> ParsedRequest:
    """Validate a chat or completions body; raises :class:`ApiError` (400/404), in vLLM's
    order (see the module's doc)."""
    tool = _raw_checks(kind, body) if isinstance(body, Mapping) else None
    f = read_fields(ChatFields if kind == "chat" else CompletionFields, body)
    model = f.model or served_model  # vLLM serves a missing or empty name as its own
    if model != served_model:
        raise model_not_found(model, served_model)
    key, max_tokens = "max_tokens", f.max_tokens
    if kind == "chat" and f.max_completion_tokens is not None:
        key, max_tokens = "max_completion_tokens", f.max_completion_tokens
    elif kind == "completion" and max_tokens is None:
        max_tokens = 16  # vLLM's CompletionRequest default, also for "max_tokens": null
    if max_tokens is not None and max_model_len is not None and max_tokens > max_model_len:
        raise validation_error(
            f"{key}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please"
            " request fewer output tokens.", key, max_tokens)
    try:
        if kind == "chat":
            if not f.messages:  # the chat template's refusal (transformers' words)
                raise bad_request(EMPTY_CONVERSATION)
            batch: list[Any] = [None]
            encoded = [encode_chat(f.messages)]
        else:
            batch = _batch(f.prompt)
            encoded = [_completion_prompt(p) for p in batch]
    except PromptError as exc:
        raise bad_request(str(exc)) from exc
    for ids, one in zip(encoded, batch, strict=True):
        text = kind == "chat" or isinstance(one, str)
        if max_model_len is not None and len(ids) != max_model_len:
            # one of exactly max_model_len tokens leaves max_tokens 0: a sampling check, after
            # the others
            check_prompt_length(len(ids), max_model_len, text)
    echo = kind == "completion" and bool(f.echo)
    echo_only = echo and max_tokens == 0
    for ids in encoded:  # vLLM makes each prompt's sampling parameters in turn
        engine_max = max_tokens  # what the engine gets: cut to the room the prompt leaves
        if max_model_len is not None:
            room = max_model_len - len(ids)
            engine_max = room if max_tokens is None else min(max_tokens, room)
        _check_sampling(f, 1 if echo_only else engine_max)
    # chat asks the engine for top_logprobs per token, completions for logprobs
    chat = isinstance(f, ChatFields)
    logprobs = (f.top_logprobs if f.logprobs else None) if chat else f.logprobs
    # only a token-id prompt can hold ids out of the vocabulary: text is encoded into it
    engine_error = _engine_check(logprobs, f.prompt_logprobs,
                                 [ids for ids, one in zip(encoded, batch, strict=True)
                                  if isinstance(one, list)])
    if engine_error is not None and not f.stream:
        raise engine_error
    opts = f.stream_options
    include_usage = bool(opts and opts.include_usage)
    prompts: list[Prompt] = [
        # a token-id prompt cannot be detokenized here: it echoes no text
        (ids, one if echo and isinstance(one, str) else None, ids if echo else None)
        for ids, one in zip(encoded, batch, strict=True)
    ]
    scored: tuple[tuple[Token, ...], ...] = ()
    if f.prompt_logprobs is not None and not f.stream:
        scored = (tuple(chat_prompt_tokens(f.messages)),) if chat else tuple(
            tuple(prompt_tokens(ids, one if isinstance(one, str) else None))
            for ids, one in zip(encoded, batch, strict=True))
    return ParsedRequest(
        kind=kind, model=model, prompt_token_ids=prompts[0][0],
        max_tokens=1 if echo_only else max_tokens,  # prompt scoring: one token, not shown
        ignore_eos=f.ignore_eos, priority=f.priority, stream=bool(f.stream),
        include_usage=include_usage, session_id=f.session_id, tool=tool,
        continuous_usage=include_usage and bool(opts and opts.continuous_usage_stats),
        echo=prompts[0][1], echo_ids=prompts[0][2], n=f.n or 1,
        more_prompts=tuple(prompts[1:]), logprobs=logprobs, echo_only=echo_only,
        engine_error=engine_error, prompt_logprobs=f.prompt_logprobs if scored else None,
        scored=scored,
    )


def _engine_check(
    logprobs: int | None, prompt_logprobs: int | None, prompts: list[list[int]]
) -> ApiError | None:
    """What vLLM's engine refuses as it takes the request, in its order: ``logprobs``, then
    ``prompt_logprobs`` (``-1``: the whole vocabulary) over ``--max-logprobs``, then a prompt's
    ids out of the vocabulary (its largest id)."""
    for name, what, asked in (("logprobs", "sample", logprobs),
                              ("prompt_logprobs", "prompt", prompt_logprobs)):
        wanted = VOCAB_SIZE if asked == -1 else asked
        if wanted is not None and wanted > MAX_LOGPROBS:
            return validation_error(too_many(wanted, what), name, wanted)
    for ids in prompts:
        if ids and max(ids) >= VOCAB_SIZE:  # vLLM's renderer names the largest id
            return bad_request(f"Token id {max(ids)} is out of vocabulary")
    return None


def _check_sampling(f: ChatFields | CompletionFields, max_tokens: int | None) -> None:
    """``SamplingParams``' range checks, in its order."""
    n = 1 if f.n is None else f.n
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise bad_request(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the"
            " VLLM_MAX_N_SEQUENCES environment variable.")
    for name in ("presence_penalty", "frequency_penalty"):
        val = getattr(f, name)
        if val is not None and not -2.0 <= val <= 2.0:
            raise bad_request(f"{name} must be in [-2, 2], got {val}.")
    rep = f.repetition_penalty
    if rep is not None and not math.isfinite(rep):
        raise bad_request(f"repetition_penalty must be a finite number, got {rep}.")
    if rep is not None and rep <= 0.0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {rep}.")
    temp = 1.0 if f.temperature is None else f.temperature
    for bad, words in ((not math.isfinite(temp), "must be a finite number"),
                       (temp < 0.0, "must be non-negative"), (temp > 2.0, "must be in [0, 2]")):
        if bad:
            raise validation_error(f"temperature {words}, got {temp}.", "temperature", temp)
    top_p = 1.0 if f.top_p is None else f.top_p
    if not 0.0 < top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if f.top_k is not None and f.top_k < -1:
        raise bad_request(f"top_k must be 0 (disable), or at least 1, got {f.top_k}.")
    if f.min_p is not None and not 0.0 <= f.min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {f.min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if f.min_tokens < 0:
        raise bad_request(
            f"min_tokens must be greater than or equal to 0, got {f.min_tokens}.")
    if max_tokens is not None and f.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got"
            f" {f.min_tokens}.")
    stop = [f.stop] if isinstance(f.stop, str) else f.stop or []
    if any(not s for s in stop):
        raise bad_request("stop cannot contain an empty string.")
    if temp < GREEDY_EPS and n > 1:
        raise bad_request(f"n must be 1 when using greedy sampling, got {n}.")


def _batch(prompt: Any) -> list[Any]:
    """A completions prompt as the list of prompts it holds: a string or a token-id list is
    one, a list of strings or of token-id lists is several."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def _completion_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return encode_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt)  # ids out of the vocabulary are the engine's to refuse
    raise PromptError("'prompt' must be a string or a list of token ids")


def tokenize_body(body: Any) -> list[int]:
    """Token ids for vLLM's ``/tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    try:
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise bad_request("'messages' must be a list", "messages")
            return encode_chat(messages)
        batch = _batch(body.get("prompt"))
        if len(batch) != 1:
            raise PromptError("'prompt' must be one prompt")
        ids = _completion_prompt(batch[0])
        refused = _engine_check(None, None, [ids])
        if refused is not None:
            raise refused
        return ids
    except PromptError as exc:
        raise bad_request(str(exc)) from exc


__all__ = ["ApiError", "ParsedRequest", "check_prompt_length", "parse_request", "tokenize_body"]
