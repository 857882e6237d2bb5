"""Held requests: a session's end builds its refusal only when ``expects`` says a request of
it would take one (``StoreConfirmations._ending``); refusing anyone else changes nothing."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from marsproxy.gateway.shells.admission_types import Granted, Refused, Verdict
from marsproxy.gateway.shells.held import HeldRequests

KEYS = ("a", "b")
OPS = st.lists(st.tuples(st.sampled_from(("arriving", "arrived", "wait", "grant", "cancel",
                                          "refuse", "claim")), st.sampled_from(KEYS)),
               max_size=30)
REFUSED = Refused(503, "session_ended", 1, "the session ended (final)")


def _state(h: HeldRequests) -> tuple[object, ...]:
    return ({k: list(v) for k, v in h._waiters.items()}, dict(h._unclaimed), dict(h._arriving))


def _check_refusals(h: HeldRequests) -> None:
    for key in KEYS:
        if not h.expects(key):  # the skipped refusal would have done nothing
            before = _state(h)
            assert h.refuse(key, REFUSED) is False
            assert _state(h) == before


async def _run(ops: list[tuple[str, str]]) -> None:
    h = HeldRequests()
    arriving = dict.fromkeys(KEYS, 0)
    futures: list[tuple[str, asyncio.Future[Verdict]]] = []
    for op, key in ops:
        if op == "arriving":
            h.arriving(key, 1)
            arriving[key] += 1
        elif op == "arrived" and arriving[key]:
            h.arrived(key, 1)
            arriving[key] -= 1
        elif op == "wait":
            futures.append((key, h.future(key)))
        elif op == "grant":
            h.grant(key, Granted("w0", 0.0, 1))
        elif op == "cancel":
            for k, f in futures:
                if k == key and not f.done():
                    f.cancel()
                    break
        elif op == "refuse":
            h.refuse(key, REFUSED)
        elif op == "claim":
            h.others(key, None, 1)
        assert (key in h._arriving) == (arriving[key] > 0)  # the pair counts like the old mark
        _check_refusals(h)


@given(OPS)
def test_a_refusal_nobody_expects_changes_nothing(ops: list[tuple[str, str]]) -> None:
    asyncio.run(_run(ops))
