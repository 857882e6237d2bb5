"""The layers hold (``lint-imports``, as ``make lint`` runs it), and an import against them breaks
the contract: each case copies the package, adds one import where it must not be, and runs the
real linter on the copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # The copy (or the checkout) comes first on the path, so the linter reads its modules.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_layers_hold() -> None:
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(
    ("module", "imported", "contract"),
    [
        # a pure plane reaching up to a driver
        ("marsproxy/aimd/queue.py", "marsproxy.gateway.http.app", "CLI > bench > drivers"),
        # a pure plane reaching sideways into another
        ("marsproxy/sched/core.py", "marsproxy.aimd.admission", "CLI > bench > drivers"),
        # the vocabulary reaching up
        ("marsproxy/core/kv.py", "marsproxy.sched.core", "CLI > bench > drivers"),
        # a driver reaching up to the CLI
        ("marsproxy/gateway/shells/service.py", "marsproxy.cli", "CLI > bench > drivers"),
        # the simulator depending on the live benchmark
        ("marsproxy/sim/runner.py", "marsproxy.bench.live", "independent"),
        # the gateway depending on the emulator
        ("marsproxy/gateway/http/relay.py", "marsproxy.emulator.engine", "serve sim, bench"),
        # a config section importing a core
        ("marsproxy/sched/config.py", "marsproxy.sched.core", "config sections"),
    ],
)
def test_an_import_against_the_layers_breaks_the_contract(
    tmp_path: Path, module: str, imported: str, contract: str
) -> None:
    shutil.copytree(ROOT / "marsproxy", tmp_path / "marsproxy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\nimport {imported}  # injected\n")
    r = _lint(tmp_path)
    assert r.returncode != 0, r.stdout
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, r.stdout
    assert imported in broken, r.stdout
