"""Profiles: the H200 profile reproduces the sanity table of the profile note (§6)."""

from __future__ import annotations

import pytest

from marsproxy.emulator.engine import Engine
from marsproxy.emulator.profiles import get_profile, profile_names


def _ttft(prompt_len: int) -> float:
    eng = Engine(get_profile("h200-qwen3-coder-30b-a3b"))
    eng.add_request("r", list(range(prompt_len)), max_tokens=1, ignore_eos=True)
    now = 0.0
    while eng.has_work():
        now += eng.step(now).duration
    return now


@pytest.mark.parametrize(
    ("prompt_len", "ttft"), [(1024, 0.03), (8192, 0.17), (16384, 0.44), (32768, 1.2), (65536, 3.8)]
)
def test_h200_single_request_ttft_matches_note(prompt_len: int, ttft: float) -> None:
    assert _ttft(prompt_len) == pytest.approx(ttft, rel=0.06)


def test_h200_decode_step_matches_note() -> None:
    eng = Engine(get_profile("h200-qwen3-coder-30b-a3b"))
    for i in range(8):
        eng.add_request(str(i), [i * 100_000 + j for j in range(2047)], 5, ignore_eos=True)
    now, last = 0.0, 0.0
    while eng.has_work():
        res = eng.step(now)
        now += res.duration
        if res.batch.decode_seqs == 8 and res.batch.prefill_tokens == 0:
            last = res.duration
    assert last == pytest.approx(10.6e-3, rel=0.02)  # batch 8 at ~2k context


def test_profiles_and_overrides() -> None:
    assert set(profile_names()) == {"tiny", "h200-qwen3-coder-30b-a3b", "zero"}
    h200 = get_profile("h200-qwen3-coder-30b-a3b")
    assert (h200.num_blocks, h200.block_size, h200.max_num_seqs) == (43_000, 16, 1024)
    assert h200.max_num_batched_tokens == 8192 and h200.max_model_len == 262_144
    assert h200.model_name == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    tiny = get_profile("tiny", num_blocks=64, served_model_name="m", max_num_seqs=4)
    assert (tiny.num_blocks, tiny.model_name, tiny.max_num_seqs) == (64, "m", 4)
    assert tiny.effective_max_model_len == 64 * 16
    # --max-model-len as vLLM's: the longest context, still within the cache
    assert get_profile("tiny", max_model_len=4096).effective_max_model_len == 4096
    assert get_profile("tiny", num_blocks=64, max_model_len=4096).effective_max_model_len == 1024
    zero = get_profile("zero")
    eng = Engine(zero)
    eng.add_request("r", list(range(100)), max_tokens=3, ignore_eos=True)
    assert eng.step(0.0).duration == 0.0
    with pytest.raises(ValueError):
        get_profile("nope")
    with pytest.raises(ValueError):
        get_profile("tiny", num_blocks=0)
    with pytest.raises(ValueError, match="max_model_len"):
        get_profile("tiny", max_model_len=0)
