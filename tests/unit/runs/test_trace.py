"""Trace loading and seeded sampling."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from marsproxy.bench.agent import filler
from marsproxy.runs.trace import TraceError, load_trace, sample_sessions


def test_packaged_sample_loads() -> None:
    sessions = load_trace()
    assert len(sessions) == 16
    for s in sessions:
        assert s.turns[-1].tool_s is None or s.turns[-1].tool_s >= 0
        inputs = [t.input_tokens for t in s.turns]
        assert inputs == sorted(inputs), "agent prompts are append-only"


def test_sampling_is_seeded() -> None:
    sessions = load_trace()
    a = [s.id for s in sample_sessions(sessions, 5, seed=7)]
    assert a == [s.id for s in sample_sessions(sessions, 5, seed=7)]
    assert a != [s.id for s in sample_sessions(sessions, 5, seed=8)]
    assert len(sample_sessions(sessions, 100, seed=1)) == 16


def test_bad_lines_name_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "a", "turns": [{"input_tokens": 5, "output_tokens": 1}]}\n{"id": 3}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2"):
        load_trace(p)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_held_out_leaves_out_what_the_defaults_were_tuned_on(tmp_path: Path) -> None:
    tuned = load_trace()[0].id  # a session of the packaged sample, as a shared trace holds it
    p = tmp_path / "t.jsonl"
    line = '{{"id": "{}", "turns": [{{"input_tokens": 5, "output_tokens": 1}}]}}\n'
    p.write_text(line.format(tuned) + line.format("unseen-1"))
    assert [s.id for s in load_trace(p)] == [tuned, "unseen-1"]
    assert [s.id for s in load_trace(p, held_out=True)] == ["unseen-1"]
    p.write_text(line.format(tuned))
    with pytest.raises(TraceError, match="none is held out"):
        load_trace(p, held_out=True)
    with pytest.raises(TraceError, match="name a trace file"):
        load_trace(held_out=True)


def test_filler_has_exact_length_and_is_deterministic() -> None:
    assert len(filler(37, random.Random(1))) == 37 * 4
    assert filler(10, random.Random(2)) == filler(10, random.Random(2))


@pytest.mark.parametrize(("content", "message"), [
    (b'{"id": "a", "turns": [{"input_tokens": 5, "output_tokens": 1}]}\n\xff\n',
     "cannot read trace {p}: not UTF-8 text (byte 64: invalid start byte)"),
    (b'{"id": "a"}\n', '{p}:1: not a session trace line (no field \'turns\')'),
    (b"[1, 2]\n", '{p}:1: not a session trace line (a session is a JSON object with "id" and'
     ' "turns")'),
])
def test_a_trace_that_is_not_jsonl_sessions_is_named_with_the_reason(
    tmp_path: Path, content: bytes, message: str
) -> None:
    # Before: "'utf-8' codec can't decode byte 0xff ..." naming no file; "('turns')";
    # "list indices must be integers or slices, not str".
    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    assert str(exc.value) == message.format(p=p)
