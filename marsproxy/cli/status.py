"""``marsproxy status``: the proxy's ``/mars/v1/state`` document as a readable table.

:func:`fetch_state` and :func:`run_status` do the I/O; :mod:`marsproxy.cli.status_render` turns
the document into text.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, TextIO

from marsproxy.cli.status_render import render_state

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "MARSPROXY_URL"
STATE_PATH = "/mars/v1/state"
# Clear screen and home the cursor; written together with the frame so the screen never
# shows a blank state between two refreshes.
CLEAR = "\x1b[H\x1b[2J"


class StatusError(Exception):
    """The state could not be fetched; the message is one line meant for the user."""


def state_url(base: str, sessions: bool) -> str:
    return base.rstrip("/") + STATE_PATH + ("?sessions=1" if sessions else "")


TOKEN_ENV = "MARSPROXY_AUTH__ADMIN_TOKEN"  # the same variable the proxy reads auth.admin_token from
# What to do about the answers a wrong address or a missing token get.
_HINTS = {
    401: f" (the proxy wants its admin token, missing or wrong: set {TOKEN_ENV} to it)",
    404: " (no marsproxy state there: is --url the proxy's address, not a worker's?)",
}


def fetch_state(
    base: str, *, sessions: bool = False, timeout_s: float = 5.0, token: str | None = None
) -> dict[str, Any]:
    """GET the state document; any failure becomes a one-line :class:`StatusError`."""
    if not base.startswith(("http://", "https://")):
        raise StatusError(f"bad URL {base!r}: give it as http://HOST:PORT")
    try:
        urllib.parse.urlsplit(base).port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as exc:
        raise StatusError(f"bad URL {base!r}: {exc}; give it as http://HOST:PORT") from None
    url = state_url(base, sessions)
    try:
        req = urllib.request.Request(url)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{url}: HTTP {exc.code} {exc.reason}{_HINTS.get(exc.code, '')}"
                          ) from None
    except urllib.error.URLError as exc:
        raise StatusError(f"cannot reach marsproxy at {base}: {exc.reason}") from None
    except (TimeoutError, OSError) as exc:
        raise StatusError(f"cannot reach marsproxy at {base}: {exc}") from None
    except http.client.HTTPException as exc:  # a server that does not speak HTTP (Redis, ...)
        raise StatusError(f"{base} did not answer HTTP ({type(exc).__name__}): is it the"
                          " proxy's address?") from None
    except ValueError as exc:  # e.g. an IPv6 address without its closing bracket
        raise StatusError(f"bad URL {base!r}: {exc}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise StatusError(f"{url}: the answer is not JSON") from None
    if not isinstance(doc, dict):
        raise StatusError(f"{url}: the answer is not a JSON object")
    if not isinstance(doc.get("workers"), list):  # every state document lists its workers
        raise StatusError(f"{url}: not marsproxy's state (no list of workers): is --url the"
                          " proxy's address?")
    return doc


def _width() -> int:
    return shutil.get_terminal_size((120, 40)).columns


def run_status(
    url: str,
    *,
    watch: bool = False,
    interval_s: float = 1.0,
    sessions: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    token: str | None = None,
) -> int:
    """Print the state once (exit 1 when unreachable), or refresh it until Ctrl-C."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if not watch:
        try:
            doc = fetch_state(url, sessions=sessions, token=token)
        except StatusError as exc:
            err.write(f"marsproxy status: {exc}\n")
            return 1
        out.write(render_state(doc, _width()))
        return 0
    try:
        while True:
            began = time.monotonic()
            try:
                frame = render_state(fetch_state(url, sessions=sessions, token=token), _width())
            except StatusError as exc:
                # Keep retrying: a proxy that restarts should reappear by itself.
                frame = f"marsproxy status: {exc}\n(retrying every {interval_s:g} s)\n"
            out.write(f"{CLEAR}{frame}\n{url}, every {interval_s:g} s; Ctrl-C to quit\n")
            out.flush()
            time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    except KeyboardInterrupt:
        out.write("\n")
        return 0


def default_url(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(URL_ENV) or DEFAULT_URL


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Options of ``marsproxy status`` (the CLI adds the subcommand and calls this)."""
    p.add_argument(
        "--url", default=default_url(),
        help=f"proxy base URL (env {URL_ENV} sets the default)",
    )
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument(
        "--interval", type=_positive, default=1.0, metavar="S",
        help="seconds between refreshes with --watch",
    )
    p.add_argument("--sessions", action="store_true", help="also list the sessions")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    # The admin token from the environment only: a flag would show in the process list.
    return run_status(
        args.url, watch=args.watch, interval_s=args.interval, sessions=args.sessions,
        token=os.environ.get(TOKEN_ENV) or None,
    )
