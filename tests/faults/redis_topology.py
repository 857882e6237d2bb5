"""Production-shaped Redis for the fault tests: a primary, a replica and three sentinels on
loopback, or a TLS server with an ACL user and certificates made here with the openssl CLI.

Every process has its own free port and a directory under the test's tmp_path; ``close()``
kills them all (SIGKILL: nothing is persisted anyway).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from marsproxy.bench.procs import free_port

SERVICE = "mymaster"
DOWN_AFTER_MS = 1000  # sentinels call the primary down after this much silence


def need(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (.ci/run installs them)")


@dataclass
class Node:
    """One redis-server or redis-sentinel process."""

    port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> Node:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.args[0]} did not listen on {self.port}: {self.tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: reads nothing (replication included) until resumed."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])


def _server_args(port: int, workdir: Path, *extra: str) -> list[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), *extra]


@dataclass
class SentinelSet:
    """Primary, replica and three sentinels (quorum 2) watching them as ``SERVICE``."""

    tmp: Path
    primary: Node = field(init=False)
    replica: Node = field(init=False)
    sentinels: list[Node] = field(default_factory=list)

    def start(self) -> SentinelSet:
        need("redis-server", "redis-sentinel")
        p, r = free_port(), free_port()
        self.primary = Node(p, _server_args(p, self.tmp / "primary"),
                            self.tmp / "primary.log").start()
        self.replica = Node(r, _server_args(r, self.tmp / "replica", "--replicaof", "127.0.0.1",
                                            str(p)), self.tmp / "replica.log").start()
        for i in range(3):
            port = free_port()
            conf = self.tmp / f"sentinel-{i}.conf"  # sentinels rewrite their config: own file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.tmp}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {p} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels.append(Node(port, ["redis-sentinel", str(conf)],
                                       self.tmp / f"sentinel-{i}.log").start())
        self._wait_discovered(30.0)
        return self

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def _sentinel(self, node: Node) -> redis.Redis:
        return redis.Redis(port=node.port, decode_responses=True, socket_timeout=2)

    def _wait_discovered(self, timeout_s: float) -> None:
        # A failover needs the replica known and the quorum of sentinels aware of each other.
        deadline = time.monotonic() + timeout_s
        state: dict[str, object] = {}
        while time.monotonic() < deadline:
            ready = True
            for node in self.sentinels:
                c = self._sentinel(node)
                try:
                    state = c.sentinel_master(SERVICE)
                finally:
                    c.close()
                if int(state.get("num-slaves", 0)) < 1 or \
                        int(state.get("num-other-sentinels", 0)) < 2:
                    ready = False
            if ready:
                return
            time.sleep(0.2)
        raise AssertionError(f"sentinels not ready in {timeout_s} s: {state}")

    def master_port(self) -> int | None:
        """The port the sentinels name as the primary now (first sentinel that answers)."""
        for node in self.sentinels:
            c = self._sentinel(node)
            try:
                host_port = c.sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            finally:
                c.close()
            if host_port:
                return int(host_port[1])
        return None

    def close(self) -> None:
        for n in [*self.sentinels, self.replica, self.primary]:
            n.kill()


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: "wrong CA"


def make_certs(d: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and an
    unrelated CA, all made with the openssl CLI."""
    need("openssl")
    d.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    for ca in ("ca", "other-ca"):
        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            f"/CN=marsproxy test {ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem")
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
                 d / "client.key", d / "other-ca.pem")


def tls_server(tmp: Path, certs: Certs, user: str, password: str) -> Node:
    """A TLS-only redis-server that requires client certificates, where ``user`` (with
    ``password``) may do everything and the default user is off."""
    need("redis-server")
    port = free_port()
    args = _server_args(
        port, tmp / "tls", "--port", "0", "--tls-port", str(port),
        "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
        "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes",
        # One argument per word: redis-server quotes an argument that contains spaces.
        "--user", "default", "off", "--user", user, "on", f">{password}", "~*", "&*", "+@all",
    )
    # The first --port is overridden by the later "--port 0": TLS only.
    return Node(port, args, tmp / "tls.log").start()
