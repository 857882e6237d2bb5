"""Query parameters of the admin API, read strictly.

A parameter the route does not take, one given twice, a flag or a number that does not read as
one is an error naming it, never a default in its place (``?limt=5`` would otherwise silently
answer the default page).

Pure: the handlers turn a :class:`QueryError` into a 400.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

SHOWN_CHARS = 40  # how much of a bad value an error message repeats
_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"0", "false", "no"})


class QueryError(ValueError):
    """A query parameter that cannot be used; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``value`` quoted for a message, cut to ``limit`` characters (a client chose it)."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def check_names(names: Iterable[str], allowed: frozenset[str]) -> None:
    """Every name known to the route and given once (``names``: one per occurrence)."""
    for name, n in Counter(names).items():
        if name not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise QueryError(name, f"unknown query parameter (this endpoint takes: {known})")
        if n > 1:
            raise QueryError(name, f"given {n} times; give it once")


def flag(query: Mapping[str, str], name: str) -> bool:
    """``1``/``true``/``yes`` or ``0``/``false``/``no`` (any case); absent: false."""
    raw = query.get(name)
    if raw is None:
        return False
    value = raw.lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise QueryError(name, f"must be 1/true/yes or 0/false/no, got {shown(raw)}")


def integer(query: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """A decimal integer of ASCII digits in ``lo..hi``; absent: ``default``. (``int()`` alone
    would take ``1_0``, ``+5``, spaces and other scripts' digits.)"""
    raw = query.get(name)
    if raw is None:
        return default
    bad = QueryError(name, f"must be an integer {lo}..{hi}, got {shown(raw)}")
    if not raw.isascii() or not raw.isdigit() or len(raw) > len(str(hi)):
        raise bad
    value = int(raw)
    if not lo <= value <= hi:
        raise bad
    return value
