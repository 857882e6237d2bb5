"""The ``marsproxy`` command: serve, emulate, config check, demo, status."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from marsproxy.cli.status import configure_parser as _configure_status
from marsproxy.config import ConfigError, MarsConfig, dump_config, load_config
from marsproxy.emulator.profiles import profile_names
from marsproxy.policies import policy_names

_FMT = argparse.ArgumentDefaultsHelpFormatter


def _setup_logging(level: str, secrets: Sequence[str] = ()) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from marsproxy.redact import install

    install(secrets)  # credentials never reach the log (docs/security.md)


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = {}
    if args.host is not None:
        over.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        over.setdefault("server", {})["port"] = args.port
    if args.worker:
        over["workers"] = list(args.worker)
    if args.policy is not None:
        over["policy"] = args.policy
    return over


def _cmd_serve(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, overrides=_serve_overrides(args))
    if not cfg.workers:
        raise ConfigError("no workers configured: give --worker URL or a `workers:` list")
    from marsproxy.gateway.http.app import serve
    from marsproxy.gateway.http.loop import run

    _setup_logging(cfg.server.log_level, [cfg.auth.admin_token.get_secret_value()])
    run(lambda: serve(cfg), cfg.server.event_loop)
    return 0


def _check_flags(args: argparse.Namespace, *, positive: Sequence[str] = (),
                 at_least_1: Sequence[str] = (), at_least_0: Sequence[str] = ()) -> None:
    """A ``ValueError`` naming the first flag whose value is out of range: ``positive`` (a
    finite float > 0), ``at_least_1`` (an int >= 1, or unset), ``at_least_0``; and ``--port``."""
    def flag(dest: str) -> str:
        return "--" + dest.replace("_", "-")
    for dest in positive:
        v = getattr(args, dest)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{flag(dest)} must be a finite number > 0, got {v}")
    for dest in at_least_1:
        if (v := getattr(args, dest)) is not None and v < 1:
            raise ValueError(f"{flag(dest)} must be >= 1, got {v}")
    for dest in at_least_0:
        if not (v := getattr(args, dest)) >= 0:
            raise ValueError(f"{flag(dest)} must be >= 0, got {v}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0-65535, got {args.port}")


def _cmd_emulate(args: argparse.Namespace) -> int:
    from marsproxy.emulator.kv_events import StartError, parse_kv_events_config
    from marsproxy.emulator.server import EmulatorOptions, serve

    _setup_logging(args.log_level)
    try:
        _check_flags(args, positive=["time_scale"], at_least_1=[
            "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"])
        kv_events = (None if args.kv_events_config is None
                     else parse_kv_events_config(args.kv_events_config))
    except ValueError as exc:
        sys.stderr.write(f"marsproxy emulate: {exc}\n")
        return 2
    opts = EmulatorOptions(
        profile=args.profile,
        host=args.host,
        port=args.port,
        time_scale=args.time_scale,
        scheduling_policy=args.scheduling_policy,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        kv_events=kv_events,
        # vLLM's own switch: keep responses for previous_response_id (off: every id is a 404).
        responses_store=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0").lower()
        in ("1", "true"),
    )
    try:
        asyncio.run(serve(opts))
    except StartError as exc:
        sys.stderr.write(f"marsproxy emulate: {exc}\n")
        return 2
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    cfg: MarsConfig = load_config(args.file)
    sys.stdout.write(f"# {args.file}: valid. Effective values:\n")
    sys.stdout.write(dump_config(cfg))
    return 0


def _check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """A ``ValueError`` when ``host:port`` cannot be listened on (bound as the demo binds it)."""
    from marsproxy.gateway.http.app import os_reason

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port}:"
                             f" {os_reason(exc)}") from None


def _cmd_demo(args: argparse.Namespace) -> int:
    from marsproxy.cli.demo import DemoOptions, run_demo
    from marsproxy.runs.trace import load_trace

    _setup_logging(args.log_level)
    try:
        _check_flags(args, positive=["time_scale", "token_scale"],
                     at_least_1=["sessions", "max_turns", "num_blocks"],
                     at_least_0=["calm_sessions", "tool_cpus"])
        load_trace(args.trace)  # a missing or malformed trace fails here, not mid-run
        if args.port:
            _check_port_free(args.port)  # before the workers start, not after
    except ValueError as exc:
        sys.stderr.write(f"marsproxy demo: {exc}\n")
        return 2
    opts = DemoOptions(
        sessions=args.sessions,
        max_turns=args.max_turns,
        token_scale=args.token_scale,
        tool_time_scale=args.tool_time_scale,
        time_scale=args.time_scale,
        trace=args.trace,
        seed=args.seed,
        arrival_gap_s=args.arrival_gap,
        num_blocks=args.num_blocks,
        proxy_port=args.port,
        linger_s=args.linger,
        calm_sessions=args.calm_sessions,
        tool_cpus=args.tool_cpus,
        compare=args.compare,
        replicas=args.replicas,
        policy=args.policy,
    )
    return asyncio.run(run_demo(opts))


def build_parser(*, bench_and_sim: bool = True) -> argparse.ArgumentParser:
    """The CLI's parser; ``bench_and_sim`` False: those two commands listed, not configured
    (their options import the benchmark and the simulator: 0.1 s on every ``serve``)."""
    p = argparse.ArgumentParser(
        prog="marsproxy",
        description="Admission-control reverse proxy for coding agents on self-hosted vLLM.",
        formatter_class=_FMT,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="run the proxy in front of vLLM workers",
        description="Run the marsproxy gateway. Flags override MARSPROXY_* env and the file.",
        formatter_class=_FMT,
    )
    s.add_argument("--config", default=None, help="YAML config file (or env MARSPROXY_CONFIG)")
    s.add_argument("--host", default=None, help="listen address (default: server.host)")
    s.add_argument("--port", type=int, default=None, help="listen port (default: server.port)")
    s.add_argument(
        "--worker", action="append", default=None, metavar="URL",
        help="upstream worker base URL; repeat for several (replaces `workers:`)",
    )
    s.add_argument(
        "--policy", default=None, choices=policy_names(),
        help="policy preset laid beneath the config (default: the config's `policy`, mars)",
    )
    s.set_defaults(func=_cmd_serve)

    e = sub.add_parser(
        "emulate",
        help="run an emulated vLLM worker",
        description="Run an emulated vLLM OpenAI server: paged KV with prefix caching, continuous"
        " batching and a step-time model; output text is filler, timing follows the profile.",
        epilog="Environment: VLLM_ENABLE_RESPONSES_API_STORE=1 keeps /v1/responses replies for"
        " previous_response_id, as it does for vLLM.",
        formatter_class=_FMT,
    )
    e.add_argument(
        "--profile", default="tiny", choices=profile_names(),
        help="engine profile (see docs/emulator.md)",
    )
    e.add_argument("--host", default="127.0.0.1", help="listen address")
    e.add_argument("--port", type=int, default=8000, help="listen port")
    e.add_argument(
        "--time-scale", type=float, default=1.0,
        help="wall seconds per modelled second (0.1 runs ten times faster than real time)",
    )
    e.add_argument(
        "--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
        help="as vLLM's --scheduling-policy",
    )
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: profile)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="default: profile")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: profile")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="the longest context served, as vLLM's (default: profile)")
    e.add_argument("--served-model-name", default=None, help="model name (default: profile)")
    e.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="as vLLM's: publish KV cache events over ZMQ, e.g. '{\"enable_kv_cache_events\":"
        " true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\","
        " \"topic\": \"kv\"}' (docs/kv-events.md)",
    )
    e.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    e.set_defaults(func=_cmd_emulate)

    c = sub.add_parser(
        "config", help="configuration tools", description="Configuration tools.",
        formatter_class=_FMT,
    )
    csub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    cc = csub.add_parser(
        "check",
        help="validate a config file and print the effective values",
        description="Validate FILE (with MARSPROXY_* env applied) and print the effective config.",
        formatter_class=_FMT,
    )
    cc.add_argument("file", help="YAML config file")
    cc.set_defaults(func=_cmd_config_check)

    d = sub.add_parser(
        "demo",
        help="run two emulated workers, the proxy and a few agent sessions",
        description="Start two emulated workers and the proxy on free local ports, replay agent"
        " sessions from the packaged sample trace through it and print a summary.",
        formatter_class=_FMT,
    )
    d.add_argument("--sessions", type=int, default=24, help="agent sessions of the burst")
    d.add_argument(
        "--calm-sessions", type=int, default=6, help="small sessions of the calm phase after it"
    )
    d.add_argument("--max-turns", type=int, default=8, help="LLM calls per session at most")
    d.add_argument(
        "--token-scale", type=float, default=0.1, help="multiplier on the trace's token counts"
    )
    d.add_argument(
        "--tool-time-scale", type=float, default=0.2, help="multiplier on the trace's tool times"
    )
    d.add_argument(
        "--time-scale", type=float, default=4.0,
        help="emulated workers' time scale (wall seconds per modelled second)",
    )
    d.add_argument(
        "--arrival-gap", type=float, default=0.02, help="seconds between burst session starts"
    )
    d.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV blocks per emulated worker (default: the tiny profile's 512)",
    )
    d.add_argument("--port", type=int, default=0, help="proxy port (0: a free one)")
    d.add_argument(
        "--linger", type=float, default=0.0,
        help="keep workers and proxy up this many seconds after the replay (for `status` and"
        " the page at /mars/ui)",
    )
    d.add_argument(
        "--tool-cpus", type=float, default=3.0,
        help="CPUs declared for tools (probes.cpu.tool_cpus): the tool backlog's denominator",
    )
    d.add_argument(
        "--no-compare", dest="compare", action="store_false",
        help="skip the run without admission (no side-by-side preemptions)",
    )
    d.add_argument(
        "--replicas", type=int, default=1, choices=(1, 2, 3),
        help="proxy replicas; more than 1 shares one window through a redis-server of the"
        " demo's own (needs redis-server installed)",
    )
    d.add_argument(
        "--policy", default="mars", choices=policy_names(),
        help="policy preset of the main run (the comparison run is fcfs, without admission)",
    )
    d.add_argument("--trace", default=None, help="trace file (default: packaged sample)")
    d.add_argument("--seed", type=int, default=1, help="seed for picking sessions")
    d.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    d.set_defaults(func=_cmd_demo)

    if bench_and_sim:
        _add_bench_and_sim(sub)
    else:
        for name, text in _BENCH_AND_SIM:
            sub.add_parser(name, help=text)

    _configure_status(sub.add_parser(
        "status",
        help="print the proxy's state (workers, CPU, tools, sessions) as a table",
        description="Fetch GET URL/mars/v1/state and print it; --watch refreshes it.",
        formatter_class=_FMT,
    ))
    return p


_BENCH_AND_SIM = (
    ("bench", "benchmarks"),
    ("sim", "simulate the policies in virtual time (admission core, engine model, tool CPUs)"),
)


def _add_bench_and_sim(sub: Any) -> None:
    from marsproxy.bench.live import configure_parser as _configure_live
    from marsproxy.sim.runner import configure_parser as _configure_sim

    b = sub.add_parser(
        "bench", help=_BENCH_AND_SIM[0][1], description="Benchmarks.", formatter_class=_FMT,
    )
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    _configure_live(bsub.add_parser(
        "live",
        help="replay agent sessions through each policy against emulated workers or a vLLM",
        description="Start workers and one marsproxy per policy, replay agent sessions with real"
        " tool CPU work, write results/<timestamp>/ (results.json, report.md, plots).",
        formatter_class=_FMT,
    ))
    _configure_sim(sub.add_parser(
        "sim",
        help=_BENCH_AND_SIM[1][1],
        description="Discrete-event simulation of every policy on every workload; writes the"
        " same report as `bench live`.",
        formatter_class=_FMT,
    ))


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    full = any(w in (name for name, _ in _BENCH_AND_SIM) for w in words)
    args = build_parser(bench_and_sim=full).parse_args(argv)
    try:
        rc: int = args.func(args)
    except ConfigError as exc:
        sys.stderr.write(f"marsproxy: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return rc

