"""Agent-session traces: one JSON session per line (the agentcgroup trace format).

Only the fields replay needs are kept. A packaged sample (``marsproxy/data/sample_trace.jsonl``,
16 sessions of the public agentcgroup traces, sub-agents dropped, at most 40 turns) lets the demo
and the tests run with nothing outside the repository.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Turn:
    input_tokens: int
    output_tokens: int
    tool_s: float | None  # None after the last call
    tool: str


@dataclass(frozen=True)
class SessionTrace:
    id: str
    turns: tuple[Turn, ...]


def _parse_line(line: str, where: str) -> SessionTrace:
    try:
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise TypeError('a session is a JSON object with "id" and "turns"')
        turns = tuple(
            Turn(
                input_tokens=int(t["input_tokens"]),
                output_tokens=max(1, int(t["output_tokens"])),
                tool_s=None if t.get("tool_s") is None else float(t["tool_s"]),
                tool=str(t.get("tool") or "other"),
            )
            for t in raw["turns"]
        )
        return SessionTrace(id=str(raw["id"]), turns=turns)
    except KeyError as exc:
        raise TraceError(f"{where}: not a session trace line (no field {exc})") from exc
    except (ValueError, TypeError) as exc:
        raise TraceError(f"{where}: not a session trace line ({exc})") from exc


def load_trace(path: str | Path | None = None, *, held_out: bool = False) -> list[SessionTrace]:
    """Load sessions from ``path``, or the packaged sample when ``path`` is None.
    ``held_out``: without the sessions the packaged sample holds (the defaults were tuned on
    workloads drawn from it), so that what is left was never tuned on."""
    if held_out and path is None:
        raise TraceError("held out: the packaged sample is what the defaults were tuned on;"
                         " name a trace file")
    sessions = _read(path)
    if held_out:
        seen = {s.id for s in _read(None)}
        sessions = [s for s in sessions if s.id not in seen]
        if not sessions:
            raise TraceError(f"{path}: every session is in the packaged sample: none is held out")
    return sessions


def _read(path: str | Path | None) -> list[SessionTrace]:
    if path is None:
        text = resources.files("marsproxy.data").joinpath("sample_trace.jsonl").read_text()
        name = "packaged sample_trace.jsonl"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise TraceError(f"cannot read trace {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise TraceError(f"cannot read trace {path}: not UTF-8 text (byte {exc.start}:"
                             f" {exc.reason})") from exc
        name = str(path)
    sessions = [
        _parse_line(line, f"{name}:{i}")
        for i, line in enumerate(text.splitlines(), 1)
        if line.strip()
    ]
    sessions = [s for s in sessions if s.turns]
    if not sessions:
        raise TraceError(f"{name}: no sessions")
    return sessions


def sample_sessions(sessions: list[SessionTrace], n: int, seed: int) -> list[SessionTrace]:
    """``n`` sessions picked with a seeded RNG (all of them, shuffled, when n ≥ len)."""
    rng = random.Random(seed)
    return rng.sample(sessions, k=min(n, len(sessions)))
