"""Flags read as vLLM's pydantic request models read them (lax mode)."""

from __future__ import annotations

import pytest

from marsproxy.core.lax_bool import vllm_true


@pytest.mark.parametrize("value", [True, 1, 1.0, "true", "TRUE", "yes", "on", "t", "y", "1"])
def test_what_vllm_reads_as_true(value: object) -> None:
    assert vllm_true(value)


@pytest.mark.parametrize("value", [False, None, 0, "false", "no", "off", "maybe", 2, [], {}])
def test_false_or_left_for_the_workers_400(value: object) -> None:
    assert not vllm_true(value)
