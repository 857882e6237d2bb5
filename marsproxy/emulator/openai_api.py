"""OpenAI/vLLM request parsing and response shapes for the emulated worker (no I/O).

Only the fields the emulator acts on are read; unknown fields are ignored like vLLM ignores
most sampling options it does not need. Response bodies mirror vLLM 0.32's JSON.

A chat body's ``tools`` and ``tool_choice`` are read by :mod:`tool_calls`: a forced choice makes
the reply one tool call instead of text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from marsproxy.core.lax_bool import LAX_BOOL
from marsproxy.emulator.tokenizer import (
    PromptError,
    encode_chat,
    encode_text,
    validate_token_ids,
)
from marsproxy.emulator.tool_calls import ForcedTool, ToolChoiceError, parse_tool_choice

Kind = Literal["chat", "completion"]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (chat has none)


class ApiError(Exception):
    """An error answered with vLLM's error body."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(
        404, f"The model `{name}` does not exist. Valid aliases: {served}.", "NotFoundError",
        "model",
    )


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


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    val = body.get(key)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, int):
        raise bad_request(f"'{key}' must be an integer", key)
    return val


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    val = body.get(key, default)
    if val is None:
        return default
    try:
        return LAX_BOOL.validate_python(val)
    except ValidationError:
        raise bad_request(f"'{key}' must be a boolean", key) from None


def validation_error(message: str, parameter: str, value: Any = None) -> ApiError:
    """A ``VLLMValidationError`` as vLLM 0.32 answers it: 400 ``BadRequestError``, the message
    with its ``(parameter=..., value=...)`` suffix, ``param`` the parameter. Raised by a request
    model's validator too: it is no ``ValueError``, so pydantic lets it through unwrapped."""
    extras = f"parameter={parameter}" + ("" if value is None else f", value={value}")
    return bad_request(f"{message} ({extras})", parameter)


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


def parse_request(
    kind: Kind, body: Any, served_model: str, max_model_len: int | None = None
) -> ParsedRequest:
    """Validate a chat or completions body; raises :class:`ApiError` (400/404). In vLLM's order:
    the request model's validators, the model, ``max_tokens`` against ``max_model_len``, the
    prompt, its length, ``max_tokens`` ≥ 1."""
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    try:
        tool = parse_tool_choice(body) if kind == "chat" else None
    except ToolChoiceError as exc:
        raise validation_error(exc.message, exc.parameter) from exc
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise bad_request("'stream_options' must be an object", "stream_options")
    stream = _bool(body, "stream")
    if opts and not stream:
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", "stream_options")
    model = body.get("model", served_model)
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != served_model:
        raise model_not_found(model, served_model)
    key = "max_tokens"
    if kind == "chat":
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
        else:
            key = "max_completion_tokens"
    else:  # vLLM's CompletionRequest defaults max_tokens (absent or null) to 16
        max_tokens = _opt_int(body, "max_tokens")
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_model_len is not None and max_tokens > max_model_len:
        raise validation_error(
            f"{key}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please"
            " request fewer output tokens.", key, max_tokens)
    prompt: Any = body.get("prompt")
    try:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise bad_request("'messages' must be a list", "messages")
            ids = encode_chat(messages)
        else:
            ids = _completion_prompt(prompt)
    except PromptError as exc:
        raise bad_request(str(exc)) from exc
    text = kind == "chat" or isinstance(prompt, str) or (
        isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))
    if max_model_len is not None:
        check_prompt_length(len(ids), max_model_len, text)
    if max_tokens is not None and max_tokens < 1:
        raise validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad_request("the emulator supports only n=1", "n")
    include_usage = _bool(opts or {}, "include_usage")
    continuous = include_usage and _bool(opts or {}, "continuous_usage_stats")
    echo = kind == "completion" and _bool(body, "echo")
    echo_text = None  # a token-id prompt cannot be detokenized here: it echoes no text
    if echo and text:
        echo_text = prompt if isinstance(prompt, str) else str(prompt[0])
    priority = _opt_int(body, "priority") or 0
    session_id = body.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise bad_request("'session_id' must be a string", "session_id")
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        ignore_eos=_bool(body, "ignore_eos"),
        priority=priority,
        stream=stream,
        include_usage=include_usage,
        session_id=session_id,
        tool=tool,
        continuous_usage=continuous,
        echo=echo_text,
        echo_ids=ids if echo else None,
    )


def _completion_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return encode_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return validate_token_ids(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _completion_prompt(prompt[0])
    if isinstance(prompt, list) and prompt:
        raise PromptError("batched prompts (a list of several prompts) are not supported")
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
        return _completion_prompt(body.get("prompt"))
    except PromptError as exc:
        raise bad_request(str(exc)) from exc


SYSTEM_FINGERPRINT = "vllm-0.32.0-emulated"


def created_cache_tokens(prompt: int, cached: int, block_size: int) -> int:
    """The prompt's full blocks this request computed and cached (vLLM's
    ``num_cache_creation_tokens``: 211 prompt tokens, blocks of 32 → 192 cold, 0 warm)."""
    return max(0, prompt // block_size * block_size - cached)


def usage(
    kind: Kind, prompt: int, completion: int, cached: int, created: int, streamed: bool = False
) -> dict[str, Any]:
    """``usage`` as vLLM 0.32 with ``--enable-prompt-tokens-details`` reports it. The emulator
    always reports the details (real vLLM needs the flag) because the proxy reads
    ``cached_tokens``. Chat reports ``created_cache_tokens``, completions only ``null`` (not
    streamed) or nothing (streamed); a streamed usage leaves the null keys out."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if kind == "chat":
        details["created_cache_tokens"] = created
    elif not streamed:
        details["created_cache_tokens"] = None
    if not streamed:
        details["multimodal_tokens"] = None
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }


def running_usage(kind: Kind, prompt: int, completion: int) -> dict[str, Any]:
    """The cumulative usage on every chunk with ``continuous_usage_stats``."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt, "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if kind == "chat":
        u["completion_tokens_details"] = None
    return u


def with_usage(chunk: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    """``chunk`` with ``usage`` right after ``choices``, where vLLM puts it."""
    out: dict[str, Any] = {}
    for key, val in chunk.items():
        out[key] = val
        if key == "choices":
            out["usage"] = u
    return out


def chunk(
    kind: Kind, rid: str, created: int, model: str, text: str | None,
    finish_reason: str | None = None, role: bool = False, fingerprint: bool = False,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One streamed chunk, keyed like vLLM 0.32's (tests/fixtures/vllm-0.32-*-stream.txt).
    ``fingerprint``: the last chunk of a stream without a usage chunk carries
    ``system_fingerprint``; ``prompt_token_ids``: the first chunk of a completions echo."""
    choice: dict[str, Any]
    if kind == "chat":
        obj = "chat.completion.chunk"
        if role:  # vLLM's first chunk: the role and an empty content
            choice = {
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None,
            }
            return {
                "id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice], "prompt_token_ids": None, "prompt_text": None,
            }
        choice = {
            "index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
    else:
        obj = "text_completion"
        choice = {
            "index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": None, "prompt_token_ids": prompt_token_ids, "token_ids": None,
        }
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if fingerprint:
        out["system_fingerprint"] = SYSTEM_FINGERPRINT
    return out


def usage_chunk(
    kind: Kind, rid: str, created: int, model: str, u: dict[str, Any]
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def full_response(
    kind: Kind, rid: str, created: int, model: str, text: str, finish_reason: str,
    u: dict[str, Any], tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A non-streamed response, keyed like vLLM 0.32's (tests/fixtures/vllm-0.32-*.json).
    With ``tool_calls`` (a forced tool choice) the message has ``content: ""`` and the calls
    (vLLM's ``ChatMessage`` leaves ``tool_calls`` out when there are none)."""
    u = {**u, "completion_tokens_details": None}
    if kind == "chat":
        message: dict[str, Any] = {
            "role": "assistant", "content": text, "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "reasoning": None,
        }
        if tool_calls:
            message = {
                "role": "assistant", "content": "", "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": tool_calls,
                "reasoning": None,
            }
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
            "token_ids": None, "routed_experts": None,
        }
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": u, "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
    choice = {
        "index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
        "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
        "prompt_token_ids": None, "routed_experts": None,
    }
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [choice], "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": u, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }
