"""CPU probe: file-format parsers on strings, source selection on fake directories."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from marsproxy.probes.config import CpuProbeConfig
from marsproxy.probes.cpu import (
    SOURCE_CGROUP_MAX,
    SOURCE_CGROUP_PSI,
    SOURCE_CGROUP_STAT,
    SOURCE_HOST_PSI,
    SOURCE_PSUTIL,
    CpuProbe,
    CpuStat,
    PsiLine,
    parse_cpu_max,
    parse_cpu_stat,
    parse_psi,
)

PSI = (
    "some avg10=4.17 avg60=2.79 avg300=1.45 total=10854113\n"
    "full avg10=0.50 avg60=0.10 avg300=0.00 total=12345\n"
)
CPU_STAT = (
    "usage_usec 8327162\nuser_usec 6030000\nsystem_usec 2297162\n"
    "nr_periods 1200\nnr_throttled 37\nthrottled_usec 918273\n"
    "nr_bursts 0\nburst_usec 0\n"
)


def test_parse_psi() -> None:
    psi = parse_psi(PSI)
    assert psi.some == PsiLine(avg10=4.17, avg60=2.79, avg300=1.45, total_us=10854113)
    assert psi.full is not None and psi.full.total_us == 12345


def test_parse_psi_some_only_and_garbage() -> None:
    psi = parse_psi("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert psi.some is not None and psi.full is None
    bad = parse_psi("some avg10=x avg60=1 avg300=1 total=1\nfull broken\nnonsense\n")
    assert bad.some is None and bad.full is None
    assert parse_psi("").some is None


def test_parse_cpu_stat() -> None:
    assert parse_cpu_stat(CPU_STAT) == CpuStat(
        usage_usec=8327162, nr_periods=1200, nr_throttled=37, throttled_usec=918273
    )
    # Without the cpu controller the file has usage lines only.
    assert parse_cpu_stat("usage_usec 10\nuser_usec 5\n") == CpuStat(usage_usec=10)
    assert parse_cpu_stat("garbage\nnr_throttled x\n") == CpuStat()


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000\n", None),
        ("max\n", None),
        ("200000 100000\n", 2.0),
        ("50000 100000\n", 0.5),
        ("150000\n", 1.5),  # period omitted: the kernel default 100000
        ("", None),
        ("abc 100000", None),
        ("0 100000", None),
    ],
)
def test_parse_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


def fake_cgroup(
    tmp_path: Path, *, pressure: bool = True, stat: bool = True, cpumax: str = ""
) -> Path:
    cg = tmp_path / "tools.slice"
    cg.mkdir()
    if pressure:
        (cg / "cpu.pressure").write_text(PSI)
    if stat:
        (cg / "cpu.stat").write_text(CPU_STAT)
    if cpumax:
        (cg / "cpu.max").write_text(cpumax)
    return cg


def test_cgroup_sources_and_quota_as_tool_cpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cg = fake_cgroup(tmp_path, cpumax="300000 100000\n")
    with caplog.at_level(logging.INFO, logger="marsproxy.probes.cpu"):
        probe = CpuProbe(
            str(cg), host_psi_path=str(tmp_path / "absent"), clock=lambda: 7.0, cpu_count=lambda: 64
        )
    assert probe.sources == (SOURCE_CGROUP_PSI, SOURCE_CGROUP_STAT, SOURCE_CGROUP_MAX)
    assert probe.tool_cpus == 3.0
    assert len(caplog.records) == 1
    assert "cgroup:cpu.pressure" in caplog.records[0].getMessage()
    r = probe.read()
    assert r.sampled_at == 7.0 and r.source == SOURCE_CGROUP_PSI
    assert (r.psi_some_avg10, r.psi_some_avg60, r.psi_some_total_us) == (4.17, 2.79, 10854113)
    assert r.psi_full_avg10 == 0.5
    assert (r.nr_throttled, r.throttled_usec, r.quota_cpus) == (37, 918273, 3.0)
    assert r.cpu_percent is None and r.tool_cpus == 3.0


def test_config_tool_cpus_wins_and_unlimited_quota_falls_to_cpu_count(tmp_path: Path) -> None:
    cg = fake_cgroup(tmp_path, cpumax="max 100000\n")
    assert CpuProbe(str(cg), tool_cpus=6, cpu_count=lambda: 64).tool_cpus == 6
    assert CpuProbe(str(cg), cpu_count=lambda: 64).tool_cpus == 64


def test_cgroup_without_pressure_falls_back_to_host_psi(tmp_path: Path) -> None:
    cg = fake_cgroup(tmp_path, pressure=False)
    host = tmp_path / "host-psi"
    host.write_text("some avg10=9.00 avg60=8.00 avg300=7.00 total=99\n")
    probe = CpuProbe(str(cg), host_psi_path=str(host), cpu_count=lambda: 4)
    assert probe.sources == (SOURCE_CGROUP_STAT, SOURCE_HOST_PSI)
    r = probe.read()
    assert (r.source, r.psi_some_avg10, r.nr_throttled) == (SOURCE_HOST_PSI, 9.0, 37)


def test_no_psi_at_all_uses_psutil(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    readings = iter([0.0, 42.5])
    with caplog.at_level(logging.INFO, logger="marsproxy.probes.cpu"):
        probe = CpuProbe(
            host_psi_path=str(tmp_path / "absent"),
            cpu_percent=lambda: next(readings),
            cpu_count=lambda: 2,
        )
    assert probe.sources == (SOURCE_PSUTIL,)
    assert "no PSI" in caplog.records[0].getMessage()
    r = probe.read()
    # The priming call at start is discarded; the read gets the second value.
    assert (r.source, r.cpu_percent, r.psi_some_avg10, r.tool_cpus) == (
        SOURCE_PSUTIL,
        42.5,
        None,
        2,
    )


def test_vanished_cgroup_reads_none_not_raise(tmp_path: Path) -> None:
    cg = fake_cgroup(tmp_path, cpumax="100000 100000")
    probe = CpuProbe(str(cg), cpu_count=lambda: 2)
    for f in cg.iterdir():
        f.unlink()
    cg.rmdir()
    r = probe.read()
    assert r.psi_some_avg10 is None and r.nr_throttled is None and r.quota_cpus is None


def test_from_config_defaults_to_host() -> None:
    probe = CpuProbe.from_config(CpuProbeConfig())
    assert probe.sources[0] in (SOURCE_HOST_PSI, SOURCE_PSUTIL)
    assert probe.tool_cpus >= 1
    probe.read()
