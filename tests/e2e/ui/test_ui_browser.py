"""``/mars/ui`` in a real browser (headless Chromium) against a real stack of subprocesses.

What a user checks by looking: every worker is there, an admission shows up within 2 s, the
queue shows who waits and why, the page comes back after the proxy restarts, works behind the
admin token, and stays usable with 1000 sessions. No console errors. The event stream is read
only once the "live events" toggle is on (a reader makes the proxy build every event).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from marsproxy.bench.procs import RedisServer

from .conftest import start_stack, stop_stack

WINDOW_1 = ("admission: {window_init: 1, window_min: 1, window_max: 1,"
            " tuning: {idle_admit: false, control_interval_s: 0.2}}\n")
TOKEN = "ui-test-token-3f9a"


def _css(browser: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(browser.find_elements(By.CSS_SELECTOR, selector))


def _wait(browser: Any, cond: Any, timeout_s: float, what: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page redraws its tables on every poll: an element found a moment ago may be gone.
    wait = WebDriverWait(browser, timeout_s, poll_frequency=0.05,
                         ignored_exceptions=(StaleElementReferenceException,))
    try:
        return wait.until(lambda d: cond(d))
    except Exception as exc:
        raise AssertionError(f"{what}: not within {timeout_s} s") from exc


def _attrs(browser: Any, selector: str, attr: str) -> list[str]:
    """An attribute of every match, read in one script: the page cannot redraw halfway."""
    return list(browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]),"
        " e => String(e.getAttribute(arguments[1])))", selector, attr))


def _texts(browser: Any, selector: str) -> list[str]:
    """The rendered text of every match, read in one script."""
    return list(browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText)",
        selector))


def _text(browser: Any, selector: str) -> str:
    texts = _texts(browser, selector)
    assert texts, f"nothing on the page matches {selector}"
    return texts[0]


def _conn(browser: Any) -> str:
    return str(_css(browser, "#conn")[0].get_attribute("data-state"))


def _wait_live(browser: Any, timeout_s: float = 20.0) -> None:
    # "live" in full: the state answers and, with live events on, the event stream is open.
    _wait(browser, lambda d: _conn(d) == "live" and _text(d, "#conn") == "live",
          timeout_s, "page live")


def _live_events_on(browser: Any, s: Any) -> None:
    """Turn the "live events" toggle on; the proxy then counts the page as a reader."""
    toggle = _css(browser, "#events-live")[0]
    assert not toggle.is_selected()
    toggle.click()
    assert "builds every event" in _text(browser, "#events-note")
    _wait(browser, lambda d: s.state()["events"]["subscribers"] == 1, 10,
          "the page reading the event stream")
    _wait_live(browser)


def _severe(browser: Any) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _rows(browser: Any, table: str) -> list[str]:
    return _attrs(browser, f"#{table} tbody tr", "data-session")


def test_workers_admission_queue_and_restart(browser: Any, screenshot: Any,
                                             tmp_path: Path) -> None:
    s = start_stack(tmp_path / "stack", WINDOW_1)
    waiters: list[threading.Thread] = []
    try:
        browser.get(s.url + "/mars/ui")
        _wait_live(browser)
        _wait(browser, lambda d: len(_css(d, "#workers .worker")) == 2, 5, "worker cards")
        names = _attrs(browser, "#workers .worker", "data-name")
        assert names == ["w0", "w1"]
        # Nothing runs and nobody waits: each worker is read at the idle pace.
        _wait(browser, lambda d: set(_texts(d, ".worker .scrape-period")) == {
            "read every\n1.0 s"}, 5, "the idle read pace on the cards")

        # Live events are off by default: the page reads no event stream (the proxy counts no
        # reader, so its request path builds no events), yet an admission is on the page
        # within 2 s of the request's answer through the state poll.
        assert not _css(browser, "#events-live")[0].is_selected()
        assert "build every event" in _text(browser, "#events-note")
        assert s.chat("ui-first") == 200
        _wait(browser, lambda d: "ui-first" in _rows(d, "sessions"), 2.0,
              "ui-first in the sessions table")
        _wait(browser, lambda d: any(t.endswith("1") for t in _texts(d, ".worker .admitted")),
              2.0, "the admission on a worker card")
        assert s.state()["events"]["subscribers"] == 0
        assert not _texts(browser, "#events tbody tr")
        assert "0 readers" in _text(browser, "#store")

        # Turned on, the stream opens and new admissions show up in the event list.
        _live_events_on(browser, s)
        assert s.chat("ui-first-events") == 200
        _wait(browser, lambda d: _css(
            d, '#events tr[data-type="session_admitted"][data-session="ui-first-events"]'),
            2.0, "the admission of ui-first-events in the event list")
        s.end("ui-first-events")

        # Window 1 on each worker: the second session takes w1, the next two wait.
        assert s.chat("ui-second") == 200
        results: list[int | str] = []

        def wait_in_line(sid: str) -> None:
            try:
                results.append(s.chat(sid, timeout_s=60))
            except (OSError, urllib.error.URLError) as exc:
                results.append(repr(exc))

        for sid in ("ui-wait-1", "ui-wait-2"):
            t = threading.Thread(target=wait_in_line, args=(sid,), daemon=True)
            t.start()
            waiters.append(t)
        _wait(browser, lambda d: sorted(_rows(d, "queue")) == ["ui-wait-1", "ui-wait-2"], 10,
              "two sessions in the queue")
        why = _text(browser, "#queue-why")
        assert "w0: full 1/1 (window)" in why and "w1: full 1/1 (window)" in why, why
        row = _text(browser, "#queue tbody tr")
        assert row.endswith(" s"), row  # the Retry-After column
        assert _text(browser, "#queue-count") == "2"
        binds = set(_texts(browser, ".worker .binds"))
        assert binds == {"binds\nwindow"}, binds
        # Sessions wait for them: both are read at the fast pace again.
        _wait(browser, lambda d: set(_texts(d, ".worker .scrape-period")) == {
            "read every\n0.2 s"}, 5, "the busy read pace on the cards")
        time.sleep(3)  # a little history on the charts
        screenshot("ui")

        # The admitted sessions end: the waiting ones get in, the queue empties.
        s.end("ui-first")
        s.end("ui-second")
        _wait(browser, lambda d: not _rows(d, "queue"), 15, "the queue empties")
        for t in waiters:
            t.join(timeout=30)
        assert results == [200, 200], results
        assert _severe(browser) == []

        # The proxy restarts: the page says so, reconnects (live events still on: the toggle
        # is kept in the tab), and shows new admissions again.
        s.proxy.stop()
        _wait(browser, lambda d: _conn(d) == "retrying", 10, "the page notices the restart")
        s.proxy.start(timeout_s=60)
        _wait_live(browser, 30)
        assert s.chat("ui-after-restart") == 200
        _wait(browser, lambda d: _css(
            d, '#events tr[data-type="session_admitted"][data-session="ui-after-restart"]'),
            2.0, "an admission after the restart")
        # While the proxy was down the browser logged refused connections; nothing else.
        assert all("ERR_CONNECTION_REFUSED" in m or "ERR_EMPTY_RESPONSE" in m
                   or "Failed to fetch" in m for m in _severe(browser))
    finally:
        stop_stack(s)
        for t in waiters:
            t.join(timeout=5)


def test_behind_the_admin_token(browser: Any, screenshot: Any, tmp_path: Path) -> None:
    redis = RedisServer.available()
    s = start_stack(tmp_path / "stack", "", token=TOKEN, redis=redis)
    try:
        # The page itself is open (it holds no data); the state is not.
        with urllib.request.urlopen(s.url + "/mars/ui", timeout=10) as r:
            assert r.status == 200 and "text/html" in r.headers["Content-Type"]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(s.url + "/mars/v1/state", timeout=10)
        assert err.value.code == 401

        browser.get(s.url + "/mars/ui")
        _wait(browser, lambda d: _css(d, "#token-panel")[0].is_displayed(), 10, "token prompt")
        assert _conn(browser) == "auth"
        screenshot("ui-token-prompt")

        def submit(token: str) -> None:
            field = _css(browser, "#token-input")[0]
            field.clear()
            field.send_keys(token)
            _css(browser, "#token-submit")[0].click()

        submit("not-the-token")
        _wait(browser, lambda d: "refused" in _text(d, "#token-why"), 10,
              "a wrong token is refused")
        submit(TOKEN)
        _wait_live(browser)
        assert not _css(browser, "#token-panel")[0].is_displayed()
        _wait(browser, lambda d: len(_css(d, "#workers .worker")) == 2, 5, "worker cards")
        _live_events_on(browser, s)
        assert s.chat("ui-token-session") == 200
        _wait(browser, lambda d: _css(
            d, '#events tr[data-type="session_admitted"][data-session="ui-token-session"]'),
            2.0, "the admission behind the token")
        if redis:
            assert _text(browser, "#store-backend").startswith("redis")
            _wait(browser, lambda d: _text(d, "#store-replicas") == "1", 10,
                  "one live replica in the store")
        # The token stays in a header: not in the page's URL, not in the proxy's access log.
        assert TOKEN not in browser.current_url
        logs = s.logs()
        assert "/mars/v1/state" in logs and TOKEN not in logs
        # The 401s the page got before the token are the only console errors.
        assert all("401" in m for m in _severe(browser)), _severe(browser)
    finally:
        stop_stack(s)


def test_a_thousand_sessions_stay_paged(browser: Any, tmp_path: Path) -> None:
    s = start_stack(tmp_path / "stack", "admission: {enabled: false}\n", profile="zero")
    try:
        ids = [f"bulk-{i:04d}" for i in range(1000)]
        errors: list[str] = []

        def run(part: list[str]) -> None:
            for sid in part:
                try:
                    s.chat(sid, max_tokens=1)
                except OSError as exc:
                    errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(ids[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        browser.get(s.url + "/mars/ui")  # the page is open while the sessions arrive
        _live_events_on(browser, s)  # and reads their events: the heaviest the page gets
        for t in threads:
            t.join(timeout=180)
        assert errors == []
        _wait(browser, lambda d: _text(d, "#sessions-count") == "1000", 10,
              "1000 sessions counted")
        rows = _rows(browser, "sessions")
        assert len(rows) == 50 and set(rows) <= set(ids)
        assert 0 < len(_texts(browser, "#events tbody tr")) <= 200
        _css(browser, "#sessions-next")[0].click()
        _wait(browser, lambda d: _text(d, "#sessions-page") == "page 2 of 20", 5,
              "page 2")
        _wait(browser, lambda d: set(_rows(d, "sessions")).isdisjoint(rows), 5,
              "other sessions on page 2")
        # Responsive: timers on the page's main thread never wait long behind a redraw.
        worst_ms = browser.execute_async_script("""
            const done = arguments[arguments.length - 1];
            let worst = 0, n = 0, last = performance.now();
            const tick = () => {
              const now = performance.now();
              worst = Math.max(worst, now - last - 50);
              last = now;
              if (++n < 60) setTimeout(tick, 50); else done(worst);
            };
            setTimeout(tick, 50);
        """)
        assert worst_ms < 1000, worst_ms
        assert _severe(browser) == []
    finally:
        stop_stack(s)


def test_client_strings_are_shown_as_text_never_as_markup(browser: Any, tmp_path: Path) -> None:
    # Session ids are the clients' strings, shown in the sessions table and the event list.
    sid = '<img src=x onerror="window.__xss=1"><b id=xss-b>bold</b>'
    s = start_stack(tmp_path / "stack", "admission: {enabled: false}\n", profile="zero")
    try:
        browser.get(s.url + "/mars/ui")
        _live_events_on(browser, s)
        assert s.chat(sid, max_tokens=1) == 200
        _wait(browser, lambda d: sid in _rows(d, "sessions"), 10, "the session listed")
        _wait(browser, lambda d: sid in _attrs(d, "#events tbody tr", "data-session"), 10,
              "its events listed")
        assert sid in _texts(browser, "#sessions tbody td")
        assert sid in _texts(browser, "#events tbody td")
        # Nothing of it became an element (the CSP would block the handler; the DOM must not
        # even hold the tags), and nothing ran.
        assert browser.execute_script(
            "return document.querySelectorAll('main img, #xss-b').length") == 0
        assert browser.execute_script("return window.__xss === undefined")
        assert _severe(browser) == []
    finally:
        stop_stack(s)
