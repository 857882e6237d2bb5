"""OpenAI/vLLM response shapes and error bodies for the emulated worker (no I/O).

Response bodies mirror vLLM 0.32's JSON; requests are read by :mod:`openai_request`.
"""

from __future__ import annotations

from typing import Any, Literal

Kind = Literal["chat", "completion"]


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


def validation_error(message: str, parameter: str, value: Any = None) -> ApiError:
    """A ``VLLMValidationError`` as vLLM 0.32 answers it: 400 ``BadRequestError``, the message
    with its ``(parameter=..., value=...)`` suffix, ``param`` the parameter. Raised by a request
    model's validator too: it is no ``ValueError``, so pydantic lets it through unwrapped."""
    extras = f"parameter={parameter}" + ("" if value is None else f", value={value}")
    return bad_request(f"{message} ({extras})", parameter)


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
    prompt_token_ids: list[int] | None = None, index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk, keyed like vLLM 0.32's (tests/fixtures/vllm-0.32-*-stream.txt).
    ``fingerprint``: the last chunk of a stream without a usage chunk carries
    ``system_fingerprint``; ``prompt_token_ids``: the first chunk of a completions echo;
    ``logprobs``: the chunk's tokens' (the role chunk has none)."""
    choice: dict[str, Any]
    if kind == "chat":
        obj = "chat.completion.chunk"
        if role:  # vLLM's first chunk: the role and an empty content
            choice = {
                "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None,
            }
            return {
                "id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice], "prompt_token_ids": None, "prompt_text": None,
            }
        choice = {
            "index": index, "delta": {} if text is None else {"content": text},
            "logprobs": logprobs, "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
    else:
        obj = "text_completion"
        choice = {
            "index": index, "text": text or "", "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": None,
            "prompt_token_ids": prompt_token_ids, "token_ids": None,
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


def choice(
    kind: Kind, index: int, text: str, finish_reason: str,
    tool_calls: list[dict[str, Any]] | None = None, logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streamed response, keyed like vLLM 0.32's. With ``tool_calls`` (a
    forced tool choice) the message has ``content: ""`` and the calls (vLLM's ``ChatMessage``
    leaves ``tool_calls`` out when there are none). ``prompt_logprobs``: completions' echo
    with ``logprobs``."""
    if kind == "completion":
        return {
            "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": None, "token_ids": None, "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": None, "routed_experts": None,
        }
    message: dict[str, Any] = {
        "role": "assistant", "content": "" if tool_calls else text, "refusal": None,
        "annotations": None, "audio": None, "function_call": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["reasoning"] = None
    return {
        "index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
        "stop_reason": None, "token_ids": None, "routed_experts": None,
    }


def full_response(
    kind: Kind, rid: str, created: int, model: str, choices: list[dict[str, Any]],
    u: dict[str, Any], prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """A non-streamed response, keyed like vLLM 0.32's (tests/fixtures/vllm-0.32-*.json);
    ``prompt_logprobs``: chat's, for the request's ``prompt_logprobs``."""
    u = {**u, "completion_tokens_details": None}
    if kind == "chat":
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": u, "prompt_logprobs": prompt_logprobs, "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": u, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }
