"""`marsproxy sim --sweep 50`: the admission invariants on 50 seeded random workloads, as CI runs
them (docs/admission.md, "Invariants"). One run of the command serves every test here."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

N = 50


@dataclass(frozen=True)
class Sweep:
    rc: int
    out: str
    counts: dict[str, int]


@pytest.fixture(scope="module")
def swept() -> Sweep:
    r = subprocess.run([sys.executable, "-m", "marsproxy.cli", "sim", "--sweep", str(N),
                        "--seed", "0"], capture_output=True, text=True, timeout=600,
                       check=False)
    m = re.search(r"^violations: (\d+) \(a: (\d+), b: (\d+), c: (\d+), d: (\d+)\)", r.stdout,
                  re.MULTILINE)
    assert m, r.stdout[-3000:] + r.stderr[-3000:]
    total, *by_rule = (int(g) for g in m.groups())
    counts = dict(zip("abcd", by_rule, strict=True))
    assert total == sum(by_rule)
    return Sweep(r.returncode, r.stdout, counts)


@pytest.mark.timeout(660)
def test_the_sweep_covers_its_workloads_and_exits_by_its_findings(swept: Sweep) -> None:
    assert f"workloads: {N}," in swept.out
    waits = re.search(r"control ticks with a session waiting: (\d+)", swept.out)
    # (a) had sessions waiting to check (100 on 6 Dec: freed room admits at a call's end)
    assert waits and int(waits.group(1)) >= 50
    light = re.search(r"light load: (\d+) workloads; worst ratio to direct ([\d.]+)x", swept.out)
    assert light and int(light.group(1)) >= 10
    assert swept.rc == (1 if sum(swept.counts.values()) else 0), swept.out[-3000:]


@pytest.mark.timeout(660)
@pytest.mark.parametrize("rule", ["a", "b", "d"])
def test_no_session_waits_idly_is_lost_or_leaks(swept: Sweep, rule: str) -> None:
    assert swept.counts[rule] == 0, swept.out[-5000:]


@pytest.mark.timeout(660)
def test_light_load_stays_within_three_percent_of_direct(swept: Sweep) -> None:
    assert swept.counts["c"] == 0, swept.out[-5000:]
