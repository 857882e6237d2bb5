"""Command-line options shared by ``marsproxy bench live`` and ``marsproxy sim``.

Both take the same workload options (so the same flags give the same sessions), the policies to
compare, ``--set KEY=VALUE`` overrides of the proxy config applied to every proxied policy, and
``--queue-deadline S``: the admission queue deadline of the run. Headline numbers compare
policies on the same sessions, so by default the deadline is long enough that every session
finishes (the simulator's horizon; a day live); a tight one shows what refusals cost.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from marsproxy.config import MarsConfig, load_config
from marsproxy.policies import policy_names
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.mix import MixGroup, mix_label, parse_mix
from marsproxy.runs.results import load_label
from marsproxy.runs.workload import REGIMES, WorkloadSpec

DIRECT = "direct"
WINDOW = "window-"
"""A fixed window's policy name: ``window-N``."""
MAX_WINDOW = 64
"""The largest fixed window: ``window-1..1000`` is a typo, not a thousand runs."""
DEFAULT_POLICIES = ("direct", "fcfs", "autellix", "continuum", "mars")
ABLATIONS = ("mars-no-admission", "mars-no-priority", "mars-no-retention", "mars-no-trees")
QUEUE_DEADLINE_KEY = "admission.queue_deadline_s"
# A benchmark measures latency on every session, so a queued session waits rather than being
# refused after the proxy's 300 s default deadline (an agent would retry after Retry-After).
DEFAULT_QUEUE_DEADLINE_S = 86_400.0


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def trace_label(args: argparse.Namespace) -> str:
    """The trace a run replays, as its report's meta names it."""
    name = args.trace or "packaged sample"
    return f"{name}, held out (the packaged sample's sessions left out)" if args.held_out else name


def add_workload_args(p: argparse.ArgumentParser, *, sessions: int, rates: str,
                      token_scale: float, tool_time_scale: float, max_turns: int | None,
                      regimes: str, queue_deadline: str = f"{DEFAULT_QUEUE_DEADLINE_S:g} s",
                      ) -> None:
    """The shared options; ``queue_deadline`` names the command's default deadline."""
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=None, help="trace file (default: the packaged sample)")
    g.add_argument("--held-out", action="store_true",
                   help="leave out the trace's sessions that the packaged sample holds (the"
                   " defaults were tuned on workloads drawn from it): what is left was never"
                   " tuned on")
    g.add_argument("--sessions", type=int, default=sessions, help="sessions per run")
    g.add_argument("--seed", type=int, default=0, help="seed of sampling and arrivals")
    g.add_argument(
        "--seeds", default=None, metavar="LIST",
        help="comma-separated seeds, replacing --seed: every workload runs once per seed and the"
        " report adds the mean over them (one seed's ratios can be off by 0.5x)",
    )
    g.add_argument(
        "--regimes", default=regimes,
        help=f"input-length regimes, comma-separated: {', '.join(REGIMES)}, or 'trace' (as"
        " recorded)",
    )
    g.add_argument("--rates", default=rates,
                   help="arrival rates (sessions/s; bursts/s for burst), comma-separated: loads")
    g.add_argument("--arrivals", choices=("poisson", "fixed", "burst"), default="poisson")
    g.add_argument("--burst-size", type=int, default=8, help="sessions per burst")
    g.add_argument("--token-scale", type=float, default=token_scale,
                   help="multiplier on every token count (after the regime)")
    g.add_argument("--tool-time-scale", type=float, default=tool_time_scale,
                   help="multiplier on every tool time")
    g.add_argument("--max-turns", type=int, default=max_turns, help="LLM calls per session at most")
    g.add_argument("--trees", default=None, metavar="MIN-MAX",
                   help="agent trees: each root spawns MIN to MAX of the following sessions as"
                   " sub-agents in a tool phase and waits on them (e.g. 2-4; default: flat)")
    g.add_argument("--max-context", type=int, default=None,
                   help="largest prompt in tokens (default: the engine's context less 1024 for"
                   " the reply)")
    g.add_argument("--prefix-groups", type=int, default=0, metavar="N",
                   help="sessions in N groups whose first prompts share --prefix-tokens tokens"
                   " (session i in group i mod N; 0: no shared prefixes beyond the system prompt)")
    g.add_argument("--prefix-tokens", type=int, default=4096, metavar="T",
                   help="tokens each group shares at the start of its sessions' prompts")
    q = p.add_argument_group("policies")
    q.add_argument(
        "--policies", default=",".join(DEFAULT_POLICIES),
        help="comma-separated presets to compare ('direct' is always included; 'all' adds the"
        f" ablations); known: {DIRECT}, {', '.join(policy_names())}; and fixed windows,"
        f" {WINDOW}N or {WINDOW}A..B: mars holding exactly N sessions per worker, without the"
        " forecast fit (the best one in hindsight is a yardstick for mars)",
    )
    q.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
        help="proxy config override for every proxied policy, e.g. admission.window_max=16",
    )
    q.add_argument(
        "--queue-deadline", type=float, default=None, metavar="S", dest="queue_deadline",
        help=f"{QUEUE_DEADLINE_KEY} of every proxied policy: the longest a session waits for"
        " admission before a 503 (default: long enough that every session finishes, as headline"
        f" numbers need: {queue_deadline}; the report's meta states the one used)",
    )
    p.add_argument("--out", default=None, help="output folder (default: results/<timestamp>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


@dataclass(frozen=True, slots=True)
class Case:
    regime: str
    load: str
    spec: WorkloadSpec
    seed: int | None = None
    """Set when the run covers several seeds (``--seeds``); the report then averages them."""

    @property
    def label(self) -> str:
        """Regime, load and (with several seeds) seed: names the case in logs and progress."""
        return f"{self.regime} {load_label(self.load, self.seed)}"


def policies(text: str) -> list[str]:
    """The policies to compare, ``direct`` first: presets, ``all`` (the defaults and the
    ablations) and fixed windows, ``window-N`` or ``window-A..B`` (one per size)."""
    names: list[str] = []
    for n in _csv(text):
        if n == "all":
            names += [*DEFAULT_POLICIES, *ABLATIONS]
        elif n.startswith(WINDOW):
            names += _windows(n)
        else:
            names.append(n)
    known = {DIRECT, *policy_names()}
    bad = [n for n in names if n not in known and window_size(n) is None]
    if bad:
        raise ValueError(f"unknown policy {', '.join(bad)}; known: {', '.join(sorted(known))},"
                         f" {WINDOW}N, {WINDOW}A..B")
    out = [DIRECT]
    out += [n for n in dict.fromkeys(names) if n != DIRECT]
    return out


def _windows(name: str) -> list[str]:
    """``window-N`` or ``window-A..B`` as the sizes' policy names."""
    lo, sep, hi = name[len(WINDOW):].partition("..")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"{name!r}: a fixed window is {WINDOW}N or {WINDOW}A..B, N sessions"
                         " per worker") from None
    if a < 1 or b < a:
        raise ValueError(f"{name!r}: window sizes are at least 1, and A..B runs upwards"
                         f" (got {a}..{b})")
    if b > MAX_WINDOW:
        raise ValueError(f"{name!r}: window sizes are at most {MAX_WINDOW}")
    return [f"{WINDOW}{n}" for n in range(a, b + 1)]


def window_size(policy: str) -> int | None:
    """N of a fixed window's policy name (``window-N``), else ``None``."""
    if not policy.startswith(WINDOW):
        return None
    n = policy[len(WINDOW):]
    return int(n) if n.isdigit() and 1 <= int(n) <= MAX_WINDOW else None


def preset_of(policy: str) -> str:
    """The preset a proxied policy runs: a fixed window is mars with its window pinned."""
    return "mars" if window_size(policy) is not None else policy


def policy_sets(policy: str, sets: dict[str, Any]) -> dict[str, Any]:
    """The overrides ``policy`` runs with: ``sets``, and for a fixed window of N its window
    pinned at N sessions per worker without the forecast-peak fit (a new session needs only its
    first prompt to fit the free KV: the yardstick ``docs/methodology.md`` describes)."""
    n = window_size(policy)
    if n is None:
        return sets
    out = copy.deepcopy(sets)
    adm = out.setdefault("admission", {})
    adm.update(window_min=n, window_init=n, window_max=n)
    adm.setdefault("tuning", {})["kv_fit_peak"] = False
    return out


def seeds(args: argparse.Namespace) -> list[int]:
    """``--seeds`` as a list, or ``[--seed]``."""
    if args.seeds is None:
        return [args.seed]
    try:
        out = [int(p) for p in _csv(args.seeds)]
    except ValueError:
        raise ValueError(f"--seeds needs comma-separated integers, got {args.seeds!r}") from None
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--seeds needs distinct integers, got {args.seeds!r}")
    return out


def seeds_text(args: argparse.Namespace) -> str:
    """The seeds of a run as its report's meta lists them: ``"0"`` or ``"0, 1, 2"``."""
    return ", ".join(str(x) for x in seeds(args))


def cases(args: argparse.Namespace, engine_context: int) -> list[Case]:
    """One workload per (regime, rate, seed), in that nesting order. Prompts stay within
    ``--max-context``, by default ``engine_context`` less room for the reply."""
    if args.max_context is not None and args.max_context < 1:
        raise ValueError(f"--max-context must be >= 1, got {args.max_context}")
    max_context = args.max_context or max(16, engine_context - 1024)
    seed_list = seeds(args)
    groups = mix(args)
    rates = ["0"] if groups else _csv(args.rates)
    if not rates:
        raise ValueError(f"--rates needs at least one rate, got {args.rates!r}")
    trees = tree_range(getattr(args, "trees", None))
    out = []
    for regime in _csv(args.regimes) or ["trace"]:
        if regime != "trace" and regime not in REGIMES:
            raise ValueError(f"unknown regime {regime!r}; known: trace, {', '.join(REGIMES)}")
        # A mix has its own rates, one per group: one load.
        for rate_text in rates:
            try:
                rate = float(rate_text)
            except ValueError:
                raise ValueError(f"--rates: {rate_text!r} is not a number") from None
            arrivals = ArrivalSpec(args.arrivals, rate, args.burst_size)
            label = mix_label(groups) if groups else arrivals.label()
            for seed in seed_list:
                spec = WorkloadSpec(
                    sessions=args.sessions, seed=seed,
                    regime_peak_tokens=None if regime == "trace" else REGIMES[regime],
                    token_scale=args.token_scale, tool_time_scale=args.tool_time_scale,
                    max_turns=args.max_turns, arrivals=arrivals, max_context_tokens=max_context,
                    prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens,
                    trees=trees, mix=groups,
                )
                out.append(Case(regime, label, spec,
                                seed if len(seed_list) > 1 else None))
    return out


def add_mix_args(p: argparse.ArgumentParser) -> None:
    """``--classes`` / ``--tenants``: mixed workloads (``runs/mix.py``), simulated or live."""
    m = p.add_argument_group("mixed workloads (in place of --sessions and --rates)")
    m.add_argument("--classes", default=None, metavar="NAME:N@RATE,...",
                   help="groups of sessions by service class: N sessions of class NAME arriving"
                   " at RATE sessions/s each, e.g. interactive:4@0.05,batch:64@0.5 (live: sent"
                   " as x-session-class); the report adds each group's figures")
    m.add_argument("--tenants", default=None, metavar="NAME:N@RATE,...",
                   help="groups of sessions by tenant, e.g. light:4@0.05,heavy:40@0.5 (simulated:"
                   " NAME is the tenant id, as admission.tenant_weights names it; live: each"
                   " group sends its own API key, sk-bench-NAME)")


def mix(args: argparse.Namespace) -> tuple[MixGroup, ...]:
    """``--classes`` or ``--tenants`` as groups; none without."""
    classes, tenants = getattr(args, "classes", None), getattr(args, "tenants", None)
    if classes and tenants:
        raise ValueError("give --classes or --tenants, not both")
    if classes:
        return parse_mix(classes, "class")
    return parse_mix(tenants, "tenant") if tenants else ()


def tree_range(text: str | None) -> tuple[int, int] | None:
    """``--trees MIN-MAX`` (or one number) as a range of children per root."""
    if not text:
        return None
    lo, _, hi = text.partition("-")
    try:
        out = int(lo), int(hi or lo)
    except ValueError:
        out = (0, 0)
    if not 1 <= out[0] <= out[1]:
        raise ValueError(f"--trees: expected MIN-MAX with 1 <= MIN <= MAX such as 2-4,"
                         f" got {text!r}")
    return out


def queue_deadline(args: argparse.Namespace, default: float) -> float:
    """The run's queue deadline: ``--queue-deadline``, else ``default``; given both ways, an
    error rather than a silent choice."""
    if args.queue_deadline is None:
        return default
    if any(item.partition("=")[0].strip() == QUEUE_DEADLINE_KEY for item in args.sets):
        raise ValueError(f"give the queue deadline once: --queue-deadline or --set"
                         f" {QUEUE_DEADLINE_KEY}=S, not both")
    if not args.queue_deadline > 0:
        raise ValueError(f"--queue-deadline must be > 0, got {args.queue_deadline}")
    return float(args.queue_deadline)


def parse_sets(sets: list[str],
               queue_deadline_s: float = DEFAULT_QUEUE_DEADLINE_S) -> dict[str, Any]:
    """``a.b=v`` (v as YAML) → nested overrides: the run's queue deadline first, the ``--set``
    items over it."""
    tree: dict[str, Any] = {"admission": {"queue_deadline_s": queue_deadline_s}}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set needs KEY=VALUE, got {item!r}")
        parts = key.strip().split(".")
        if not all(parts):
            raise ValueError(f"--set {item!r}: an empty key between dots")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {item!r}: the value is not YAML ({_one_line(exc)})") from None
        node = tree
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # an earlier --set (or the deadline) set a value here
                raise ValueError(f"--set {item!r}: {'.'.join(parts[:i + 1])} is a value, not a"
                                 " section")
        node[parts[-1]] = value
    return tree


def _one_line(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    return str(problem) if problem else str(exc).splitlines()[0]


def deadline_meta(sets: dict[str, Any], default: float, default_text: str) -> str:
    """The queue deadline a run used, as its report's meta states it."""
    used = float(sets["admission"]["queue_deadline_s"])
    note = (f" ({default_text}: every session may wait until it is admitted)"
            if used == default else " (set for this run)")
    return f"{used:g} s{note}"


def check_policies(pols: list[str], sets: dict[str, Any]) -> None:
    """Every proxied policy's config validates with the overrides (a ``ValueError`` naming the
    keys otherwise, before the run starts)."""
    for p in pols:
        if p != DIRECT:
            proxy_config(p, sets, ["http://check"])


def check_mix(groups: tuple[MixGroup, ...], sets: dict[str, Any]) -> None:
    """``--classes`` names classes of the config (``admission.classes.order``)."""
    order = proxy_config("mars", sets, ["http://check"]).admission.classes.order
    bad = [g.name for g in groups if g.kind == "class" and g.name not in order]
    if bad:
        raise ValueError(f"--classes: unknown class {', '.join(bad)}; known: {', '.join(order)}")


def proxy_config(policy: str, sets: dict[str, Any], workers: list[str]) -> MarsConfig:
    """The proxy config of ``policy``: preset < ``--set`` overrides; env is not read."""
    return load_config(None, environ={}, overrides={
        **policy_sets(policy, sets), "policy": preset_of(policy), "workers": workers})


def out_dir(arg: str | None, kind: str) -> Path:
    if arg:
        return Path(arg)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{stamp}-{kind}"
