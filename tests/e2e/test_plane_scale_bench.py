"""benchmarks/plane_scale.py on tiny counts, so the script cannot rot (no timing asserts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plane_scale_prints_a_row_per_count() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plane_scale.py"), "--open", "0,50",
         "--sessions", "30"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "50"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)
