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
    if not isinstance(val, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return val


def body_validation_error(message: str, parameter: str, body: Mapping[str, Any]) -> ApiError:
    """A ``VLLMValidationError`` raised by a request model's validator, as vLLM answers it: the
    pydantic error of the body (``value_error``, its message with vLLM's ``(parameter=...)``
    suffix) under ``type: "Bad Request"``, ``param`` the error's parameter."""
    text = f"{message} (parameter={parameter})"
    err = {"type": "value_error", "loc": "body", "msg": f"Value error, {text}",
           "input": f"<dict of {len(body)} items>", "ctx": {"error": text}}
    return ApiError(400, f"1 validation error:\n  {err}", "Bad Request", parameter)


def parse_request(kind: Kind, body: Any, served_model: str) -> ParsedRequest:
    """Validate a chat or completions body; raises :class:`ApiError` (400/404)."""
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    # The request model's validators run while the body is parsed, before the model is looked up.
    try:
        tool = parse_tool_choice(body) if kind == "chat" else None
    except ToolChoiceError as exc:
        raise body_validation_error(exc.message, exc.parameter, body) from exc
    model = body.get("model", served_model)
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != served_model:
        raise model_not_found(model, served_model)
    try:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise bad_request("'messages' must be a list", "messages")
            ids = encode_chat(messages)
            max_tokens = _opt_int(body, "max_completion_tokens")
            if max_tokens is None:
                max_tokens = _opt_int(body, "max_tokens")
        else:
            ids = _completion_prompt(body.get("prompt"))
            max_tokens = _opt_int(body, "max_tokens")
            if "max_tokens" not in body:
                max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    except PromptError as exc:
        raise bad_request(str(exc)) from exc
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad_request("the emulator supports only n=1", "n")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if isinstance(opts, Mapping):
        include_usage = bool(opts.get("include_usage", False))
    elif opts is not None:
        raise bad_request("'stream_options' must be an object", "stream_options")
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


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    # Real vLLM fills prompt_tokens_details only with --enable-prompt-tokens-details; the emulator
    # always reports it because the proxy reads cached_tokens from it.
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chunk(
    kind: Kind, rid: str, created: int, model: str, text: str | None,
    finish_reason: str | None = None, role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk, keyed like vLLM 0.32's (tests/fixtures/vllm-0.32-*-stream.txt)."""
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
            "stop_reason": None, "prompt_token_ids": None, "token_ids": None,
        }
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


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
