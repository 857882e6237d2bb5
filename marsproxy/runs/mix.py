"""Mixed workloads: groups of sessions of their own service class or tenant, each with its
own number of sessions and arrival rate (``--classes`` / ``--tenants`` of ``marsproxy sim``
and ``marsproxy bench live``).

A group ``NAME:N@RATE`` is N sessions arriving at RATE sessions/s (the run's arrival kind);
with ``--classes`` NAME is the sessions' service class (as ``x-session-class`` sends it), with
``--tenants`` their tenant: simulated, its tenant id (as the hash of an API key names it); live,
the group sends its own API key, ``sk-bench-NAME`` (``bench/agent.py``). Each group's sessions are
built on their own (their own sample of the trace, their own arrivals, scaled to the regime
on their own), so a group run alone replays exactly the sessions it has in the mix: alone
and mixed compare the same sessions (``benchmarks/sharing_bench.py``).

Every figure is per group too (:func:`group_summaries`): the mean E2E, the completion and the
throughput of each group's sessions, every session counted.

Pure code: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from marsproxy.runs.results import SessionOutcome, group_summaries

MixKind = Literal["class", "tenant"]


@dataclass(frozen=True, slots=True)
class MixGroup:
    name: str
    sessions: int
    rate_per_s: float
    kind: MixKind

    @property
    def tenant(self) -> str:
        """The tenant its sessions send as ("" : the run's one tenant)."""
        return self.name if self.kind == "tenant" else ""

    @property
    def cls(self) -> str | None:
        """The service class its sessions ask for (``None``: the default)."""
        return self.name if self.kind == "class" else None

    def text(self) -> str:
        return f"{self.name}:{self.sessions}@{self.rate_per_s:g}"


def parse_mix(text: str, kind: MixKind) -> tuple[MixGroup, ...]:
    """``NAME:N@RATE,...`` as groups; distinct names, N >= 1, RATE >= 0."""
    flag = "--classes" if kind == "class" else "--tenants"
    out: list[MixGroup] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, _, rest = item.partition(":")
        n, _, rate = rest.partition("@")
        try:
            group = MixGroup(name.strip(), int(n), float(rate), kind)
        except ValueError:
            raise ValueError(f"{flag}: expected NAME:N@RATE such as batch:64@0.5, got"
                             f" {item!r}") from None
        if not group.name or group.sessions < 1 or group.rate_per_s < 0:
            raise ValueError(f"{flag}: {item!r} needs a name, N >= 1 and RATE >= 0")
        out.append(group)
    if not out:
        raise ValueError(f"{flag}: no group in {text!r}")
    if len({g.name for g in out}) != len(out):
        raise ValueError(f"{flag}: group names must be distinct, got {text!r}")
    return tuple(out)


def mix_label(groups: Sequence[MixGroup]) -> str:
    """The load of a mixed workload, as its report names it."""
    kind = groups[0].kind
    return ("classes " if kind == "class" else "tenants ") + ", ".join(g.text() for g in groups)


def group_table(runs: Sequence[tuple[str, Sequence[SessionOutcome]]]) -> list[str]:
    """Per policy and group: mean E2E, completion, throughput (a report's lines; none
    without groups)."""
    rows = [(p, g, s) for p, outs in runs for g, s in group_summaries(outs).items()]
    if not rows:
        return []
    lines = ["", "| policy | group | mean s | P95 s | throughput /s | done |",
             "|---|---|---|---|---|---|"]
    for p, g, s in rows:
        ge = "" if s.completion >= 1 else "≥ "
        lines.append(f"| {p} | {g} | {ge}{s.mean_s:.1f} | {ge}{s.p95_s:.1f} | "
                     f"{s.throughput_per_s:.4g} | {s.finished}/{s.sessions} |")
    return lines
