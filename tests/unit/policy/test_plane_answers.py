"""The plane ends a session on its answer: a reply that calls no tool, from a tenant whose
replies call tools (core/answers.py)."""

from __future__ import annotations

from marsproxy.config import load_config
from marsproxy.core.answers import ReplyKind
from marsproxy.core.session_record import EndReason
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import CallEnd, ControlPlane, Phase

FRESH = WorkerObservation(healthy=True, stale=False, kv_usage=0.0, total_blocks=1000,
                          block_size=16, running=0, sampled_at=0.0)


def _plane() -> tuple[ControlPlane, DecisionLog]:
    cfg = load_config(None, environ={}, overrides={"workers": ["http://a:1"]})
    log = DecisionLog()
    plane = ControlPlane(cfg, ["a"], tool_cpus=4.0, log=log)
    plane.tick(0.0, {"a": FRESH}, at=0.0, cpu=None)
    return plane, log


def _call(plane: ControlPlane, now: float, key: str, reply: ReplyKind | None, *,
          tenant: str = "t", final: bool = False) -> CallEnd:
    gen = plane.request(now, key, tenant, chars=400, final=final).incarnation
    plane.confirm(now, key)
    t = plane.call_start(now, key, "a", chars=400)
    return plane.call_end(now + 0.5, key, t, incarnation=gen, ok=True, admitted=True,
                          prompt_tokens=100, completion_tokens=10, chars=400,
                          continues=not final, reply=reply)


def test_the_answer_of_a_tool_calling_tenant_ends_its_session() -> None:
    plane, log = _plane()
    end = _call(plane, 1.0, "s", ReplyKind.TOOL_CALL)
    assert not end.answered and plane.phase("s") is Phase.DORMANT
    assert end.result is not None and end.result.retention is not None  # a tool phase follows
    end = _call(plane, 2.0, "s", ReplyKind.ANSWER)
    assert end.answered and plane.phase("s") is Phase.ENDED
    assert [(e.session, e.reason, e.worker) for e in end.outcome.ended] == [
        ("s", EndReason.ANSWERED, "a")]  # its slot to release
    assert end.result is not None and end.result.retention is None  # nothing held for it
    assert ("end", "s", ("answered",)) in [(e.kind, e.session, e.detail) for e in log.entries]
    # Its tenant's next session is learnt already: one answer, one call, ended.
    assert _call(plane, 3.0, "s2", ReplyKind.ANSWER).answered
    assert plane.phase("s2") is Phase.ENDED


def test_tenants_whose_replies_never_call_tools_are_left_alone() -> None:
    # Text-action agents (Aider, SWE-agent) answer in text on every turn.
    plane, _ = _plane()
    _call(plane, 1.0, "x", ReplyKind.TOOL_CALL, tenant="tools")
    for i in range(3):
        assert not _call(plane, 2.0 + i, "s", ReplyKind.ANSWER, tenant="text").answered
        assert plane.phase("s") is Phase.DORMANT


def test_replies_of_unknown_kind_and_final_turns_end_as_before() -> None:
    plane, _ = _plane()
    _call(plane, 1.0, "s", ReplyKind.TOOL_CALL)
    assert not _call(plane, 2.0, "s", None).answered  # an error, a broken stream: unknown
    assert plane.phase("s") is Phase.DORMANT
    end = _call(plane, 3.0, "s", ReplyKind.ANSWER, final=True)
    assert not end.answered  # the final flag ended it
    assert [e.reason for e in end.outcome.ended] == [EndReason.FINAL]


def test_an_answer_while_another_call_of_the_session_runs_ends_nothing() -> None:
    plane, _ = _plane()
    _call(plane, 1.0, "s", ReplyKind.TOOL_CALL)
    gen = plane.request(2.0, "s", "t", chars=400).incarnation
    t1 = plane.call_start(2.0, "s", "a", chars=400)
    plane.request(2.1, "s", "t", chars=400)
    t2 = plane.call_start(2.1, "s", "a", chars=400)
    end = plane.call_end(2.5, "s", t1, incarnation=gen, ok=True, admitted=True,
                         prompt_tokens=100, chars=400, reply=ReplyKind.ANSWER)
    assert not end.answered and plane.phase("s") is Phase.IN_CALL
    end = plane.call_end(2.6, "s", t2, incarnation=gen, ok=True, admitted=True,
                         prompt_tokens=100, chars=400, reply=ReplyKind.ANSWER)
    assert end.answered and plane.phase("s") is Phase.ENDED


def test_a_tenant_whose_sessions_come_straight_back_keeps_them_through_answers() -> None:
    # A harness answering tool-less replies itself (OpenHands' "please continue", SWE-agent's
    # requery): its first session comes back at once after its answer.
    plane, _ = _plane()
    _call(plane, 1.0, "s", ReplyKind.TOOL_CALL, tenant="h")
    assert _call(plane, 2.0, "s", ReplyKind.ANSWER, tenant="h").answered
    end = _call(plane, 2.6, "s", ReplyKind.TOOL_CALL, tenant="h")  # back: a new admission
    assert not end.answered and plane.phase("s") is Phase.DORMANT
    end = _call(plane, 4.0, "s", ReplyKind.ANSWER, tenant="h")
    assert not end.answered and plane.phase("s") is Phase.DORMANT  # kept through its answer
    assert _call(plane, 4.7, "s", ReplyKind.ANSWER, tenant="h", final=True).outcome.ended
    # Another tenant's answers still end its sessions.
    _call(plane, 5.0, "x", ReplyKind.TOOL_CALL, tenant="t")
    assert _call(plane, 6.0, "x", ReplyKind.ANSWER, tenant="t").answered
