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


def test_serve_without_workers_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert "no workers configured" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "--help"],
        capture_output=True, text=True, check=False,
    )
    assert r.returncode == 0 and "emulate" in r.stdout
