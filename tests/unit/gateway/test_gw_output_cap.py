"""The output cap a request names, read as vLLM reads it on each route."""

from __future__ import annotations

from typing import Any

import pytest

from marsproxy.gateway.shells.scheduler import output_cap


@pytest.mark.parametrize(
    ("body", "cap"),
    [
        ({"max_tokens": 64}, 64),  # completions, messages, older chat clients
        ({"max_completion_tokens": 32}, 32),  # chat, as the OpenAI SDK sends it now
        ({"max_tokens": 4096, "max_completion_tokens": 32}, 32),  # vLLM's chat takes this one
        ({"max_tokens": None, "max_completion_tokens": 32}, 32),
        ({"max_output_tokens": 128}, 128),  # /v1/responses
        ({}, 0),  # none: the scheduler's own estimate stands
        ({"max_tokens": "64"}, 0),  # not a number here: the estimate stands
        ({"max_tokens": True}, 0),
        ({"max_tokens": -5}, 0),
    ],
)
def test_the_cap_a_request_names(body: dict[str, Any], cap: int) -> None:
    assert output_cap(body) == cap
