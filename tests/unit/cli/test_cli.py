"""The command line: help shows every option with its default; config check; errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from marsproxy.cli import main


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_command_has_help_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert "serve" in _help([], capsys) and "emulate" in _help([], capsys)
    serve = _help(["serve"], capsys)
    assert "--worker URL" in serve and "(default: server.port)" in serve
    emulate = _help(["emulate"], capsys)
    for shown in ("(default: tiny)", "(default: 8000)", "(default: 1.0)",
                  "(default: fcfs)", "--num-blocks", "--served-model-name"):
        assert shown in emulate
    demo = _help(["demo"], capsys)
    assert "--sessions SESSIONS" in demo and "(default: 24)" in demo
    assert "--replicas {1,2,3}" in demo and "--no-compare" in demo
    assert "FILE" in _help(["config", "check"], capsys)


def test_config_check_prints_effective_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  port: 9555\nworkers: [http://w:1]\n")
    assert main(["config", "check", str(p)]) == 0
    out = capsys.readouterr().out
    assert "port: 9555" in out and "url: http://w:1" in out and "idle_timeout_s: 120.0" in out


def test_config_check_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("sessions:\n  max_sesions: 3\n")
    assert main(["config", "check", str(p)]) == 2
    err = capsys.readouterr().err
    assert "sessions.max_sesions" in err and "unknown key" in err


@pytest.mark.parametrize(("yaml_text", "key"), [
    ("sessions:\n  idle_ttl_s: .inf\n", "sessions.idle_ttl_s"),
    ("upstream:\n  idle_timeout_s: .nan\n", "upstream.idle_timeout_s"),
    ("admission:\n  tenant_weights: {t1: .inf}\n", "admission.tenant_weights.t1"),
])
def test_config_check_refuses_a_number_that_is_not_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str, key: str
) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("workers: [http://w:1]\n" + yaml_text)
    assert main(["config", "check", str(p)]) == 2
    err = capsys.readouterr().err
    assert key in err and "finite number" in err


def test_serve_without_workers_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert "no workers configured" in capsys.readouterr().err


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(("flags", "message"), [
    (["--time-scale", "0"], "--time-scale must be a finite number > 0, got 0.0"),
    (["--time-scale", "nan"], "--time-scale must be a finite number > 0, got nan"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1, got 0"),
    (["--max-num-seqs", "-1"], "--max-num-seqs must be >= 1, got -1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--port", "70000"], "--port must be in 0-65535, got 70000"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*"}'],
     "--kv-events-config: endpoint 'tcp://*' is not a ZMQ address such as tcp://*:5557"),
])
def test_emulate_refuses_bad_flags_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a ValueError, OverflowError or ZMQError traceback out of the server's start.
    assert message in _refused(["emulate", *flags], capsys)


@pytest.mark.parametrize(("flags", "message"), [
    (["--trace", "/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
    (["--time-scale", "0"], "--time-scale must be a finite number > 0, got 0.0"),
    (["--sessions", "0"], "--sessions must be >= 1, got 0"),
    (["--max-turns", "0"], "--max-turns must be >= 1, got 0"),
    (["--calm-sessions", "-1"], "--calm-sessions must be >= 0, got -1"),
    (["--token-scale", "0"], "--token-scale must be a finite number > 0, got 0.0"),
    (["--tool-cpus", "-1"], "--tool-cpus must be >= 0, got -1.0"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1, got 0"),
    (["--port", "-1"], "--port must be in 0-65535, got -1"),
])
def test_demo_refuses_bad_flags_before_it_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: tracebacks (a missing trace, time scale 0, --max-turns 0: 'Session is closed'),
    # or a run of nothing that exited 0 (--sessions 0).
    assert message in _refused(["demo", *flags], capsys)


def test_status_refuses_a_malformed_url_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a ValueError traceback (Invalid IPv6 URL) out of building the request.
    assert main(["status", "--url", "http://[::1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("marsproxy status: bad URL 'http://[::1'") and "Traceback" not in err


def test_console_script_is_installed() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "--help"],
        capture_output=True, text=True, check=False,
    )
    assert r.returncode == 0 and "emulate" in r.stdout


def test_other_commands_do_not_load_the_benchmark_and_the_simulator() -> None:
    """Their options import both (0.1 s more on every ``serve``); they are listed all the same."""
    example = str(Path(__file__).parents[3] / "configs" / "marsproxy.yaml")
    loaded = ("import contextlib, sys\nfrom marsproxy.cli import main\n"
              "with contextlib.suppress(SystemExit):\n    main({argv})\n"
              "print('LOADED', [m for m in sys.modules"
              " if m.startswith(('marsproxy.sim', 'marsproxy.bench'))])")
    for argv, loads in ((["config", "check", example], False), (["sim", "--help"], True)):
        r = subprocess.run([sys.executable, "-c", loaded.format(argv=argv)],
                           capture_output=True, text=True, check=False)
        last = r.stdout.splitlines()[-1]
        assert last.startswith("LOADED") and (last != "LOADED []") == loads, (argv, r.stderr)
    r = subprocess.run([sys.executable, "-m", "marsproxy.cli", "--help"],
                       capture_output=True, text=True, check=False)
    assert "bench" in r.stdout and "simulate the policies" in r.stdout
