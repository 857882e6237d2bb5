"""A managed-service-shaped Redis: TLS only, client certificates required, an ACL user and the
default user off (certificates made in the test with the openssl CLI).

Documented outcome (docs/reliability.md): with the right user, password and CA the proxy
shares admission through it; a wrong password or an untrusted certificate is a setup mistake
that no retry heals, so ``marsproxy serve`` refuses to start (exit status 2) with one line
naming the problem and the keys to check: no traceback, no hang.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from marsproxy.bench.procs import CLI, free_port
from marsproxy.gateway.shells.sessions import unscoped_id
from tests.faults.conftest import Lab, call, until
from tests.faults.redis_topology import Certs, Node, make_certs, tls_server

pytestmark = pytest.mark.timeout(90)

USER, PASSWORD = "marsproxy", "tls-acl-secret"


def _store(certs: Certs, port: int, pw_file: Path, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "backend": "redis", "redis_url": f"rediss://127.0.0.1:{port}/0", "pool": "tls",
        "username": USER, "password_file": str(pw_file), "op_timeout_s": 2.0,
        "tls": {"ca_file": str(certs.ca), "cert_file": str(certs.client_cert),
                "key_file": str(certs.client_key)},
    }
    return {**cfg, **over}


def _admin(certs: Certs, port: int) -> redis.Redis:
    return redis.Redis(port=port, username=USER, password=PASSWORD, ssl=True,
                       ssl_ca_certs=str(certs.ca), ssl_certfile=str(certs.client_cert),
                       ssl_keyfile=str(certs.client_key), decode_responses=True,
                       socket_timeout=5)


def _leases(certs: Certs, port: int) -> set[str]:
    r = _admin(certs, port)
    try:
        return {unscoped_id(s) for s in r.zrange("mars:{tls}:adm:w0", 0, -1)}
    finally:
        r.close()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Any:
    certs = make_certs(tmp_path / "certs")
    node: Node = tls_server(tmp_path, certs, USER, PASSWORD)
    pw = tmp_path / "redis-password"
    pw.write_text(PASSWORD + "\n")  # as a mounted secret often is
    try:
        yield certs, node, pw
    finally:
        node.kill()


async def test_proxy_shares_admission_over_tls_as_an_acl_user(lab: Lab, tls_redis: Any) -> None:
    certs, node, pw = tls_redis
    w = lab.emulator("w0")
    p = lab.proxy(lab.config({"w0": w}, {"store": _store(certs, node.port, pw)}))
    assert (await call(p.http, p.url, "s1")).status == 200
    assert (await p.state())["admission"]["store"]["up"]
    await until(lambda: asyncio.to_thread(_leases, certs, node.port), lambda got: got == {"s1"},
                "s1's lease in the TLS Redis", 5)
    r = _admin(certs, node.port)
    try:  # the proxy's connections are logged in as the ACL user
        clients = r.client_list()
    finally:
        r.close()
    names = {c["name"]: c["user"] for c in clients if c["name"].startswith("marsproxy:")}
    assert names and set(names.values()) == {USER}, clients
    assert (await call(p.http, p.url, "s1", final=True)).status == 200
    await until(lambda: asyncio.to_thread(_leases, certs, node.port), lambda got: got == set(),
                "lease released", 5)


def _serve(lab: Lab, store: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    cfg = lab.config({}, {"store": store})
    cfg.write_text(cfg.read_text().replace("workers: []", "workers: ['http://127.0.0.1:9']"))
    return subprocess.run([*CLI, "serve", "--config", str(cfg), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mistake", ["password", "user", "ca"])
async def test_wrong_credentials_or_ca_refuse_the_start_with_a_clear_message(
    lab: Lab, tls_redis: Any, mistake: str
) -> None:
    certs, node, pw = tls_redis
    if mistake == "password":
        bad = lab.tmp / "bad-password"
        bad.write_text("not-the-password")
        store = _store(certs, node.port, bad)
        expect = ["refused the credentials", "store.username and store.password_env/_file"]
    elif mistake == "user":
        store = _store(certs, node.port, pw, username="nobody")
        expect = ["refused the credentials", "store.username"]
    else:
        store = _store(certs, node.port, pw, tls={"ca_file": str(certs.other_ca)})
        expect = ["TLS certificate of Redis at 127.0.0.1", "not trusted", "store.tls.ca_file"]
    done = await asyncio.to_thread(_serve, lab, store)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "Unclosed" not in done.stderr, done.stderr[-3000:]  # what started is closed
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("marsproxy: store: ")]
    assert len(said) == 1, done.stderr[-3000:]
    for text in expect:
        assert text in said[0], said
    assert PASSWORD not in done.stderr and "not-the-password" not in done.stderr
