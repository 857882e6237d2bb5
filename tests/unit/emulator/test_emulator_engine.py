"""The pure engine in virtual time: prefix hits, batching, preemption, priorities, step time."""

from __future__ import annotations

import dataclasses

import pytest

from marsproxy.emulator.engine import Engine, Policy, RequestError, StepResult
from marsproxy.emulator.profiles import EngineProfile, get_profile
from marsproxy.emulator.request import FinishedEvent
from marsproxy.emulator.step_time import StepTimeCoeffs
from marsproxy.emulator.tokenizer import encode_chat, filler_text

COEFFS = StepTimeCoeffs(a=1e-3, w=2e-3, b=1e-5, c=1e-4, d_dec=1e-7, d_pf=1e-9)


def _profile(**over: object) -> EngineProfile:
    base = dataclasses.replace(get_profile("tiny"), step=COEFFS)
    return dataclasses.replace(base, **over)  # type: ignore[arg-type]


def _drain(eng: Engine, now: float = 0.0, limit: int = 100_000) -> tuple[float, list[StepResult]]:
    steps: list[StepResult] = []
    for _ in range(limit):
        if not eng.has_work():
            return now, steps
        res = eng.step(now)
        steps.append(res)
        now += res.duration
    raise AssertionError("engine did not finish")


def _finished(steps: list[StepResult]) -> dict[str, FinishedEvent]:
    return {f.req_id: f for s in steps for f in s.finished}


def _first_token_order(steps: list[StepResult]) -> list[str]:
    return [rid for s in steps for rid in s.first_token]


def test_second_turn_hits_block_aligned_prefix() -> None:
    eng = Engine(_profile())
    turn1 = [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "fix the bug"}]
    ids1 = encode_chat(turn1)
    eng.add_request("t1", ids1, max_tokens=40, ignore_eos=True)
    now, steps = _drain(eng)
    fin1 = _finished(steps)["t1"]
    assert fin1.cached_tokens == 0 and fin1.completion_tokens == 40

    turn2 = [
        *turn1,
        {"role": "assistant", "content": filler_text(0, 40)},
        {"role": "user", "content": "now run the tests"},
    ]
    ids2 = encode_chat(turn2)
    eng.add_request("t2", ids2, max_tokens=5, ignore_eos=True, now=now)
    _, steps2 = _drain(eng, now)
    fin2 = _finished(steps2)["t2"]
    # KV exists for prompt + reply minus the last sampled token; full blocks of it are cached.
    computed = len(ids1) + 40 - 1
    assert fin2.cached_tokens == (computed // 16) * 16
    assert fin2.cached_tokens > len(ids1)  # the reply's blocks were cached too
    stats = eng.stats()
    assert stats.prefix_cache_queries == len(ids1) + len(ids2)
    assert stats.prefix_cache_hits == fin2.cached_tokens


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    eng = Engine(_profile(max_num_batched_tokens=64))
    eng.add_request("short", list(range(10)), max_tokens=20, ignore_eos=True)
    eng.add_request("long", list(range(1000, 1200)), max_tokens=3, ignore_eos=True)
    _, steps = _drain(eng)
    # Step 1: all of "short" (10) and a 54-token chunk of "long".
    assert steps[0].batch.prefill_tokens == 64
    for s in steps:
        assert s.batch.num_tokens <= 64
    # Step 2: "short" decodes (1 token) and "long" continues with 63 tokens.
    assert steps[1].batch.decode_seqs == 1 and steps[1].batch.prefill_tokens == 63
    fins = _finished(steps)
    assert fins["short"].completion_tokens == 20 and fins["long"].completion_tokens == 3


def test_step_time_hand_computed() -> None:
    eng = Engine(_profile())
    eng.add_request("r", list(range(32)), max_tokens=2, ignore_eos=True)
    s1 = eng.step(0.0)
    expected1 = 1e-3 + 2e-3 * (1 - (15 / 16) ** 32) + 32 * 1e-5 + (32 * 33 // 2) * 1e-9
    assert s1.duration == pytest.approx(expected1)
    s2 = eng.step(s1.duration)
    expected2 = 1e-3 + 2e-3 * (1 / 16) + 1e-4 + 33 * 1e-7
    assert s2.duration == pytest.approx(expected2)
    assert [f.req_id for f in s2.finished] == ["r"]
    fin = s2.finished[0]
    assert fin.ttft == pytest.approx(expected1)
    assert fin.e2e_latency == pytest.approx(expected1 + expected2)
    assert fin.token_gaps == pytest.approx((expected2,))


def test_prefill_after_cached_prefix_counts_attention_to_it() -> None:
    eng = Engine(_profile())
    eng.add_request("a", list(range(40)), max_tokens=1, ignore_eos=True)
    _drain(eng)
    eng.add_request("b", [*range(40), 7, 7, 7, 7], max_tokens=1, ignore_eos=True)
    s = eng.step(1.0)
    # 32 tokens (two blocks) hit; 12 are computed after o = 32 tokens of context.
    assert s.batch.prefill_tokens == 12
    assert s.batch.prefill_pairs == 12 * 32 + 12 * 13 // 2


def _kv_tight_engine(policy: Policy) -> Engine:
    # 8 blocks of 16 = 128 tokens; each request needs up to 40 + 60 = 100 tokens (7 blocks).
    return Engine(_profile(num_blocks=8), policy)


def test_preemption_when_blocks_run_out_fcfs() -> None:
    eng = _kv_tight_engine("fcfs")
    eng.add_request("a", list(range(40)), max_tokens=60, ignore_eos=True, now=0.0)
    eng.add_request("b", list(range(500, 540)), max_tokens=60, ignore_eos=True, now=0.0)
    _, steps = _drain(eng)
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted and set(preempted) == {"b"}  # the most recently started one
    assert eng.stats().num_preemptions == len(preempted)
    assert sum(s.preemptions_reported for s in steps) == len(preempted)
    fins = _finished(steps)
    assert fins["a"].completion_tokens == 60 and fins["b"].completion_tokens == 60
    assert fins["b"].num_preemptions == len(preempted) and fins["a"].num_preemptions == 0
    assert eng.kv.usage == 0.0


def test_preemption_under_priority_picks_lowest_priority() -> None:
    eng = _kv_tight_engine("priority")
    eng.add_request("low", list(range(40)), max_tokens=60, ignore_eos=True, priority=5)
    eng.step(0.0)  # "low" starts first
    eng.add_request("high", list(range(500, 540)), max_tokens=60, ignore_eos=True, priority=0)
    _, steps = _drain(eng, 1.0)
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted and set(preempted) == {"low"}
    fins = _finished(steps)
    assert fins["low"].completion_tokens == 60 and fins["high"].completion_tokens == 60


@pytest.mark.parametrize(("policy", "order"), [("fcfs", ["p5", "p0"]), ("priority", ["p0", "p5"])])
def test_waiting_order_by_policy(policy: Policy, order: list[str]) -> None:
    eng = Engine(_profile(max_num_seqs=1), policy)
    eng.add_request("p5", list(range(20)), max_tokens=3, ignore_eos=True, priority=5, now=0.0)
    eng.add_request("p0", list(range(50, 70)), max_tokens=3, ignore_eos=True, priority=0, now=0.1)
    _, steps = _drain(eng, 0.2)
    assert _first_token_order(steps) == order


def test_running_request_not_preempted_for_higher_priority_arrival() -> None:
    eng = Engine(_profile(max_num_seqs=1), "priority")
    eng.add_request("low", list(range(20)), max_tokens=5, ignore_eos=True, priority=9)
    eng.step(0.0)
    eng.add_request("high", list(range(50, 70)), max_tokens=5, ignore_eos=True, priority=0)
    _, steps = _drain(eng, 1.0)
    assert [f.req_id for s in steps for f in s.finished] == ["low", "high"]
    assert not any(s.preempted for s in steps)


def test_max_num_seqs_limits_running() -> None:
    eng = Engine(_profile(max_num_seqs=2))
    for i in range(5):
        eng.add_request(f"r{i}", list(range(i * 100, i * 100 + 10)), max_tokens=4, ignore_eos=True)
    eng.step(0.0)
    assert eng.stats().running == 2 and eng.stats().waiting == 3


def test_abort_frees_blocks() -> None:
    eng = Engine(_profile())
    eng.add_request("r", list(range(100)), max_tokens=50, ignore_eos=True)
    eng.step(0.0)
    assert eng.kv.usage > 0 and eng.has_request("r")
    assert eng.abort("r", 0.1)
    assert eng.kv.usage == 0.0 and not eng.has_request("r") and not eng.has_work()
    assert not eng.abort("r", 0.2)
    eng.add_request("w", list(range(10)), max_tokens=5)
    assert eng.abort("w", 0.3)  # aborting a waiting request works too
    assert not eng.has_work()


def test_prompt_errors() -> None:
    eng = Engine(_profile())
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request("long", [1] * 8192, max_tokens=1)
    with pytest.raises(RequestError):
        eng.add_request("empty", [], max_tokens=1)
    small = Engine(_profile(num_blocks=4))  # 64 tokens of KV: longer prompts can never fit
    with pytest.raises(RequestError):
        small.add_request("big", list(range(100)), max_tokens=1)


def test_natural_stop_and_length() -> None:
    eng = Engine(_profile())  # natural_output_tokens = 32
    eng.add_request("nat", list(range(10)), max_tokens=100)
    eng.add_request("cut", list(range(10)), max_tokens=5)
    eng.add_request("eos", list(range(10)), max_tokens=50, ignore_eos=True)
    eng.add_request("dflt", list(range(10)), max_tokens=None)
    _, steps = _drain(eng)
    fins = _finished(steps)
    assert (fins["nat"].completion_tokens, fins["nat"].finish_reason) == (32, "stop")
    assert (fins["cut"].completion_tokens, fins["cut"].finish_reason) == (5, "length")
    assert (fins["eos"].completion_tokens, fins["eos"].finish_reason) == (50, "length")
    assert (fins["dflt"].completion_tokens, fins["dflt"].finish_reason) == (32, "stop")


def test_max_tokens_cut_to_context() -> None:
    eng = Engine(_profile(num_blocks=8))  # effective max_model_len 128
    eng.add_request("r", list(range(120)), max_tokens=1000, ignore_eos=True)
    _, steps = _drain(eng)
    assert _finished(steps)["r"].completion_tokens == 8


def test_no_admissions_in_a_step_that_preempted() -> None:
    # "a" and "b" fill the cache; then "c" (small, higher priority than "b") arrives. When "b" is
    # preempted, vLLM admits nobody in that step, so "c" only starts in the next one.
    eng = Engine(_profile(num_blocks=10), "priority")
    eng.add_request("a", list(range(40)), max_tokens=100, ignore_eos=True, priority=0)
    eng.add_request("b", list(range(500, 540)), max_tokens=100, ignore_eos=True, priority=5)
    now = 0.0
    while eng.kv.num_free_blocks > 0:
        now += eng.step(now).duration
    eng.add_request("c", list(range(900, 910)), max_tokens=5, ignore_eos=True, priority=1)
    while True:
        running_before = eng.stats().running
        res = eng.step(now)
        now += res.duration
        if res.preempted:
            assert res.preempted == ["b"]
            assert eng.stats().running == running_before - 1  # "c" was not admitted
            break
    res = eng.step(now)
    assert res.first_token == ["c"]
    assert eng.stats().running == 2  # "a" and now "c"
