"""The fields of a chat or completions body as vLLM 0.32's request models type them (no I/O).

vLLM's server is FastAPI over pydantic models in lax mode: ``"max_tokens": "5"`` or ``5.0`` is
5, ``"temperature": "hot"`` or five stop strings are a 400, unknown fields are ignored. The
models below declare the fields the emulator reads or clients commonly send, with vLLM's types,
so that the emulator reads and refuses them alike. A refusal is FastAPI's as vLLM answers it:
400, ``type: "Bad Request"``, ``param`` the first error's dotted location (``body.<field>``),
the message every error (at most ten) in pydantic's words, containers summarized.

What the models leave to the emulator's own checks (and vLLM checks elsewhere): the messages'
items, ``tools`` and ``tool_choice``, value ranges (sampling parameters).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from marsproxy.emulator.openai_api import ApiError

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
_Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None
_TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM ignores fields it does not know


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Fields in vLLM's order (pydantic reports errors in it), each with vLLM's type.
class ChatFields(_Body):
    messages: list[Any]  # the items are checked where the prompt is rendered
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)] = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    seed: _Int64 | None = None
    stop: _Stop = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = True
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    echo: bool = False
    priority: _Int64 = 0
    session_id: str | None = None


class CompletionFields(_Body):
    model: str | None = None
    prompt: list[_TokenId] | list[list[_TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = None
    seed: _Int64 | None = None
    stop: _Stop = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    priority: _Int64 = 0
    session_id: str | None = None


def read_fields(model: type[_Body], body: Any) -> Any:
    """``body`` validated as ``model`` (an instance of it); raises vLLM's 400 ``Bad Request``."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise fastapi_error(exc.errors(include_url=False)) from None


# FastAPI's answer to a body that fails validation, as vLLM 0.32's handler words it.
_MAX_REPORTED, _MAX_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000
_BRACKETED = re.compile(r"[\[\]{}()]")
# pydantic's schema-kind names that show up in ``loc`` for union and wrapped fields
_INTERNAL_LOC = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
    "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
    "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
    "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
    "nonetype",
})


def clean_loc(loc: tuple[Any, ...]) -> str:
    """A location as a dotted ``param``, without pydantic's union-branch markers."""
    parts = [str(p) for p in loc
             if not _BRACKETED.search(str(p)) and str(p).lower() not in _INTERNAL_LOC]
    return ".".join(parts or [str(p) for p in loc])


def _summary(value: Any) -> str:
    """The ``input`` of an error: containers described, long text cut."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def fastapi_error(errors: list[Any], prefix: tuple[Any, ...] = ("body",)) -> ApiError:
    """400 ``Bad Request`` for pydantic ``errors`` of the body (plain strings allowed)."""
    shown: list[str] = []
    param: str | None = None
    for i, err in enumerate(errors):
        if isinstance(err, Mapping):
            err = {**err, "loc": clean_loc(prefix + tuple(err.get("loc", ())))}
            if "input" in err:
                err["input"] = _summary(err["input"])
            if i == 0:
                param = err["loc"]
        if i < _MAX_REPORTED:
            text = str(err)
            shown.append(text[:_MAX_ERROR_CHARS] + "...[truncated]"
                         if len(text) > _MAX_ERROR_CHARS else text)
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {s}\n" for s in shown)
    if len(errors) > _MAX_REPORTED:
        message += f"  ...and {len(errors) - _MAX_REPORTED} more {label}\n"
    return ApiError(400, message.rstrip(), "Bad Request", param)
