"""Booleans as vLLM's request models read them: pydantic models in lax mode take ``"true"``,
``"yes"``, ``1``, ``1.0`` and the like. The proxy reads a request's flags the same way (a
``"stream": "true"`` is streamed by vLLM), and so does the emulator."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

LAX_BOOL = TypeAdapter(bool)


def vllm_true(value: Any) -> bool:
    """Whether vLLM reads ``value`` as true. What it cannot read as a bool is false here: the
    worker answers it 400."""
    if value is True or value is False or value is None:  # the common case: not validated
        return value is True
    try:
        return LAX_BOOL.validate_python(value)
    except ValidationError:
        return False
