"""results.json and report.md of a benchmark or simulation run (one format for both).

Ratios are speed-ups: ``baseline / policy`` for latencies (above 1: the policy is faster) and
``policy / baseline`` for goodput (above 1: the policy finishes more sessions in time).
"best other" is the best policy whose name does not start with ``mars`` (``direct``, ``fcfs``,
``autellix``, ``continuum``): lowest mean latency for the latency ratios, highest goodput for
the goodput ratio, lowest P95 for the P95 ratio. Every ratio compares runs of the same workload
(same regime, load and seed) in the same invocation.

With several seeds (``--seeds``) each seed is its own workload, and a last section averages
over them per regime and load: the mean of each figure, and the mean of the per-seed ratios
(each ratio still compares runs of one workload).

Every latency counts every session (:mod:`marsproxy.runs.results`): one that was refused or
failed counts at the time it stopped, a lower bound, so a run's latencies are marked ``≥`` when
its completion (finished / sessions) is below 100 %. The completion stands next to the ratios,
and a ratio that compares a run with an incomplete one says so in its cell: ``2.50 (75 % vs
100 %)`` is the policy's completion against its baseline's; the mean over seeds says in how
many seeds a ratio compared incomplete runs.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from marsproxy.runs.mix import group_table
from marsproxy.runs.options import window_size
from marsproxy.runs.results import RunResult, Summary, group_summaries

DIRECT = "direct"

log = logging.getLogger("marsproxy.runs.report")


def is_baseline(policy: str) -> bool:
    return not policy.startswith("mars")


def groups(runs: Iterable[RunResult]) -> dict[tuple[str, str], list[RunResult]]:
    """Runs by workload, (regime, load and seed), in first-seen order."""
    out: dict[tuple[str, str], list[RunResult]] = {}
    for r in runs:
        out.setdefault((r.regime, r.case_load), []).append(r)
    return out


def _ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den) or den == 0:
        return math.nan
    return num / den


def _best(summaries: dict[str, Summary], key: str, lowest: bool) -> str | None:
    cands = [(getattr(s, key), p) for p, s in summaries.items()
             if is_baseline(p) and not math.isnan(getattr(s, key))]
    if not cands:
        return None
    return (min(cands) if lowest else max(cands))[1]


RATIOS = ("mean_vs_direct", "mean_vs_best_other", "goodput_vs_best_other", "p95_vs_best_other")
BASE = "_base_completion"
"""Suffix of a ratio's companion figure: the completion of the run it compares against."""


def ratios(summaries: dict[str, Summary]) -> dict[str, dict[str, float]]:
    """Per policy: mean speed-up vs direct and vs the best other; goodput and P95 vs best other;
    with each ratio ``<ratio>_base_completion``, the completion of the baseline it divides."""
    direct = summaries.get(DIRECT)
    best_mean = _best(summaries, "mean_s", lowest=True)
    best_good = _best(summaries, "goodput_per_s", lowest=False)
    best_p95 = _best(summaries, "p95_s", lowest=True)
    bases = dict(zip(RATIOS, (direct, *(summaries[b] if b else None
                                        for b in (best_mean, best_good, best_p95))), strict=True))
    out: dict[str, dict[str, float]] = {}
    for p, s in summaries.items():
        out[p] = {
            "mean_vs_direct": _ratio(direct.mean_s, s.mean_s) if direct else math.nan,
            "mean_vs_best_other": (
                _ratio(summaries[best_mean].mean_s, s.mean_s) if best_mean else math.nan),
            "goodput_vs_best_other": (
                _ratio(s.goodput_per_s, summaries[best_good].goodput_per_s)
                if best_good else math.nan),
            "p95_vs_best_other": (
                _ratio(summaries[best_p95].p95_s, s.p95_s) if best_p95 else math.nan),
        }
        for k, base in bases.items():
            out[p][k + BASE] = base.completion if base is not None else math.nan
    return out


def _incomplete(own: float, base: float) -> bool:
    return own < 1 or base < 1  # NaN (no sessions, no baseline) is no claim either way


def over_seeds(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per (regime, load) run under several seeds: per policy, the seeds, the mean of each
    summary figure and of each ratio, the per-seed mean-latency ratio against direct with the
    two completions it compares, and per ratio the seeds where either side was incomplete."""
    by_load: dict[tuple[str, str], dict[int, list[RunResult]]] = {}
    for r in runs:
        if r.seed is not None:
            by_load.setdefault((r.regime, r.load), {}).setdefault(r.seed, []).append(r)
    out = []
    for (regime, load), per_seed in by_load.items():
        figs: dict[str, dict[str, list[float]]] = {}
        for group in per_seed.values():
            summaries = {r.policy: r.summary() for r in group}
            for p, rs in ratios(summaries).items():
                f = figs.setdefault(p, {})
                for k, v in {**summaries[p].to_dict(), **rs}.items():
                    f.setdefault(k, []).append(float(v))
        out.append({
            "regime": regime, "load": load, "seeds": list(per_seed),
            "policies": {p: {"seeds": len(f["mean_s"]),
                             "mean": {k: _nanmean(v) for k, v in f.items()},
                             "mean_vs_direct_per_seed": f["mean_vs_direct"],
                             "completion_per_seed": f["completion"],
                             "direct_completion_per_seed": f["mean_vs_direct" + BASE],
                             "incomplete_seeds": {
                                 k: sum(_incomplete(o, b) for o, b in
                                        zip(f["completion"], f[k + BASE], strict=True))
                                 for k in RATIOS}}
                         for p, f in figs.items()},
        })
    return out


def _nanmean(xs: Sequence[float]) -> float:
    """The mean of the defined values (NaN: no finished session, no baseline)."""
    ok = [x for x in xs if not math.isnan(x)]
    return sum(ok) / len(ok) if ok else math.nan


def seeds_table(fig: dict[str, Any]) -> list[str]:
    head = ("| policy | seeds | mean s | P95 s | goodput /s | done | mean ×direct "
            "| ×direct per seed | mean ×best other | goodput ×best other | P95 ×best other |")
    lines = [head, "|" + "---|" * 11]
    for p, f in fig["policies"].items():
        m = f["mean"]
        n = f["seeds"]
        per = " ".join(
            _flagged(x, own, base) for x, own, base in zip(
                f["mean_vs_direct_per_seed"], f["completion_per_seed"],
                f["direct_completion_per_seed"], strict=True))
        cell = {k: _seeds_ratio(f, k) for k in RATIOS}
        ge = _ge(min(f["completion_per_seed"], default=math.nan))
        lines.append(
            f"| {p} | {n} | {ge}{_f(m['mean_s'])} | {ge}{_f(m['p95_s'])} | "
            f"{_g(m['goodput_per_s'])} | {_pct(m['completion'])} | {cell['mean_vs_direct']} | "
            f"{per} | {cell['mean_vs_best_other']} | {cell['goodput_vs_best_other']} | "
            f"{cell['p95_vs_best_other']} |")
    return lines


def yardstick(fig: dict[str, Any]) -> list[str]:
    """With fixed windows among the policies (``window-N``): the best over the seeds by mean
    ×direct, among those that finished as many sessions as any of them (one with a higher
    ratio but fewer done is named beside it), against mars."""
    ok = {p: f["mean"] for p, f in fig["policies"].items()
          if window_size(p) is not None and not math.isnan(f["mean"]["mean_vs_direct"])}
    if not ok:
        return []
    most = max(m["completion"] for m in ok.values())
    best = max((p for p in ok if ok[p]["completion"] == most),
               key=lambda p: ok[p]["mean_vs_direct"])
    top = ok[best]["mean_vs_direct"]

    def figures(m: dict[str, float]) -> str:
        return f"{_f(m['mean_vs_direct'], 2)}, done {_pct(m['completion'])}"

    line = f"Best fixed window over these seeds (mean ×direct): `{best}` {figures(ok[best])}"
    higher = [f"{p} {figures(m)}" for p, m in ok.items() if m["mean_vs_direct"] > top]
    if higher:
        line += f" ({'; '.join(higher)})"
    mars = fig["policies"].get("mars")
    if mars is not None:
        m = mars["mean"]
        line += f"; mars {figures(m)}: {_f(m['mean_vs_direct'] / top, 2)} of it"
    return ["", line + "."]


def _seeds_ratio(f: dict[str, Any], key: str) -> str:
    """A mean over seeds of one ratio, with the count of seeds where it compared a run that
    left sessions unfinished."""
    bad = f["incomplete_seeds"][key]
    note = f" (incomplete in {bad} of {f['seeds']} seeds)" if bad else ""
    return _f(f["mean"][key], 2) + note


def _pct(x: float) -> str:
    """A completion as a percentage: 100 only when every session finished."""
    if math.isnan(x):
        return "–"
    text = f"{100 * x:.1f}"
    return f"{'99.9' if x < 1 and text == '100.0' else text} %"


def _ge(completion: float) -> str:
    """``≥`` before a latency that counts unfinished sessions at their stop time."""
    return "≥" if completion < 1 else ""


def _flagged(ratio: float, own: float, base: float) -> str:
    """A ratio, with both completions after it when either run left sessions unfinished."""
    text = _f(ratio, 2)
    if _incomplete(own, base):
        text += f" ({_pct(own)} vs {_pct(base)})"
    return text


def _f(x: float, digits: int = 1) -> str:
    return "–" if math.isnan(x) else f"{x:.{digits}f}"


def _g(x: float) -> str:
    """Rates: enough significant digits for 0.0042/s as well as 3.1/s."""
    return "–" if math.isnan(x) else f"{x:.3g}"


def table(group: Sequence[RunResult]) -> list[str]:
    summaries = {r.policy: r.summary() for r in group}
    rs = ratios(summaries)
    best_mean = _best(summaries, "mean_s", lowest=True)
    head = ("| policy | mean s | P50 s | P90 s | P95 s | goodput /s | throughput /s "
            "| TTFT P50 s | TTFT P95 s | warm resume | refused | failed | done "
            "| mean ×direct | mean ×best other | goodput ×best other | P95 ×best other |")
    lines = [head, "|" + "---|" * 17]
    for p, s in summaries.items():
        r = rs[p]
        ge = _ge(s.completion)
        flagged = [_flagged(r[k], s.completion, r[k + BASE]) for k in RATIOS]
        lines.append(
            f"| {p} | {ge}{_f(s.mean_s)} | {ge}{_f(s.p50_s)} | "
            f"{ge}{_f(s.p90_s)} | {ge}{_f(s.p95_s)} | {_g(s.goodput_per_s)} | "
            f"{_g(s.throughput_per_s)} | {_f(s.ttft_p50_s, 2)} | {_f(s.ttft_p95_s, 2)} | "
            f"{_f(100 * s.warm_resume_rate, 0)} % | {s.rejected} | {s.failed} | "
            f"{s.finished}/{s.sessions} ({_pct(s.completion)}) | {' | '.join(flagged)} |"
        )
    if best_mean:
        lines.append("")
        lines.append(f"Best other policy by mean latency: `{best_mean}`.")
    if any(s.completion < 1 for s in summaries.values()):
        lines.append("Not every session finished: latencies marked ≥ count a refused or failed "
                     "session at the time it stopped (a lower bound), and a ratio followed by "
                     "(a % vs b %) compares runs that finished different sessions (a: this "
                     "policy's completion, b: the baseline's).")
    lines += tree_table(summaries)
    lines += group_table([(r.policy, r.outcomes) for r in group])
    pre = [f"{r.policy} {r.extra['stats']['preemptions']:.0f}" for r in group
           if "preemptions" in r.extra.get("stats", {})]
    if pre:
        lines.append(f"Engine preemptions: {', '.join(pre)}.")
    cpu = [(r.policy, r.extra["cpu"]) for r in group if "cpu" in r.extra]
    if cpu:
        used = [f"{p} {c['host_busy_cores']:.2f}" + (
            "" if c["process_cores"] is None else f" (proxy {c['process_cores']:.2f})")
            for p, c in cpu]
        lines.append(f"Cores busy on average during the run, of {cpu[0][1]['cores']:.0f} "
                     f"(the whole host; the proxy's own): {', '.join(used)}.")
    return lines


def tree_table(summaries: dict[str, Summary]) -> list[str]:
    """Agent trees (``--trees``): tree completion time per policy, and for a policy ``P`` run
    beside ``P-no-trees`` the ratio (the same sessions admitted flat), with both completions."""
    if not any(s.trees for s in summaries.values()):
        return []
    lines = ["", "| policy | trees | tree mean s | trees done | tree mean ×flat |",
             "|---|---|---|---|---|"]
    for p, s in summaries.items():
        flat = summaries.get(f"{p}-no-trees")
        vs = "" if flat is None else (
            f"{_f(_ratio(flat.tree_mean_s, s.tree_mean_s), 2)} "
            f"({_pct(s.tree_completion)} vs {_pct(flat.tree_completion)})")
        lines.append(f"| {p} | {s.trees} | {_ge(s.tree_completion)}{_f(s.tree_mean_s)} | "
                     f"{_pct(s.tree_completion)} | {vs} |")
    return lines


def done_note(run: RunResult) -> str:
    """How many sessions of one run finished, for its progress bar."""
    s = run.summary()
    return (f"done {s.finished}/{s.sessions} ({_pct(s.completion)}), refused {s.rejected}, "
            f"failed {s.failed}")


def summary_lines(runs: Sequence[RunResult]) -> list[str]:
    """One line per run for the end of a command: completion, mean, and ×direct with its
    completions when either side is incomplete."""
    out = []
    for (regime, load), group in groups(runs).items():
        summaries = {r.policy: r.summary() for r in group}
        for p, r in ratios(summaries).items():
            s = summaries[p]
            vs = "" if p == DIRECT else ", ×direct " + _flagged(
                r["mean_vs_direct"], s.completion, r["mean_vs_direct" + BASE])
            out.append(f"{regime} {load} {p}: done {s.finished}/{s.sessions} "
                       f"({_pct(s.completion)}), refused {s.rejected}, failed {s.failed}; "
                       f"mean {_ge(s.completion)}{_f(s.mean_s)} s{vs}" + (
                           f"; {s.trees} trees: mean {_ge(s.tree_completion)}"
                           f"{_f(s.tree_mean_s)} s, {_pct(s.tree_completion)} done"
                           if s.trees else ""))
            out += [f"  {g}: done {gs.finished}/{gs.sessions}, mean {_ge(gs.completion)}"
                    f"{_f(gs.mean_s)} s, throughput {_g(gs.throughput_per_s)}/s"
                    for g, gs in group_summaries(next(
                        r.outcomes for r in group if r.policy == p)).items()]
    return out


def render(runs: Sequence[RunResult], title: str, meta: dict[str, Any],
           plots: dict[tuple[str, str], list[str]] | None = None) -> str:
    out = [f"# {title}", ""]
    for k, v in meta.items():
        out.append(f"- {k}: {v}")
    out.append("")
    ideal = meta.get("ideal", "computed from the engine profile and the tool times")
    out.append("Latency: end-to-end session time (arrival to last response, tool phases and "
               "admission waits included) over every session: a refused or failed session counts "
               "at the time it stopped (arrival to refusal), a lower bound, so latencies are "
               "marked ≥ when not every session finished. Done: finished / sessions (the "
               "completion). Goodput: sessions per second finishing within 3× "
               f"their ideal time, the ideal {ideal} "
               "(the session alone on an idle system). Ratios are speed-ups (> 1: better than "
               "the baseline); one that compares runs where not every session finished is "
               "followed by both completions.")
    for (regime, load), group in groups(runs).items():
        out += ["", f"## regime {regime or '-'}, load {load or '-'}", ""]
        out += table(group)
        for path in (plots or {}).get((regime, load), []):
            out += ["", f"![{Path(path).stem}]({path})"]
    for fig in over_seeds(runs):
        seeds = ", ".join(str(s) for s in fig["seeds"])
        out += ["", f"## regime {fig['regime'] or '-'}, load {fig['load'] or '-'}: mean over "
                f"seeds {seeds}", "",
                "Each figure is the mean over the seeds (done: the mean completion); each ratio "
                "is the mean of the per-seed ratios.", ""]
        out += seeds_table(fig)
        out += yardstick(fig)
    return "\n".join(out) + "\n"


def _clean(x: Any) -> Any:
    # JSON has no NaN; null says "not defined" (no finished session, no baseline).
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def results_json(runs: Sequence[RunResult], meta: dict[str, Any]) -> dict[str, Any]:
    figures = []
    for group in groups(runs).values():
        summaries = {r.policy: r.summary() for r in group}
        figures.append({"regime": group[0].regime, "load": group[0].load,
                        "seed": group[0].seed, "ratios": ratios(summaries),
                        "summaries": {p: s.to_dict() for p, s in summaries.items()}})
    out: dict[str, Any] = _clean(
        {"meta": meta, "figures": figures, "over_seeds": over_seeds(runs),
         "runs": [r.to_dict() for r in runs]})
    return out


def write(out_dir: Path, runs: Sequence[RunResult], title: str, meta: dict[str, Any],
          make_plots: bool = True) -> Path:
    """Writes results.json, report.md and (with matplotlib) the PNG plots; returns report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[tuple[str, str], list[str]] = {}
    if make_plots:
        try:
            from marsproxy.runs.plots import plot_all
        except ImportError:  # the bench extra is not installed: numbers without pictures
            log.warning("no plots: matplotlib is missing (pip install 'marsproxy[bench]')")
        else:
            plots = plot_all(out_dir, runs)
    (out_dir / "results.json").write_text(json.dumps(results_json(runs, meta), indent=1))
    report = out_dir / "report.md"
    report.write_text(render(runs, title, meta, plots))
    return report
