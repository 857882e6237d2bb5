"""Which Redis errors mean "Redis is unusable" rather than "the proxy has a bug".

Unusable Redis degrades service as ``store.on_store_failure`` says and is retried; any other
error (a script bug) raises. Unreachable (connection refused, reset, timeout) is the obvious
case; a server that answers but refuses this client is the same for the proxy: protected mode
(``DENIED``, a non-loopback client of a Redis without a password), a read-only replica after a
failover (``READONLY``), ``OOM``, a failing disk (``MISCONF``), missing ACL permissions
(``NOPERM``), a master that is down (``MASTERDOWN``) or a primary cut off from its replicas
(``NOREPLICAS``, with ``min-replicas-to-write``: the guard against writes a failover would lose).
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

# redis-py has classes for READONLY, NOPERM, OOM and MASTERDOWN (their text then lacks the
# code); DENIED, MISCONF and NOREPLICAS stay plain ResponseErrors, matched on the reply's
# first word.
_REFUSING_CLASSES = (ReadOnlyError, NoPermissionError, OutOfMemoryError, MasterDownError)
_REFUSING_REPLIES = frozenset({"DENIED", "MISCONF", "NOREPLICAS"})


class RedisRefused(RedisConnectionError):
    """Redis answered, but refuses this client; carries the server's reply."""


FAILURES: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # RedisRefused, AuthenticationError (NOAUTH, WRONGPASS) included
    RedisTimeoutError,
    TimeoutError,
    OSError,
)


def refusal(exc: ResponseError) -> RedisRefused | None:
    """``exc`` as a :class:`RedisRefused` if it is a server's refusal, else None (a bug)."""
    text = str(exc)
    if isinstance(exc, _REFUSING_CLASSES):
        text = f"{type(exc).__name__}: {text}"
    elif text.split(" ", 1)[0] not in _REFUSING_REPLIES:
        return None
    # Protected mode's reply is a page long: its first sentence says what is wrong.
    return RedisRefused(f"Redis refuses this client: {text.split('. ', 1)[0]}")


class StateLost(Exception):
    """Redis answers, but lost the pool's state (restarted empty between two ops: the pool
    reconnects silently). Handled as an outage: the resync writes this replica's view back."""
