"""Which Redis error replies count as an outage (degrade, retry) and which as a bug (raise)."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from marsproxy.aimd.stores.redis_errors import FAILURES, RedisRefused, refusal

DENIED = ("DENIED Redis is running in protected mode because protected mode is enabled and no"
          " password is set for the default user. In this mode connections are only accepted"
          " from the loopback interface. If you want to connect from external computers...")


@pytest.mark.parametrize("exc", [
    ResponseError(DENIED),
    ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable"),
    ResponseError("NOREPLICAS Not enough good replicas to write."),
    ReadOnlyError("You can't write against a read only replica."),
    NoPermissionError("this user has no permissions to run the 'evalsha' command"),
    OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
])
def test_a_refusing_server_reads_as_an_outage(exc: ResponseError) -> None:
    out = refusal(exc)
    assert isinstance(out, RedisRefused) and isinstance(out, FAILURES)
    assert str(out).startswith("Redis refuses this client: ")
    if isinstance(exc, ReadOnlyError):  # the class names the refusal its text leaves out
        assert "ReadOnlyError" in str(out)


def test_only_the_first_sentence_of_a_long_reply_is_kept() -> None:
    out = refusal(ResponseError(DENIED))
    assert out is not None
    assert str(out).endswith("no password is set for the default user")


@pytest.mark.parametrize("text", [
    "ERR Error running script (call to f_x): @user_script:12: bad argument",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "denied lowercase is not a reply code",
])
def test_other_errors_are_bugs_and_raise(text: str) -> None:
    assert refusal(ResponseError(text)) is None
