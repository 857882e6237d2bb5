"""deploy/compose/docker-compose.sentinel.yaml: Redis under Sentinel laid over the compose
stacks. Without a Docker engine: its shape, marsproxy's config as the overlay's environment
makes it (load_config), the sentinel config it writes (run by a real redis-sentinel), the
compose-spec schema, and `docker-compose config` of the merged files when installed."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from marsproxy.config import load_config

OVERLAY = "deploy/compose/docker-compose.sentinel.yaml"
SENTINELS = ["sentinel-1", "sentinel-2", "sentinel-3"]


def _doc(repo: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((repo / OVERLAY).read_text())
    return doc


def _sentinel_conf(svc: dict[str, Any], name: str) -> str:
    script = svc["command"][0]
    m = re.search(r"<<EOF\n(.*?)\nEOF", script, re.S)
    assert m, script
    conf = m.group(1).replace("$$SENTINEL_NAME", name)  # compose turns $$ into $
    return conf.replace("$SENTINEL_NAME", name)


def test_overlay_shape_and_marsproxy_config(repo: Path) -> None:
    svc = _doc(repo)["services"]
    assert {"redis", "redis-replica", "marsproxy", *SENTINELS} <= set(svc)
    rep = svc["redis-replica"]["command"]
    assert rep[rep.index("--replicaof") + 1:][:2] == ["redis", "6379"]
    for name in ("redis", "redis-replica"):  # names that resolve after a failover too
        cmd = svc[name]["command"]
        assert cmd[cmd.index("--replica-announce-ip") + 1] == name
    quorum = set()
    for name in SENTINELS:
        conf = _sentinel_conf(svc[name], svc[name]["environment"]["SENTINEL_NAME"])
        m = re.search(r"sentinel monitor (\S+) (\S+) (\d+) (\d+)", conf)
        assert m and m.group(1, 2, 3) == ("mymaster", "redis", "6379"), conf
        quorum.add(int(m.group(4)))
        assert f"announce-ip {name}" in conf
    assert quorum == {2}  # a majority of the three
    for dep in SENTINELS:
        assert svc["marsproxy"]["depends_on"][dep]["condition"] == "service_healthy"
    env = {k: str(v) for k, v in svc["marsproxy"]["environment"].items()}
    cfg = load_config(repo / "deploy/compose/marsproxy.yaml", environ=env)
    assert cfg.store.sentinels == tuple(f"{s}:26379" for s in SENTINELS)
    assert cfg.store.sentinel_service == "mymaster" and cfg.store.backend == "redis"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sentinel_config_runs_in_a_real_sentinel(repo: Path, tmp_path: Path) -> None:
    if shutil.which("redis-sentinel") is None:
        pytest.skip("redis-sentinel is not installed (.ci/run installs it)")
    svc = _doc(repo)["services"]["sentinel-1"]
    port = _free_port()
    # Only the addresses change: loopback names for the compose network's.
    conf = _sentinel_conf(svc, "localhost").replace("port 26379", f"port {port}")
    conf = conf.replace("mymaster redis 6379", f"mymaster localhost {_free_port()}")
    path = tmp_path / "sentinel.conf"
    path.write_text(conf + f"\nbind 127.0.0.1\ndir {tmp_path}\n")
    log = (tmp_path / "sentinel.log").open("wb")
    proc = subprocess.Popen(["redis-sentinel", str(path)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                master = redis.Redis(port=port, decode_responses=True,
                                     socket_timeout=1).sentinel_master("mymaster")
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (tmp_path / "sentinel.log").read_text()
                assert time.monotonic() < deadline, "redis-sentinel did not answer"
                time.sleep(0.1)
        assert int(master["quorum"]) == 2 and int(master["down-after-milliseconds"]) == 2000
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_overlay_compose_spec_schema(repo: Path) -> None:
    cj = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    if cj is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    out = subprocess.run([cj, "--builtin-schema", "vendor.compose-spec", str(repo / OVERLAY)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("base", ["docker-compose.yaml", "docker-compose.emulated.yaml"])
def test_overlay_merges_over_each_stack(repo: Path, base: str) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed")
    d = repo / "deploy/compose"
    out = subprocess.run([exe, "-f", str(d / base), "-f", str(d / OVERLAY.split("/")[-1]),
                          "config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    merged = yaml.safe_load(out.stdout)["services"]
    mp = merged["marsproxy"]
    assert {"vllm", "redis", *SENTINELS} <= set(mp["depends_on"])
    assert "MARSPROXY_STORE__SENTINELS" in mp["environment"]
    assert "MARSPROXY_CONFIG" in mp["environment"]  # the base stack's environment stays
