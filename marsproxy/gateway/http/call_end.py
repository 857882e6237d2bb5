"""The end of a scheduled call, once its response has left: the reply read for usage and kind,
``llm_end`` and the token counts, the plane and the session table told how the call ended, the
tool phase that follows. The call of a background response still generating ends later, with
that response (``shells/background.py``): until then its worker counts it in flight.
"""

from __future__ import annotations

import logging
import time

from marsproxy.core.identity import Route
from marsproxy.gateway.http.relay_response import CLIENT_GONE
from marsproxy.gateway.http.sse import UNREADABLE, read_body
from marsproxy.gateway.shells.background import unfinished
from marsproxy.gateway.shells.outcome import Clock, Outcome, RequestEvents
from marsproxy.gateway.shells.service import Gateway

log = logging.getLogger("marsproxy.gateway.http.call_end")


class CallEnd:
    def __init__(self, gw: Gateway, events: RequestEvents) -> None:
        self.gw, self.events = gw, events

    @staticmethod
    def read(route: Route, out: Outcome) -> None:
        """Usage (and a chain session's reply) of a JSON reply that has left."""
        if out.body is None or out.turn_ref is None:
            return
        try:
            out.usage, out.reply, out.reply_kind, out.response_id = read_body(
                route, out.body, capture=out.turn_ref.capture_reply, kinds=out.offers_tools)
        except UNREADABLE as exc:  # the client has it as it is
            log.warning("%s reply of session %s: no usage read from it: %r", route,
                        out.session, exc)

    def close(self, route: Route, out: Outcome, clock: Clock) -> None:
        """The call is over (``llm_end``, its tokens, the plane and the session table told),
        unless its reply is a background response still generating: then when that ends."""
        if not self._goes_on(route, out, clock):
            self._end(out, clock)

    def _end(self, out: Outcome, clock: Clock) -> None:
        try:
            self.events.ended(out, clock)
            self.events.counted(out)
        except Exception:
            log.exception("accounting of a %s request of session %s failed; its call ends "
                          "anyway", out.route, out.session)
        self._close_turn(out, clock)

    def _goes_on(self, route: Route, out: Outcome, clock: Clock) -> bool:
        rid, worker, turn = out.response_id, out.worker, out.turn_ref
        if out.credentials is None or rid is None or worker is None or turn is None:
            return False
        # Answered queued; or streamed, its client gone before the end (vLLM goes on).
        queued = out.ok and out.body is not None and unfinished(out.body)
        if not queued and out.status != CLIENT_GONE:
            return False
        self.gw.reply_made(turn, rid, worker.url)  # the client's polls of it find its worker

        def ended(body: bytes | None) -> None:
            # The final response, read as the reply had been: its usage, its kind (the
            # answer rule), a chain session's reply; none: the call failed.
            out.body, out.usage, out.reply, out.reply_kind = body, None, None, None
            out.ok = body is not None
            self.read(route, out)
            self._end(out, clock)

        self.gw.background.watch(worker.url, rid, out.credentials, ended)
        return True

    def _close_turn(self, out: Outcome, clock: Clock) -> None:
        """After llm_end: the session table learns the outcome (which may end the session,
        publishing session_end), and a session that goes on enters its tool phase."""
        gw, turn = self.gw, out.turn_ref
        if turn is None:
            return
        answered = False
        if out.prepared is not None or out.admitted:
            # A one-shot request (no session to come back) gets no retention decision.
            sess = gw.sessions.of(turn)  # None: ended, its id maybe a new session's now
            goes_on = not turn.final and sess is not None and not sess.ephemeral
            engine_s = time.perf_counter() - clock.t0 - clock.held_s
            # Before the table may forget the session: the plane hears the end of the call
            # first, then (on a final turn) the end of the session.
            answered = gw.call_ended(
                turn.session, out.prepared, ok=out.ok, usage=out.usage, engine_s=engine_s,
                continues=goes_on, admitted=out.admitted, chars=out.prompt_chars,
                incarnation=out.incarnation, reply=out.reply_kind)
        # Answered, the session's end is the plane's alone (as its idle timeout): the table keeps
        # it, so a client that goes on after the answer continues the same session.
        gw.turn_finished(turn, ok=out.ok, reply=out.reply,
                         response_id=out.response_id if out.stores else None)
        if out.ok and not answered:  # no tool phase follows an answer
            gw.response_ended(turn)
