"""Agent trees: the identity a request carries, the children's lane, the waiting parent's KV
hold, level inheritance, and the tree forest the plane keeps."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict

from marsproxy.aimd.admission import DecisionKind
from marsproxy.aimd.config import AdmissionConfig
from marsproxy.aimd.queue import AdmissionQueue, WorkerView
from marsproxy.config import load_config
from marsproxy.core.identity import ExplicitId, tree_identity
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import ControlPlane, Phase
from marsproxy.policy.trees import Trees

PAIRS = {"x-claude-code-agent-id": "x-claude-code-parent-agent-id",
         "thread-id": "x-codex-parent-thread-id"}
CC = ExplicitId("S", "header", "x-claude-code-session-id")


def _ident(headers: dict[str, str], explicit: ExplicitId | None = CC,
           live: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    own, parent = tree_identity(CIMultiDict(headers), explicit, subagent_headers=PAIRS,
                                parent_headers=("x-parent-session-id",),
                                live=lambda sid: sid in live)
    return (None if own is None else own.value), parent


def test_a_claude_code_sub_agent_is_a_session_of_its_own() -> None:
    assert _ident({}) == ("S", None)  # the main agent: the session, no parent
    sub = {"X-Claude-Code-Agent-Id": "a1", "X-Claude-Code-Parent-Agent-Id": "main"}
    assert _ident(sub) == ("S/agent/a1", "S")  # its parent agent unknown here: the root
    nested = {"x-claude-code-agent-id": "a2", "x-claude-code-parent-agent-id": "a1"}
    assert _ident(nested, live=("S/agent/a1",)) == ("S/agent/a2", "S/agent/a1")
    # An agent id without a parent id is no sub-agent (a root that names itself).
    assert _ident({"x-claude-code-agent-id": "a1"}) == ("S", None)


def test_codex_spawned_threads_and_the_explicit_parent_header() -> None:
    codex = {"thread-id": "t2", "x-codex-parent-thread-id": "t1", "x-openai-subagent": "x"}
    assert _ident(codex) == ("S/agent/t2", "S")
    assert _ident({"thread-id": "t1"}) == ("S", None)  # the root thread
    assert _ident({"x-parent-session-id": " P "}, ExplicitId("c", "header", "x")) == ("c", "P")
    assert _ident({"x-parent-session-id": "P"}, None) == (None, "P")


def _worker(**kw: Any) -> WorkerView:
    base: dict[str, Any] = dict(admitted=0, limit=10, budget_blocks=10_000, free_blocks=20_000)
    base.update(kw)
    return WorkerView(name="w0", **base)


def test_a_child_goes_ahead_of_new_sessions_whatever_their_class() -> None:
    q = AdmissionQueue(AdmissionConfig())
    assert q.push(q.entry("i0", "t", 0.0, 100, "interactive"))
    assert q.push(q.entry("b0", "u", 1.0, 100, "batch"))
    assert q.push(q.entry("c0", "u", 2.0, 100, "batch", child=True))
    assert [e.session for e in q.ordered(3.0)] == ["c0", "i0", "b0"]
    assert [a.entry.session for a in q.select(3.0, [_worker(limit=1)])] == ["c0"]
    assert len(q) == 2 and q.get("c0") is None


def test_a_child_that_does_not_fit_holds_new_sessions_back() -> None:
    q = AdmissionQueue(AdmissionConfig())
    assert q.push(q.entry("n0", "t", 0.0, 100))  # 7 blocks
    assert q.push(q.entry("c0", "t", 1.0, 900, child=True))  # 57 blocks
    assert [a.entry.session for a in q.select(2.0, [_worker(admitted=1, budget_blocks=20)])] \
        == []
    assert [a.entry.session for a in q.select(3.0, [_worker(admitted=1)])] == ["c0", "n0"]


def test_the_forest() -> None:
    t = Trees()
    assert t.link("c1", "p") and t.link("c2", "p") and t.link("g", "c1")
    assert not t.link("p", "g") and not t.link("c1", "x") and not t.link("s", "s")
    assert t.forest() == {"c1": ["g"], "p": ["c1", "c2"]} and t.root_of("g") == "p"
    t.ended("c1")  # its child becomes a root
    assert t.forest() == {"p": ["c2"]} and t.parent_of("g") is None
    t.ended("c2")
    assert t.forest() == {} and not t.has_children("p")


def test_a_bounded_forest_shows_the_first_parents_and_children_by_id() -> None:
    t = Trees()
    for p in ("p3", "p1", "p2"):
        for c in ("c9", "c1", "c5"):
            assert t.link(f"{p}-{c}", p)
    assert t.forest(2) == {"p1": ["p1-c1", "p1-c5"], "p2": ["p2-c1", "p2-c5"]}
    assert t.forest(2) == {p: kids[:2] for p, kids in list(t.forest().items())[:2]}
    assert len(t) == 9  # every link is still counted


FRESH = WorkerObservation(healthy=True, stale=False, kv_usage=0.0, total_blocks=1000,
                          block_size=16, running=0, sampled_at=0.0)


def _plane(trees: bool = True, priority: str = "session_fcfs",
           **admission: object) -> tuple[ControlPlane, DecisionLog]:
    cfg = load_config(None, environ={}, overrides={
        "workers": ["http://a:1"], "admission": admission, "sessions": {"trees": trees},
        "scheduler": {"priority_policy": priority}})
    log = DecisionLog()
    plane = ControlPlane(cfg, ["a"], tool_cpus=4.0, log=log)
    # Agents: tenant t's sessions come back after a call, so dormant ones hold KV room.
    plane.admission.sessions.returns.record("t", True)
    plane.tick(0.0, {"a": FRESH}, at=0.0, cpu=None)
    return plane, log


def _serve(plane: ControlPlane, now: float, key: str, parent: str | None = None) -> None:
    ans = plane.request(now, key, "t", tokens=200, parent=parent)
    assert ans.kind is DecisionKind.ADMITTED
    plane.confirm(now, key)
    t = plane.call_start(now, key, "a", tokens=200, max_new_tokens=10)
    plane.call_end(now + 1, key, t, incarnation=ans.incarnation, ok=True, admitted=True,
                   prompt_tokens=2000, completion_tokens=10, continues=True)


def test_a_dormant_parent_waits_on_its_child_without_holding_kv() -> None:
    plane, log = _plane()
    _serve(plane, 0.0, "p")
    rec = plane.admission.sessions.get("p")
    assert rec is not None and rec.kv_held and plane.phase("p") is Phase.DORMANT
    retained = plane.scheduler.ledger.reservation("p")
    _serve(plane, 2.0, "c", parent="p")
    assert not rec.kv_held and plane.scheduler.ledger.reservation("p") is None
    kinds = [(e.kind, e.session) for e in log.entries]
    assert ("child", "c") in kinds and ("tree_wait", "p") in kinds
    assert retained is None or ("tree_wait", "p", (retained.blocks,)) in [
        (e.kind, e.session, e.detail) for e in log.entries]
    assert plane.trees.forest() == {"p": ["c"]}
    plane.request(3.0, "p", "t", tokens=2100)  # the parent is back: its hold again
    assert rec.kv_held


def test_trees_off_admits_flat() -> None:
    plane, log = _plane(trees=False)
    _serve(plane, 0.0, "p")
    _serve(plane, 2.0, "c", parent="p")
    assert plane.trees.forest() == {} and "child" not in {e.kind for e in log.entries}
    rec = plane.admission.sessions.get("p")
    assert rec is not None and rec.kv_held


def test_a_child_runs_in_its_parents_place() -> None:
    plane, _ = _plane()
    _serve(plane, 0.0, "p")
    _serve(plane, 1.0, "x")  # arrived after the parent, before the child
    plane.request(2.0, "c", "t", tokens=200, parent="p")
    plane.confirm(2.0, "c")
    t = plane.call_start(2.0, "c", "a", tokens=200, max_new_tokens=10)
    x = plane.call_start(2.0, "x", "a", tokens=200, max_new_tokens=10)
    assert t is not None and x is not None and t.priority is not None and x.priority is not None
    assert t.priority < x.priority  # the parent waits on it: it goes in the parent's place
    plane.trees.ended("c")  # unlinked: its own place, after x
    t2 = plane.call_start(3.0, "c", "a", tokens=200, max_new_tokens=10)
    assert t2 is not None and t2.priority is not None and t2.priority > x.priority


def test_under_las_a_child_runs_at_least_at_its_parents_level() -> None:
    plane, _ = _plane(priority="las")
    _serve(plane, 0.0, "p")
    plane.scheduler.service.add("c", 1e9)  # as if the child had been served a lot already
    plane.request(2.0, "c", "t", tokens=200, parent="p")
    plane.confirm(2.0, "c")
    parent_level = plane.scheduler.level_of("p")
    t = plane.call_start(2.0, "c", "a", tokens=200, max_new_tokens=10)
    assert t is not None and parent_level is not None and t.level is not None
    assert t.level <= parent_level
    plane.trees.ended("c")  # unlinked: the child's own (demoted) level
    t2 = plane.call_start(3.0, "c", "a", tokens=200, max_new_tokens=10)
    assert t2 is not None and t2.level is not None and t2.level > parent_level
