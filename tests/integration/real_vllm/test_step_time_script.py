"""``scripts/gpu/step_time.py`` (the H200 profile's calibration) where PyTorch is: the real vLLM's
venv. Its fit recovers known step-time coefficients, and its measuring path runs end to end on
tiny shapes on the CPU (the GPU run itself needs an H200: docs/emulator.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .conftest import HOME

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu" / "step_time.py"
PYTHON = str(HOME / "venv" / "bin" / "python")

FIT_CHECK = """
import json, random, sys
sys.path.insert(0, sys.argv[1])
import step_time as s
random.seed(1)
truth = {"a": 4e-3, "w": 12e-3, "b": 16e-6, "c": 0.0, "d_dec": 30e-9, "d_pf": 1.2e-9}
pts = s.grid(False)
y = [s.predict(truth, p) * (1 + random.uniform(-0.02, 0.02)) for p in pts]
print(json.dumps(dict(zip(s.TERMS, s.nnls([p.features() for p in pts], y)))))
"""


def test_fit_recovers_known_coefficients_without_negative_terms() -> None:
    out = subprocess.run([PYTHON, "-c", FIT_CHECK, str(SCRIPT.parent)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    fit = json.loads(out)
    assert fit["c"] >= 0.0 and fit["c"] < 2e-6  # a term that is absent stays (near) zero
    for term, want in (("a", 4e-3), ("w", 12e-3), ("b", 16e-6), ("d_dec", 30e-9),
                       ("d_pf", 1.2e-9)):
        assert abs(fit[term] - want) <= 0.1 * want, (term, fit[term], want)


def test_tiny_dry_run_writes_every_point_and_a_fit(tmp_path: Path) -> None:
    out = tmp_path / "step_time.json"
    subprocess.run([PYTHON, str(SCRIPT), "--tiny", "--device", "cpu", "--reps", "2",
                    "--out", str(out)], capture_output=True, check=True, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["shapes"]["layers"] == 2
    assert len(doc["points"]) == 7
    assert all(p["measured_s"] > 0 and p["how"] == "eager" for p in doc["points"])
    assert set(doc["fit"]) == {"a", "w", "b", "c", "d_dec", "d_pf"}
    assert all(v >= 0 for v in doc["fit"].values())
