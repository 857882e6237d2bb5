"""`marsproxy status`: rendering of hand-made state documents, value formatting, fetch errors."""

from __future__ import annotations

import copy
import io
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from marsproxy.cli import main, status
from marsproxy.cli.status import CLEAR, StatusError, fetch_state, run_status
from marsproxy.cli.status_render import bar, fmt_float, fmt_frac_pct, fmt_int, fmt_pct, render_state


def _worker(name: str, **over: Any) -> dict[str, Any]:
    w: dict[str, Any] = {
        "name": name, "url": f"http://{name}:8000", "healthy": True, "stale": False,
        "age_s": 0.12, "kv_usage": 0.4312, "running": 3, "waiting": 1,
        "preemptions_per_s": 0.25, "prefix_cache_hit_rate": 0.83,
        "prefill_tokens_per_s": 12345.6, "block_size": 16, "num_gpu_blocks": 512,
        "scrape_errors": 0, "scrape_period_s": 0.2, "sessions": 4, "requests_in_flight": 2,
        "gpu": {"available": False, "memory_used_frac": None, "utilization_pct": None},
    }
    w.update(over)
    return w


def _doc(*workers: dict[str, Any]) -> dict[str, Any]:
    return {
        "time": 1_780_000_000.0, "version": "0.1.0",
        "workers": list(workers) or [_worker("w0")],
        "cpu": {"source": "host:/proc/pressure/cpu", "psi_some_avg10": 12.34,
                "psi_some_avg60": 4.5, "throttled_usec": None, "cpu_percent": 55.0,
                "tool_cpus": 2.0},
        "tools": {"in_flight": 3, "backlog_ratio": 1.5, "queue_wait_ema_s": 0.12,
                  "slowdown_ema": 1.2},
        "sessions": {"total": 5, "by_state": {"llm": 2, "tool": 3, "idle": 0}},
        "events": {"published_total": 1234, "dropped_total": 7, "subscribers": 1},
    }


def _row(text: str, name: str) -> list[str]:
    """The cells of the worker table's row for ``name`` (cells are separated by 2+ spaces)."""
    for line in text.splitlines():
        if line.strip().startswith(name + " "):
            return re.split(r" {2,}", line.strip())
    raise AssertionError(f"no row for {name!r} in:\n{text}")


# -- value formatting -----------------------------------------------------------------------


def test_nulls_and_non_numbers_print_as_dash() -> None:
    for v in (None, "x", True, float("nan"), float("inf"), [1]):
        assert fmt_int(v) == "-"
        assert fmt_float(v) == "-"
        assert fmt_frac_pct(v) == "-"
        assert fmt_pct(v) == "-"
        assert bar(v, 10) == ""


def test_percentages_fractions_and_numbers() -> None:
    assert fmt_frac_pct(0.4312) == "43.1%"
    assert fmt_frac_pct(1) == "100.0%"
    assert fmt_frac_pct(0.0) == "0.0%"
    assert fmt_frac_pct(0.83, 0) == "83%"
    # PSI and utilization are already percent: not multiplied again.
    assert fmt_pct(12.34) == "12.3%"
    assert fmt_int(3) == "3" and fmt_int(2.6) == "3"
    assert fmt_float(0.125, 3, " s") == "0.125 s"


def test_bar_is_clamped_and_sized() -> None:
    assert bar(0.0, 10) == "[..........]"
    assert bar(0.5, 10) == "[#####.....]"
    assert bar(1.7, 4) == "[####]"
    assert bar(-1, 4) == "[....]"
    assert bar(0.5, 0) == ""


# -- rendering ------------------------------------------------------------------------------


def test_render_full_document() -> None:
    out = render_state(_doc(_worker("w0"), _worker("w1", kv_usage=0.9, running=7)), 200)
    lines = out.splitlines()
    assert lines[0].startswith("marsproxy 0.1.0") and "state at 20" in lines[0]
    header = next(x for x in lines if x.strip().startswith("worker"))
    for col in ("health", "sample", "KV", "run", "wait", "preempt/s", "prefix hit",
                "prefill tok/s", "sess", "in-flight", "every", "GPU"):
        assert col in header
    w0 = _row(out, "w0")
    assert w0[:3] == ["w0", "ok", "0.12s"]
    assert "43.1% [####......]" in " ".join(w0)
    assert w0[3:] == ["43.1% [####......]", "3", "1", "0.25", "83.0%", "12346", "4", "2", "0",
                      "0.2s", "n/a"]
    assert _row(out, "w1")[4] == "7" and "90.0% [#########.]" in out
    assert "PSI some avg10 12.3% avg60 4.5%" in out
    assert "throttled -" in out and "tool CPUs 2.0" in out and "cpu 55.0%" in out
    assert "in flight 3" in out and "backlog ratio 1.50" in out
    assert "wait EMA 0.120 s" in out and "slowdown 1.20x" in out
    assert "total 5   llm 2, tool 3, idle 0" in out
    assert "published 1234   dropped 7   subscribers 1" in out


def test_render_stale_and_null_worker() -> None:
    dead = _worker(
        "w1", healthy=False, stale=True, age_s=None, kv_usage=None, running=None, waiting=None,
        preemptions_per_s=None, prefix_cache_hit_rate=None, prefill_tokens_per_s=None,
        scrape_errors=12, scrape_period_s=1.0,
    )
    late = _worker("w2", stale=True, age_s=3.456)
    out = render_state(_doc(_worker("w0"), dead, late), 200)
    assert _row(out, "w1") == ["w1", "DOWN", "STALE never", "-", "-", "-", "-", "-", "-", "4",
                               "2", "12", "1.0s", "n/a"]
    assert _row(out, "w2")[1:3] == ["ok", "STALE 3.46s"]


def test_render_gpu_available() -> None:
    w = _worker("g0", gpu={"available": True, "memory_used_frac": 0.914, "utilization_pct": 77.4})
    assert _row(render_state(_doc(w), 200), "g0")[-1] == "mem 91% util 77%"
    w = _worker("g1", gpu={"available": True, "memory_used_frac": None, "utilization_pct": None})
    assert _row(render_state(_doc(w), 200), "g1")[-1] == "mem - util -"


def test_render_sessions_table() -> None:
    doc = _doc()
    doc["sessions"]["details"] = [
        {"id": "tenant-a:s1", "worker": "w0", "state": "tool", "turns": 3, "tool": "pytest",
         "since_s": 1.234},
        {"id": "tenant-a:s2", "worker": "w1", "state": "llm", "turns": 1, "tool": None,
         "since_s": 0.05},
    ]
    out = render_state(doc, 200)
    header = next(x for x in out.splitlines() if x.strip().startswith("session "))
    assert header.split() == ["session", "worker", "state", "turns", "tool", "since"]
    assert _row(out, "tenant-a:s1") == ["tenant-a:s1", "w0", "tool", "3", "pytest", "1.2s"]
    assert _row(out, "tenant-a:s2") == ["tenant-a:s2", "w1", "llm", "1", "-", "0.1s"]
    doc["sessions"]["details"] = []
    assert "(no sessions)" in render_state(doc, 200)
    # Without ?sessions=1 there is no details key and no table.
    assert "session " not in render_state(_doc(), 200)


def test_render_tolerates_extra_and_missing_keys() -> None:
    doc = _doc(_worker("w0", admission={"window": 4}, future_field=[1, 2]))
    doc["admission"] = {"windows": {"w0": 3.0}}
    doc["sessions"]["by_state"]["queued"] = 2
    out = render_state(doc, 200)
    assert "w0" in out and "queued 2" in out
    # Missing optional sections and keys, and wrong types, print "-" instead of failing.
    sparse: dict[str, Any] = {"workers": [{"name": "w9"}, "junk", {"gpu": 3}], "cpu": None}
    out = render_state(sparse, 80)
    assert out.splitlines()[0] == "marsproxy -   state at -"
    assert _row(out, "w9")[:4] == ["w9", "-", "-", "-"]
    assert "source -" in out and "published -" in out
    assert "(no workers)" in render_state({}, 80)


def test_render_fits_width_by_dropping_the_bar() -> None:
    doc = _doc(_worker("w0"), _worker("w1"))
    wide = render_state(doc, 200)
    assert "[####......]" in wide
    table_width = max(len(x) for x in wide.splitlines() if x.strip().startswith(("w0", "w1")))
    assert "[####......]" in render_state(doc, table_width)
    assert "43.1% [##...]" in render_state(doc, table_width - 1)  # 5 cells are 5 columns less
    assert "[" not in render_state(doc, table_width - 6)
    # A narrow terminal never loses a worker's name or a number.
    narrow = render_state(doc, 40)
    assert _row(narrow, "w1")[:4] == ["w1", "ok", "0.12s", "43.1%"]
    long = "worker-" + "x" * 60
    assert _row(render_state(_doc(_worker(long)), 200), long[:31] + "…")[0] == long[:31] + "…"


def test_render_does_not_mutate_the_document() -> None:
    doc = _doc(_worker("w0"))
    before = copy.deepcopy(doc)
    render_state(doc, 100)
    assert doc == before


# -- fetching -------------------------------------------------------------------------------


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A port bound but not listening: connections are refused, and no one else can take it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


class _StateServer:
    """A stand-in proxy answering /mars/v1/state with ``doc`` (or ``body``/``code``)."""

    def __init__(self, doc: Any, code: int = 200, body: bytes | None = None) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                payload = body if body is not None else json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def state_server() -> Iterator[_StateServer]:
    srv = _StateServer(_doc(_worker("w0"), _worker("w1")))
    yield srv
    srv.close()


def test_fetch_and_print(state_server: _StateServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", state_server.url + "/"]) == 0
    out = capsys.readouterr().out
    assert "w0" in out and "w1" in out and "marsproxy 0.1.0" in out
    assert main(["status", "--url", state_server.url, "--sessions"]) == 0
    assert state_server.paths == ["/mars/v1/state", "/mars/v1/state?sessions=1"]


def test_refused_connection_is_one_line_and_exit_1(
    refused_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--url", refused_url]) == 1
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err.strip()
    assert "\n" not in err
    assert err.startswith("marsproxy status: cannot reach marsproxy at " + refused_url)
    assert "refused" in err.lower()


@pytest.mark.parametrize(
    ("code", "body", "message"),
    [
        (404, b'{"error": "not found"}', "HTTP 404"),
        (200, b"<html>", "not JSON"),
        (200, b"[1, 2]", "not a JSON object"),
        (200, b"{}", "not marsproxy's state"),  # another service's JSON: it printed dashes, rc 0
        (200, b'{"workers": 3}', "not marsproxy's state"),
    ],
)
def test_bad_answers_are_clear_errors(code: int, body: bytes, message: str) -> None:
    srv = _StateServer(None, code=code, body=body)
    try:
        with pytest.raises(StatusError, match=message):
            fetch_state(srv.url)
    finally:
        srv.close()


@pytest.mark.parametrize(("code", "hint"), [
    (404, "is --url the proxy's address, not a worker's?"),
    (401, "set MARSPROXY_AUTH__ADMIN_TOKEN"),
])
def test_a_refusal_says_what_to_do(code: int, hint: str) -> None:
    # Before: "HTTP 404 Not Found" alone (a worker's address), "HTTP 401 Unauthorized" alone.
    srv = _StateServer(None, code=code, body=b"{}")
    try:
        with pytest.raises(StatusError, match=re.escape(hint)):
            fetch_state(srv.url)
    finally:
        srv.close()


def test_bad_url_is_a_clear_error() -> None:
    with pytest.raises(StatusError, match="bad URL"):
        fetch_state("localhost:8080")


def test_watch_keeps_retrying_on_errors_until_ctrl_c(
    refused_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []

    def fake_sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(status.time, "sleep", fake_sleep)
    out = io.StringIO()
    assert run_status(refused_url, watch=True, interval_s=0.5, out=out) == 0
    frames = out.getvalue().split(CLEAR)[1:]
    assert len(frames) == 3
    assert all("cannot reach marsproxy" in f and "retrying every 0.5 s" in f for f in frames)
    assert all(0.0 <= s <= 0.5 for s in sleeps)


def test_watch_renders_each_refresh(
    state_server: _StateServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0

    def fake_sleep(_: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status.time, "sleep", fake_sleep)
    out = io.StringIO()
    assert run_status(state_server.url, watch=True, sessions=True, out=out) == 0
    frames = out.getvalue().split(CLEAR)[1:]
    assert len(frames) == 2 and all("w1" in f for f in frames)
    assert state_server.paths == ["/mars/v1/state?sessions=1"] * 2


# -- command line ---------------------------------------------------------------------------


def test_help_shows_every_option_with_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MARSPROXY_URL", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["status", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--url URL", "(default: http://127.0.0.1:8080)", "MARSPROXY_URL",
                  "--watch", "--interval S", "(default: 1.0)", "--sessions"):
        assert shown in text


def test_env_sets_the_default_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from marsproxy.cli import build_parser

    monkeypatch.setenv("MARSPROXY_URL", "http://proxy:9999")
    assert build_parser().parse_args(["status"]).url == "http://proxy:9999"
    assert build_parser().parse_args(["status", "--url", "http://x:1"]).url == "http://x:1"


def test_interval_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["status", "--interval", "0"])
    assert exc.value.code == 2
    assert "must be > 0" in capsys.readouterr().err


def test_status_shows_the_scheduler() -> None:
    from marsproxy.cli.status_render import render_state

    doc = {
        "workers": [{"name": "w0", "scheduler": {
            "mode": "gated", "in_flight": 2, "cap": 4, "queue_length": 3,
            "retained_blocks": 120, "reservations": [{"session": "a"}, {"session": "b"}],
        }}],
        "scheduler": {"priority_policy": "session_fcfs", "retention_policy": "mars",
                      "hint_encoder": "headers", "resumes": {"warm": 3, "cold": 1,
                                                             "hit_rate": 0.75}},
    }
    out = render_state(doc, 100)
    head = ("Scheduler priority session_fcfs   retention mars   hints headers"
            "   warm resumes 3/4 (75%)")
    assert head in out
    assert "w0: gated   in flight 2/4   held 3   retained 120 blocks (2 sessions)" in out
    assert "Scheduler" not in render_state({"workers": []}, 100)
