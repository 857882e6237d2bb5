"""The base of every config section: strict (unknown keys are errors), frozen, numbers finite.

YAML's ``.inf`` and ``.nan`` are errors: no key means "no limit" by an infinity.

Also the checks of the root config's values that need more than a field's bounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def worker_url(v: str) -> str:
    """A worker's base URL, ``http(s)://HOST[:PORT][/path]``, without its trailing slash."""
    if not v.startswith(("http://", "https://")):
        raise ValueError(f"worker url must start with http:// or https://, got {v!r}")
    try:
        parts = urlsplit(v)
        parts.port  # noqa: B018 -- raises on a port that is not a number in 0-65535
    except ValueError as exc:
        raise ValueError(f"worker url {v!r}: {exc}; give http://HOST:PORT") from None
    if not parts.hostname:
        raise ValueError(f"worker url {v!r} names no host; give http://HOST:PORT")
    return v.rstrip("/")


def unique_workers(workers: Sequence[Any]) -> Sequence[Any]:
    """Each worker has a name (``name``, else host:port) and a URL of its own: the proxy keys
    its state, metrics and routing by both."""
    for what, attr in (("name", "label"), ("url", "url")):
        seen = [getattr(w, attr) for w in workers]
        twice = sorted({x for x in seen if seen.count(x) > 1})
        if twice:
            raise ValueError(f"worker {what} {', '.join(map(repr, twice))} given twice: each"
                             f" worker needs a {what} of its own (the name defaults to host:port)")
    return workers


def redis_url(v: str) -> str:
    """A Redis URL: ``redis://``, ``rediss://`` (TLS) or ``unix://``."""
    parts = urlsplit(v)
    if parts.scheme not in ("redis", "rediss", "unix"):
        shown = "a URL with a password" if parts.password is not None else repr(v)
        raise ValueError(f"a Redis URL must start with redis://, rediss:// or unix:// ({shown})")
    return v


def redis_stream_url(v: str) -> str:
    """``telemetry.redis_stream.url``: empty (off) or a Redis URL."""
    return v and redis_url(v)
