"""Shared options of `bench live` and `sim`: policies, overrides, workload cases, CLI errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from marsproxy.runs import options


def _args(**over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    options.add_workload_args(p, sessions=8, rates="0.5", token_scale=1.0, tool_time_scale=1.0,
                              max_turns=None, regimes="trace")
    ns = p.parse_args([])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_direct_is_always_first_and_all_adds_ablations() -> None:
    assert options.policies("mars,fcfs,mars") == ["direct", "mars", "fcfs"]
    assert options.policies("direct") == ["direct"]
    everything = options.policies("all")
    assert everything[0] == "direct" and "mars-no-retention" in everything
    assert len(everything) == len(set(everything)) == 9
    assert not any(n.startswith("window-") for n in everything)
    with pytest.raises(ValueError, match="unknown policy bogus"):
        options.policies("mars,bogus")


def test_fixed_windows_are_policies_with_ranges() -> None:
    assert options.policies("mars,window-2..4,window-6,window-3") == [
        "direct", "mars", "window-2", "window-3", "window-4", "window-6"]
    for bad, why in (("window-0", "at least 1"), ("window-x", "window-N"),
                     ("window-5..3", "5..3"), ("window-", "window-N"),
                     ("window-1..99", "at most 64")):
        with pytest.raises(ValueError, match=why):
            options.policies(f"mars,{bad}")


def test_a_fixed_window_is_mars_holding_exactly_n_sessions() -> None:
    # mars' decisions with the window pinned to N and the forecast fit off: the yardstick
    # "the best fixed window chosen in hindsight"; --set items still apply, except where the
    # window's own keys say otherwise.
    sets = options.parse_sets(["admission.window_max=40", "admission.tuning.max_bypass=8"], 60.0)
    cfg = options.proxy_config("window-3", sets, ["http://w0"])
    mars = options.proxy_config("mars", sets, ["http://w0"])
    a = cfg.admission
    assert (a.window_min, a.window_init, a.window_max) == (3, 3, 3)
    assert a.tuning.kv_fit_peak is False and mars.admission.tuning.kv_fit_peak is True
    assert (a.queue_deadline_s, a.tuning.max_bypass) == (60.0, 8)
    assert cfg.scheduler == mars.scheduler and cfg.placement == mars.placement
    assert sets["admission"]["window_max"] == 40  # the caller's overrides are not touched
    assert options.preset_of("window-3") == "mars" and options.preset_of("fcfs") == "fcfs"


def test_overrides_nest_parse_yaml_and_win_over_bench_defaults() -> None:
    sets = options.parse_sets(["admission.window_max=8", "admission.window_init=8",
                               "admission.queue_deadline_s=100",
                               "scheduler.tuning.service_thresholds=[1, 2, 3]"])
    assert sets["admission"] == {"queue_deadline_s": 100, "window_max": 8, "window_init": 8}
    assert sets["scheduler"]["tuning"]["service_thresholds"] == [1, 2, 3]
    cfg = options.proxy_config("continuum", sets, ["http://w0"])
    assert cfg.admission.window_max == 8 and cfg.scheduler.priority_policy == "session_fcfs"
    assert options.parse_sets([])["admission"]["queue_deadline_s"] == 86_400
    with pytest.raises(ValueError, match="KEY=VALUE"):
        options.parse_sets(["window_max"])


def test_queue_deadline_reaches_every_proxied_policy_and_the_meta() -> None:
    # Default: the command's (the simulator passes its horizon), long enough for every session.
    args = _args()
    sets = options.parse_sets(args.sets, options.queue_deadline(args, 1e7))
    for policy in ("fcfs", "continuum", "mars"):
        assert options.proxy_config(policy, sets, ["http://w0"]).admission.queue_deadline_s == 1e7
    assert options.deadline_meta(sets, 1e7, "the horizon") == (
        "1e+07 s (the horizon: every session may wait until it is admitted)")
    # --queue-deadline for one run, over the default; other overrides still apply.
    args = _args(queue_deadline=45.0, sets=["admission.tuning.max_bypass=8"])
    sets = options.parse_sets(args.sets, options.queue_deadline(args, 1e7))
    cfg = options.proxy_config("mars", sets, ["http://w0"])
    assert (cfg.admission.queue_deadline_s, cfg.admission.tuning.max_bypass) == (45.0, 8)
    assert options.deadline_meta(sets, 1e7, "the horizon") == "45 s (set for this run)"
    # --set alone still sets it; both at once is an error, not a silent pick.
    sets = options.parse_sets(["admission.queue_deadline_s=100"], 1e7)
    assert options.proxy_config("mars", sets, ["http://w0"]).admission.queue_deadline_s == 100
    with pytest.raises(ValueError, match="give the queue deadline once"):
        options.queue_deadline(_args(queue_deadline=5.0,
                                     sets=["admission.queue_deadline_s=9"]), 1e7)
    with pytest.raises(ValueError, match="--queue-deadline must be > 0"):
        options.queue_deadline(_args(queue_deadline=0.0), 1e7)
    # A deadline inside the aging margin fails before the run, naming both keys.
    with pytest.raises(ValueError, match="aging_margin_s < queue_deadline_s"):
        options.check_policies(["direct", "mars"], options.parse_sets([], 10.0))
    options.check_policies(["direct", "mars"], options.parse_sets(
        ["admission.tuning.aging_margin_s=1"], 10.0))


def test_cases_nest_regimes_over_rates_and_cap_the_context() -> None:
    cases = options.cases(_args(regimes="8k,32k", rates="0.1,1"), engine_context=8192)
    assert [(c.regime, c.load) for c in cases] == [
        ("8k", "poisson 0.1/s"), ("8k", "poisson 1/s"), ("32k", "poisson 0.1/s"),
        ("32k", "poisson 1/s")]
    assert all(c.spec.max_context_tokens == 8192 - 1024 for c in cases)
    assert cases[0].spec.regime_peak_tokens == 8192 and cases[2].spec.regime_peak_tokens == 32768
    with pytest.raises(ValueError, match="unknown regime"):
        options.cases(_args(regimes="16k"), engine_context=8192)


def test_seeds_nest_inside_each_load_and_name_their_case() -> None:
    cases = options.cases(_args(rates="0.1,1", seeds="3,1"), engine_context=8192)
    assert [(c.load, c.seed, c.spec.seed) for c in cases] == [
        ("poisson 0.1/s", 3, 3), ("poisson 0.1/s", 1, 1), ("poisson 1/s", 3, 3),
        ("poisson 1/s", 1, 1)]
    assert cases[1].label == "trace poisson 0.1/s, seed 1"
    one = options.cases(_args(seed=5), engine_context=8192)
    assert [(c.seed, c.spec.seed, c.label) for c in one] == [(None, 5, "trace poisson 0.5/s")]
    for bad in ("1,x", "2,2", ","):
        with pytest.raises(ValueError, match="--seeds needs"):
            options.cases(_args(seeds=bad), engine_context=8192)


@pytest.mark.parametrize(("args", "message"), [
    (["sim", "--policies", "nope"], "marsproxy sim: unknown policy nope"),
    (["sim", "--tool-cpus", "2", "--busy-cpus", "2"],
     "--busy-cpus must be >= 0 and below --tool-cpus (2.0), got 2.0"),
    (["bench", "live", "--state-every", "-1"],
     "marsproxy bench live: --state-every must be >= 0, got -1.0"),
    (["sim", "--seeds", "0,0"], "marsproxy sim: --seeds needs distinct integers, got '0,0'"),
    (["sim", "--call-overhead", "-0.01"], "marsproxy sim: --call-overhead must be >= 0, got -0.01"),
    (["sim", "--state-every", "-1"], "marsproxy sim: --state-every must be >= 0, got -1.0"),
    (["sim", "--queue-deadline", "-5"], "marsproxy sim: --queue-deadline must be > 0, got -5.0"),
    (["bench", "live", "--queue-deadline", "5", "--set", "admission.queue_deadline_s=9"],
     "marsproxy bench live: give the queue deadline once"),
    (["sim", "--queue-deadline", "20"], "need tuning.aging_margin_s < queue_deadline_s"),
    (["bench", "live", "--classes", "gold:2@1"],
     "marsproxy bench live: --classes: unknown class gold; known: interactive, batch"),
    (["bench", "live", "--classes", "batch:1@1", "--tenants", "a:1@1"],
     "marsproxy bench live: give --classes or --tenants, not both"),
    (["bench", "live", "--trace", "/no/such/trace.jsonl"],
     "marsproxy bench live: cannot read trace /no/such/trace.jsonl"),
    (["bench", "live", "--held-out"], "marsproxy bench live: held out: the packaged sample is"),
    # Each of these was a traceback (IndexError, ZeroDivisionError, a ValueError out of the
    # workload), a run on nonsense (a zero or negative time scale, a context of -5 tokens), or
    # an error naming a config key the operator never set (--horizon 0).
    (["sim", "--rates", ""], "marsproxy sim: --rates needs at least one rate"),
    (["bench", "live", "--rates", ","], "marsproxy bench live: --rates needs at least one rate"),
    (["sim", "--rates", "0.5,abc"], "marsproxy sim: --rates: 'abc' is not a number"),
    (["sim", "--trees", "4-2"], "marsproxy sim: --trees: expected MIN-MAX with 1 <= MIN <= MAX"),
    (["bench", "live", "--trees", "0"], "marsproxy bench live: --trees: expected MIN-MAX with"),
    (["sim", "--workers", "0"], "marsproxy sim: --workers must be >= 1, got 0"),
    (["bench", "live", "--workers", "0"], "marsproxy bench live: --workers must be >= 1, got 0"),
    (["sim", "--time-scale", "0"], "marsproxy sim: --time-scale must be > 0, got 0.0"),
    (["bench", "live", "--time-scale", "-1"],
     "marsproxy bench live: --time-scale must be > 0, got -1.0"),
    (["sim", "--horizon", "0"], "marsproxy sim: --horizon must be > 0, got 0.0"),
    (["sim", "--max-context", "0"], "marsproxy sim: --max-context must be >= 1, got 0"),
])
def test_cli_refuses_bad_options_clearly(args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "marsproxy.cli", *args, "--no-plots"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert message in r.stderr
