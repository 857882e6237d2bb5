"""Fixtures of the browser tests: Debian's headless Chromium through chromedriver (selenium),
and a real stack (``marsproxy emulate`` workers behind ``marsproxy serve``, subprocesses).

Screenshots go to the test's tmp dir, and also to ``$MARS_UI_SCREENSHOTS`` when it is set
(``MARS_UI_SCREENSHOTS=docs/img`` refreshes the one the docs show).
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from marsproxy.bench.procs import RedisServer, Service

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@dataclass
class Stack:
    """Two emulated workers and one proxy; ``restart()`` stops and starts the proxy on its
    port (what a rolling restart looks like to the page)."""

    proxy: Service
    workers: list[Service]
    log_dir: Path
    token: str = ""
    redis: RedisServer | None = None
    models: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.proxy.url

    def restart(self) -> None:
        self.proxy.stop()
        self.proxy.start()

    def chat(self, session: str, timeout_s: float = 60.0, max_tokens: int = 4) -> int:
        if not self.models:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as r:
                self.models.append(json.load(r)["data"][0]["id"])
        body = json.dumps({
            "model": self.models[0], "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"hello from {session}"}],
        }).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/chat/completions", data=body, method="POST",
            headers={"Content-Type": "application/json", "x-session-id": session},
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return int(r.status)

    def end(self, session: str) -> None:
        req = urllib.request.Request(f"{self.url}/mars/v1/sessions/{session}", method="DELETE")
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def state(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        req = urllib.request.Request(f"{self.url}/mars/v1/state", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)  # type: ignore[no-any-return]

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.log_dir.glob("*.log"))


def start_stack(tmp: Path, config: str, *, profile: str = "tiny", token: str = "",
                redis: bool = False) -> Stack:
    tmp.mkdir(parents=True, exist_ok=True)
    workers = [Service.emulator(tmp, f"w{i}", profile=profile, time_scale=0.05)
               for i in range(2)]
    server: RedisServer | None = None
    try:
        for w in workers:
            w.start()
        text = "workers:\n" + "".join(
            f"  - {{url: '{w.url}', name: w{i}}}\n" for i, w in enumerate(workers))
        text += ("health: {interval_s: 0.2}\n"
                 "probes: {vllm: {period_s: 0.2}, nvml: {enabled: false}}\n"
                 "server: {access_log: true}\n" + config)
        if token:
            text += f"auth: {{admin_token: '{token}'}}\n"
        if redis:
            server = RedisServer(tmp)
            server.start()
            text += f"store: {{backend: redis, redis_url: '{server.url}', pool: ui}}\n"
        cfg = tmp / "marsproxy.yaml"
        cfg.write_text(text)
        proxy = Service.proxy(tmp, "proxy", cfg).start(timeout_s=60)
    except BaseException:
        for w in workers:
            w.stop()
        if server is not None:
            server.kill()
        raise
    return Stack(proxy, workers, tmp, token, server)


def stop_stack(s: Stack) -> None:
    s.proxy.stop()
    for w in s.workers:
        w.stop()
    if s.redis is not None:
        s.redis.kill()


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1500", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=DriverService(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshot(browser: Any, tmp_path: Path) -> Any:
    def take(name: str) -> Path:
        out = tmp_path / "screenshots" / f"{name}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(out))
        extra = os.environ.get("MARS_UI_SCREENSHOTS")
        if extra:
            Path(extra).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, Path(extra) / f"{name}.png")
        return out

    return take
