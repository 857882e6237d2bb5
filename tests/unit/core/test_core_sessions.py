from typing import Any

from marsproxy.core.canon import History, Reply, chat_reply_unit, chat_units
from marsproxy.core.sessions import SessionTable, Turn

SYS = {"role": "system", "content": "You are an agent."}
TASK = {"role": "user", "content": "Fix the bug in foo.py"}


def chat(*msgs: dict[str, Any]) -> History:
    return History.of_units(chat_units(msgs))


def reply(text: str) -> Reply:
    return Reply((chat_reply_unit(text, []),))


def asst(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def table(**kw: Any) -> SessionTable:
    return SessionTable(idle_ttl_s=kw.pop("ttl", 100.0), max_sessions=kw.pop("cap", 1000), **kw)


def start(
    t: SessionTable,
    h: History | None,
    now: float = 0.0,
    tenant: str = "t",
    sid: str | None = None,
    final: bool = False,
) -> Turn:
    return t.start(tenant=tenant, explicit_id=sid, history=h, final=final, now=now)


def test_two_concurrent_identical_starts_are_two_sessions_and_continue_apart() -> None:
    t = table()
    a = start(t, chat(SYS, TASK))
    b = start(t, chat(SYS, TASK))
    assert a.session != b.session and a.source == b.source == "new"
    t.finish(a, ok=True, reply=reply("A1"), now=1)
    t.finish(b, ok=True, reply=reply("B1"), now=1)
    b2 = start(t, chat(SYS, TASK, asst("B1"), {"role": "user", "content": "obs b"}), now=2)
    a2 = start(t, chat(SYS, TASK, asst("A1"), {"role": "user", "content": "obs a"}), now=2)
    assert (a2.session, a2.source) == (a.session, "chain")
    assert (b2.session, b2.source) == (b.session, "chain")


def test_identical_start_after_success_is_a_new_session() -> None:
    t = table()
    a = start(t, chat(SYS, TASK))
    t.finish(a, ok=True, reply=reply("A1"), now=1)
    again = start(t, chat(SYS, TASK), now=2)
    assert again.session != a.session


def test_retry_after_failure_maps_to_the_same_session() -> None:
    t = table()
    a = start(t, chat(SYS, TASK))
    t.finish(a, ok=True, reply=reply("A1"), now=1)
    msgs = (SYS, TASK, asst("A1"), {"role": "user", "content": "obs"})
    a2 = start(t, chat(*msgs), now=2)
    t.finish(a2, ok=False, reply=None, now=3)
    retry = start(t, chat(*msgs), now=4)
    assert (retry.session, retry.source) == (a.session, "chain")
    # The retry succeeded: continuing from it still works.
    t.finish(retry, ok=True, reply=reply("A2"), now=5)
    a3 = start(t, chat(*msgs, asst("A2"), {"role": "user", "content": "obs2"}), now=6)
    assert a3.session == a.session


def test_first_request_retry_after_failure_is_the_same_session() -> None:
    t = table()
    a = start(t, chat(SYS, TASK))
    t.finish(a, ok=False, reply=None, now=1)
    assert start(t, chat(SYS, TASK), now=2).session == a.session


def test_continuation_must_include_the_reply() -> None:
    t = table()
    a = start(t, chat(SYS, TASK))
    t.finish(a, ok=True, reply=reply("A1"), now=1)
    wrong = start(t, chat(SYS, TASK, asst("something else"), {"role": "user", "content": "x"}))
    assert wrong.session != a.session


def test_identical_histories_pick_distinct_sessions() -> None:
    # Deterministic models can give two runs the same reply; each session is claimed once.
    t = table()
    a, b = start(t, chat(SYS, TASK)), start(t, chat(SYS, TASK))
    t.finish(a, ok=True, reply=reply("same"), now=1)
    t.finish(b, ok=True, reply=reply("same"), now=1)
    nxt = chat(SYS, TASK, asst("same"), {"role": "user", "content": "obs"})
    got = {start(t, nxt, now=2).session, start(t, nxt, now=2).session}
    assert got == {a.session, b.session}


def test_tenants_never_share_sessions() -> None:
    t = table()
    a = start(t, chat(SYS, TASK), tenant="x")
    t.finish(a, ok=True, reply=reply("A1"), now=1)
    other = start(t, chat(SYS, TASK, asst("A1"), {"role": "user", "content": "o"}), tenant="y")
    assert other.session != a.session
    assert (
        start(t, None, sid="s", tenant="x").session != start(t, None, sid="s", tenant="y").session
    )


def test_explicit_ids_need_no_reply_capture() -> None:
    t = table()
    turn = start(t, chat(SYS, TASK), sid="abc")
    assert not turn.capture_reply and turn.source == "header"
    assert start(t, None, sid="abc").session == turn.session


def test_final_turn_forgets_the_session() -> None:
    forgotten: list[str] = []
    t = table(on_forget=forgotten.append)
    first = start(t, None, sid="s")
    t.finish(first, ok=True, reply=None, now=1)
    last = start(t, None, sid="s", final=True, now=2)
    assert forgotten == []
    t.finish(last, ok=True, reply=None, now=3)
    assert forgotten == [first.session] and t.get(first.session) is None


def test_failed_final_turn_keeps_the_session_for_the_retry() -> None:
    t = table()
    last = start(t, None, sid="s", final=True)
    t.finish(last, ok=False, reply=None, now=1)
    assert t.get(last.session) is not None


def test_idle_sessions_expire() -> None:
    forgotten: list[str] = []
    t = table(ttl=10.0, on_forget=forgotten.append)
    a = start(t, None, sid="a", now=0)
    t.finish(a, ok=True, reply=None, now=1)
    b = start(t, None, sid="b", now=5)
    t.finish(b, ok=True, reply=None, now=6)
    t.expire(now=12)
    assert forgotten == [a.session] and len(t) == 1


def test_a_session_with_a_request_in_flight_is_not_idle() -> None:
    # Held for admission or streaming longer than the TTL: still in use, never forgotten.
    forgotten: list[str] = []
    t = table(ttl=10.0, on_forget=forgotten.append)
    busy = start(t, None, sid="busy", now=0)
    idle = start(t, None, sid="idle", now=1)
    t.finish(idle, ok=True, reply=None, now=2)
    t.expire(now=15)
    assert forgotten == [idle.session] and t.get(busy.session) is not None
    t.finish(busy, ok=True, reply=None, now=30)
    t.expire(now=39)
    assert t.get(busy.session) is not None  # idle since its request ended: 9 s < 10 s
    t.expire(now=41)
    assert forgotten == [idle.session, busy.session]


def test_lru_cap_forgets_least_recently_seen() -> None:
    forgotten: list[str] = []
    t = table(cap=2, on_forget=forgotten.append)
    a = start(t, None, sid="a", now=0)
    b = start(t, None, sid="b", now=1)
    start(t, None, sid="a", now=2)  # touch a: b is now the least recently seen
    start(t, None, sid="c", now=3)
    assert forgotten == [b.session] and t.get(a.session) is not None


def test_expired_chain_session_is_unindexed() -> None:
    t = table(ttl=10.0)
    a = start(t, chat(SYS, TASK), now=0)
    t.finish(a, ok=True, reply=reply("A1"), now=1)
    later = start(t, chat(SYS, TASK, asst("A1"), {"role": "user", "content": "o"}), now=50)
    assert later.session != a.session and later.source == "new"


def test_completion_prompt_prefix_rule() -> None:
    t = table()
    a = start(t, History.of_text("Q: 1+1?\nA:"))
    t.finish(a, ok=True, reply=Reply(text=" 2"), now=1)
    same = start(t, History.of_text("Q: 1+1?\nA: 2\nQ: 2+2?\nA:"), now=2)
    assert same.session == a.session
    t.finish(same, ok=True, reply=Reply(text=" 4"), now=3)
    miss = start(t, History.of_text("Q: 1+1?\nA: 3\nQ:"), now=4)
    assert miss.session != a.session


def test_token_prompts_extend_previous_prompt() -> None:
    t = table()
    a = start(t, History.of_tokens([1, 2, 3]))
    t.finish(a, ok=True, reply=Reply(text="x"), now=1)
    assert start(t, History.of_tokens([1, 2, 3]), now=2).session != a.session
    assert start(t, History.of_tokens([1, 2, 3, 9, 9]), now=2).session == a.session


def test_without_chain_matching_every_idless_request_is_its_own_session() -> None:
    forgotten: list[str] = []
    t = table(chain_matching=False, on_forget=forgotten.append)
    a = start(t, chat(SYS, TASK))
    t.finish(a, ok=True, reply=None, now=1)
    assert forgotten == [a.session] and len(t) == 0


def test_key_after_reply_equals_the_hash_of_the_echoed_history() -> None:
    h = chat(SYS, TASK)
    longer = chat(SYS, TASK, asst("A1"), {"role": "user", "content": "obs"})
    assert h.key_after(reply("A1")) == (3, longer.prefix_hash(3))
    t = History.of_text("abc")
    assert t.key_after(Reply(text="dé")) == (6, History.of_text("abcdé and more").prefix_hash(6))
    k = History.of_tokens([1, 2])
    assert (
        k.key_after(Reply(text="x")) == k.key() == (2, History.of_tokens([1, 2, 3]).prefix_hash(2))
    )


def test_a_request_of_a_forgotten_session_ends_as_its_own_not_as_a_new_sessions_of_its_id(
) -> None:
    t = table()
    old = start(t, None, sid="x", final=True)
    t.forget("t/id/x")  # DELETE while its (final) request runs
    new = start(t, None, 1.0, sid="x")  # the id reused at once
    t.finish(old, ok=True, reply=None, now=2.0)  # the old request ends, well
    sess = t.get("t/id/x")  # the new session neither ended by its flag nor out of its call
    assert sess is not None and sess.in_flight == 1
    assert t.of(new) is sess and t.of(old) is None
