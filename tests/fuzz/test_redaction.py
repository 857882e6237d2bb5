"""No secrets in logs: a real ``marsproxy serve`` at debug level, with the access log on, is sent
credentials in every place a client can put them — on good requests, refused ones, malformed
ones and ones the parser rejects — and its whole log output must not contain any of them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from marsproxy.bench.procs import CLI, free_port, wait_up
from marsproxy.redact import MASK, RedactingFilter, redact

ADMIN = "adm1n-S3cret-T0ken-zz"
SECRETS = {
    "bearer": "sk-proj-BearerSecret0001",
    "x-api-key": "sk-ant-api03-XApiKeySecret0002",
    "query": "QuerySecret0003",
    "long-line": "sk-LongLineSecret0004",
    "malformed": "sk-MalformedSecret0005",
    "wrong-admin": "WrongAdminSecret0006",
    "basic": "QmFzaWNTZWNyZXQwMDA3",
    "body-error": "sk-BodyErrorSecret0008",
}


class Proxy:
    def __init__(self, url: str, proxy: subprocess.Popen[bytes], log_path: str) -> None:
        self.url, self._proc, self._log = url, proxy, log_path

    def stop(self) -> list[str]:
        """SIGTERM, wait, and the whole log it wrote."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            self._proc.wait(20)
        with open(self._log, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()


@pytest.fixture
def proxy_log(tmp_path: os.PathLike[str]) -> Iterator[Proxy]:
    wport, pport = free_port(), free_port()
    worker = subprocess.Popen(
        [*CLI, "emulate", "--profile", "tiny", "--port", str(wport), "--time-scale", "0.01"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    log_path = os.path.join(tmp_path, "proxy.log")
    env = {
        **os.environ,
        "MARSPROXY_SERVER__LOG_LEVEL": "debug",
        "MARSPROXY_SERVER__ACCESS_LOG": "true",
        "MARSPROXY_AUTH__ADMIN_TOKEN": ADMIN,
        "MARSPROXY_ADMISSION__ENABLED": "false",
        "MARSPROXY_PROBES__NVML__ENABLED": "false",
    }
    with open(log_path, "wb") as log_file:
        proxy = subprocess.Popen(
            [*CLI, "serve", "--port", str(pport), "--worker", f"http://127.0.0.1:{wport}"],
            stdout=log_file, stderr=subprocess.STDOUT, env=env,
        )
        handle = Proxy(f"http://127.0.0.1:{pport}", proxy, log_path)
        try:
            wait_up(f"http://127.0.0.1:{wport}/health", worker)
            wait_up(f"http://127.0.0.1:{pport}/readyz", proxy)
            yield handle
        finally:
            handle.stop()
            worker.kill()
            worker.wait(10)


def _raw(url: str, data: bytes) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        try:
            while s.recv(65536):
                pass
        except (TimeoutError, ConnectionResetError):
            pass


def test_no_credential_reaches_the_log(proxy_log: Proxy) -> None:
    url = proxy_log.url
    chat = {"model": "tiny-emulated", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=10) as http:
        # Served requests, with the key in each place a client puts it.
        assert http.post("/v1/chat/completions", json=chat,
                         headers={"Authorization": f"Bearer {SECRETS['bearer']}"}).is_success
        assert http.post("/v1/chat/completions", json=chat,
                         headers={"x-api-key": SECRETS["x-api-key"]}).is_success
        http.get(f"/v1/models?api_key={SECRETS['query']}&key={SECRETS['query']}")
        # Error paths: bad body, unknown session, bad admin token, Basic credentials.
        r = http.post("/v1/chat/completions", content=b"{not json",
                      headers={"Authorization": f"Bearer {SECRETS['body-error']}"})
        assert r.status_code == 400
        r = http.delete("/mars/v1/sessions/nope",
                        headers={"Authorization": f"Bearer {SECRETS['body-error']}"})
        assert r.status_code == 404
        assert http.get("/mars/v1/state", headers={
            "Authorization": f"Bearer {SECRETS['wrong-admin']}"}).status_code == 401
        assert http.get("/mars/v1/state", headers={
            "Authorization": f"Basic {SECRETS['basic']}"}).status_code == 401
        assert http.get("/mars/v1/state",
                        headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    # Parser errors: a head line over the cap that starts with the credential, and garbage.
    _raw(url, b"GET / HTTP/1.1\r\nAuthorization: Bearer " + SECRETS["long-line"].encode()
         + b"x" * 40_000 + b"\r\n\r\n")
    _raw(url, b"GET / HTTP/1.1\r\nAuthorization: Bearer " + SECRETS["malformed"].encode()
         + b"\r\nBad Header\x00: 1\r\n\r\n")
    _raw(url, b"GET /?token=" + SECRETS["query"].encode() + b" HTTP/1.1\r\nX: \x01\r\n\r\n")

    lines = proxy_log.stop()
    text = "\n".join(lines)
    assert "marsproxy.access" in text, text[-3000:]  # the access log was on
    assert "431 header_too_large" in text and "401 invalid_admin_token" in text
    for what, secret in {**SECRETS, "admin": ADMIN}.items():
        assert secret not in text, f"{what} credential leaked:\n" + "\n".join(
            ln for ln in lines if secret in ln
        )


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer sk-abcdef123456",
        "{'authorization': 'Basic dXNlcjpwYXNz'}",
        "GET /v1/x?api_key=abcdef&other=1",
        "headers=<CIMultiDict('X-Api-Key': 'sk-ant-abcdefgh')>",
        "b'Bearer sk-proj-abc123456789...'",
        "token in a json: {\"access_token\": \"abc.def.ghi\"}",
    ],
)
def test_redact_masks_credentials(text: str) -> None:
    out = redact(text)
    assert MASK in out
    for secret in ("sk-abcdef123456", "dXNlcjpwYXNz", "abcdef&", "abcdefgh", "abc123456789",
                   "abc.def.ghi"):
        assert secret not in out


def test_filter_masks_arguments_and_tracebacks() -> None:
    import logging

    rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "got %s", ("Bearer hunter22",), None)
    try:
        raise ValueError("Authorization: Bearer hunter22")
    except ValueError:
        import sys

        rec.exc_info = sys.exc_info()
    RedactingFilter(["hunter22"]).filter(rec)
    formatted = logging.Formatter().format(rec)
    assert "hunter22" not in formatted and MASK in formatted
