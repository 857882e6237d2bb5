"""Processor sharing of the tool CPUs."""

from __future__ import annotations

import pytest

from marsproxy.sim.cpu import ProcessorSharing


def _drain(ps: ProcessorSharing) -> dict[str, float]:
    done: dict[str, float] = {}
    while (t := ps.next_completion()) is not None:
        for job in ps.pop_done(t):
            done[job] = t
    return done


def test_up_to_k_tools_run_at_full_speed() -> None:
    ps = ProcessorSharing(2)
    ps.add(0.0, "a", 1.0)
    ps.add(0.0, "b", 3.0)
    assert _drain(ps) == {"a": pytest.approx(1.0), "b": pytest.approx(3.0)}


def test_more_tools_than_cores_stretch() -> None:
    ps = ProcessorSharing(2)
    for j in "abcd":
        ps.add(0.0, j, 1.0)
    # four tools on two cores: each gets half a core, all end at 2 s
    assert _drain(ps) == {j: pytest.approx(2.0) for j in "abcd"}


def test_a_late_tool_slows_the_running_ones() -> None:
    ps = ProcessorSharing(1)
    ps.add(0.0, "a", 2.0)
    assert ps.next_completion() == pytest.approx(2.0)
    assert ps.pop_done(1.0) == []  # a has done 1 s of its 2 s
    ps.add(1.0, "b", 0.5)  # now each gets half: b needs 1 s more, a 2 s more
    done = _drain(ps)
    assert done["b"] == pytest.approx(2.0)
    assert done["a"] == pytest.approx(2.5)  # 1 + 0.5 (shared with b) + 0.5 alone


def test_time_must_not_go_backwards() -> None:
    ps = ProcessorSharing(1)
    ps.add(5.0, "a", 1.0)
    with pytest.raises(ValueError):
        ps.add(4.0, "b", 1.0)
