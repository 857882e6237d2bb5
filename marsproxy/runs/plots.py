"""PNG plots of a run (matplotlib, headless): latency CDFs per workload, and for each proxied
policy the window, KV usage, CPU pressure and admission queue over time (from its event stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

from marsproxy.runs.report import groups
from marsproxy.runs.results import RunResult, slug

_DPI = 80


def latency_cdf(path: Path, group: Sequence[RunResult], title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in group:
        xs = sorted(o.e2e_s for o in r.outcomes if o.e2e_s is not None)
        if xs:
            # Over every session: a run that left some unfinished ends below 1.
            ys = [(i + 1) / len(r.outcomes) for i in range(len(xs))]
            done = len(xs) / len(r.outcomes)
            label = r.policy if done == 1 else f"{r.policy} ({100 * done:.0f} % finished)"
            ax.step(xs, ys, where="post", label=label)
    ax.set_xlabel("end-to-end latency of finished sessions (s)")
    ax.set_ylabel("fraction of sessions")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def timelines(path: Path, run: RunResult, title: str) -> bool:
    """Four panels over time; False (no file) when the run has no event stream."""
    keys = [("window", "admission window"), ("kv_usage", "KV usage"),
            ("cpu_backlog", "tool backlog ratio"), ("queue", "admission queue")]
    if not any(run.timeline.get(k) for k, _ in keys):
        return False
    fig, axes = plt.subplots(4, 1, figsize=(6, 6), sharex=True)
    for ax, (key, label) in zip(axes, keys, strict=True):
        pts = run.timeline.get(key) or []
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", lw=0.8)
        ax.set_ylabel(label, fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return True


def plot_all(out_dir: Path, runs: Sequence[RunResult]) -> dict[tuple[str, str], list[str]]:
    """Writes the plots; returns their file names (relative to ``out_dir``) by (regime, load)."""
    made: dict[tuple[str, str], list[str]] = {}
    for (regime, load), group in groups(runs).items():
        names = []
        cdf = f"cdf-{slug(regime, load)}.png"
        latency_cdf(out_dir / cdf, group, f"latency CDF — regime {regime}, load {load}")
        names.append(cdf)
        for r in group:
            tl = f"timeline-{slug(regime, load, r.policy)}.png"
            if timelines(out_dir / tl, r, f"{r.policy} — regime {regime}, load {load}"):
                names.append(tl)
        made[(regime, load)] = names
    return made
