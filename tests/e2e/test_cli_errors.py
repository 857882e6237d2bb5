"""What a new user meets: the ``marsproxy`` command, run as a real process, on bad input and on
ports and servers that are not what it expects. Each case ends in a message that says what was
wrong and where, with a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from marsproxy.bench.procs import CLI

TIMEOUT_S = 60  # every case fails at start; the bound only keeps a regression from hanging


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False, stdin=subprocess.DEVNULL)


def _refused(*argv: str) -> str:
    """The command's stderr, which must be a message (exit 2, no traceback)."""
    r = _run(*argv)
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    return r.stderr


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port bound but not listening: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@pytest.fixture
def not_http() -> Iterator[str]:
    """A TCP server that answers like Redis, not HTTP."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def answer() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"-ERR unknown command\r\n")

    threading.Thread(target=answer, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def test_serve_on_a_taken_port_names_the_port(taken_port: int) -> None:
    # Before: an OSError traceback out of the site's start, then 'Unclosed client session'.
    err = _refused("serve", "--worker", "http://127.0.0.1:9", "--port", str(taken_port))
    assert f"cannot listen on 127.0.0.1:{taken_port}" in err and "server.port" in err
    assert "address already in use" in err.lower()


def test_serve_with_a_jsonl_path_it_cannot_write_names_the_key(tmp_path: Path) -> None:
    # Before: it served, dropped every event, and ended in an IsADirectoryError traceback.
    r = subprocess.run(
        [*CLI, "serve", "--worker", "http://127.0.0.1:9", "--port", "0"], capture_output=True,
        text=True, timeout=TIMEOUT_S, check=False, stdin=subprocess.DEVNULL,
        env={**os.environ, "MARSPROXY_TELEMETRY__JSONL_PATH": str(tmp_path)},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"telemetry.jsonl_path: cannot append to {tmp_path}: Is a directory" in r.stderr


def test_emulate_on_a_taken_port_names_the_port(taken_port: int) -> None:
    # Before: an OSError traceback.
    err = _refused("emulate", "--port", str(taken_port))
    assert f"marsproxy emulate: cannot listen on 127.0.0.1:{taken_port}" in err
    assert "--port" in err and "address already in use" in err.lower()


def test_emulate_with_a_taken_kv_events_endpoint_names_it(taken_port: int) -> None:
    # Before: a ZMQError traceback out of the app's startup.
    kv = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{taken_port}"})
    err = _refused("emulate", "--port", "0", "--kv-events-config", kv)
    assert f"--kv-events-config: cannot bind endpoint 'tcp://*:{taken_port}'" in err
    assert "address already in use" in err.lower()


def test_demo_on_a_taken_port_names_the_port(taken_port: int) -> None:
    # Before: an OSError traceback, after both emulated workers had started.
    err = _refused("demo", "--port", str(taken_port), "--sessions", "1", "--no-compare")
    assert f"--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}" in err


def test_status_against_a_server_that_is_not_http(not_http: str) -> None:
    # Before: an http.client.BadStatusLine traceback.
    r = _run("status", "--url", not_http)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"marsproxy status: {not_http} did not answer HTTP"), r.stderr


def test_status_with_a_port_that_is_not_a_number() -> None:
    # Before: an http.client.InvalidURL traceback.
    r = _run("status", "--url", "http://127.0.0.1:abc")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("marsproxy status: bad URL 'http://127.0.0.1:abc'"), r.stderr


def test_config_check_of_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    # Before: a UnicodeDecodeError traceback.
    p = tmp_path / "c.yaml"
    p.write_bytes(b"server:\n  host: \xff\xfe\n")
    err = _refused("config", "check", str(p))
    assert err == f"marsproxy: config file {p}: not UTF-8 text (byte 16: invalid start byte)\n"


@pytest.mark.parametrize("command", ["sim", "bench"])
@pytest.mark.parametrize(("item", "message"), [
    ("admission.window_max=[1", "--set 'admission.window_max=[1': the value is not YAML"),
    ("admission.queue_deadline_s.x=1",
     "--set 'admission.queue_deadline_s.x=1': admission.queue_deadline_s is a value, not a"
     " section"),
    ("admission..window_max=3", "--set 'admission..window_max=3': an empty key"),
])
def test_a_bad_set_is_refused_before_the_run(command: str, item: str, message: str) -> None:
    # Before: a yaml.YAMLError or TypeError traceback (the empty key: 'admission.: unknown key').
    argv = ["sim"] if command == "sim" else ["bench", "live"]
    assert message in _refused(*argv, "--sessions", "1", "--set", item)


def test_bench_live_with_a_vllm_url_without_scheme() -> None:
    # Before: "cannot measure 127.0.0.1:8000: NonHttpUrlClientError(URL('127.0.0.1:8000/v1/
    # models'))", exit 1.
    err = _refused("bench", "live", "--vllm-url", "127.0.0.1:8000", "--policies", "mars")
    assert err == "marsproxy bench live: --vllm-url '127.0.0.1:8000': give it as http://HOST:PORT\n"


def test_bench_live_with_nothing_at_the_vllm_url_says_why_in_words(refused_port: int) -> None:
    # Before: the exception's repr, "ClientConnectorError(ConnectionKey(host=..., ...))".
    url = f"http://127.0.0.1:{refused_port}"
    r = _run("bench", "live", "--vllm-url", url, "--policies", "mars")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "ConnectionKey(" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"marsproxy bench live: cannot measure {url}:"
                               " ClientConnectorError: Cannot connect to host"), r.stderr
