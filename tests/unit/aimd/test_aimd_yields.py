"""Who yields once admitted: a later class, a tenant over its weighted share of the admitted
sessions while another tenant is there; nobody when alone."""

from __future__ import annotations

from marsproxy.aimd.config import ServiceClasses
from marsproxy.aimd.order_index import QueueEntry
from marsproxy.aimd.yields import Yields


def _yields(waiting: dict[str, int], weights: dict[str, float] | None = None) -> Yields:
    w = weights or {}
    return Yields(ServiceClasses(), lambda t: w.get(t, 1.0), lambda: waiting)


def test_a_later_class_yields_the_first_does_not() -> None:
    y = _yields({})
    y.admitted("i", "t", "interactive")
    y.admitted("b", "t", "batch")
    y.admitted("d", "t", None)  # the default class: interactive
    assert (y.rank("i"), y.rank("b"), y.rank("d")) == (0, 1, 0)
    assert y.protected(QueueEntry("i2", "t", 0.0, 10, 100.0, cls="interactive"))
    assert not y.protected(QueueEntry("b2", "t", 0.0, 10, 100.0, cls="batch"))
    y.ended("b")
    assert y.rank("b") == 0  # nothing kept of an ended session


def test_a_tenant_alone_never_yields() -> None:
    y = _yields({})
    for i in range(5):
        y.admitted(f"h{i}", "heavy", None)
    assert not y.over_share("heavy") and not y.yields("h0")
    assert y.protected(QueueEntry("h5", "heavy", 0.0, 10, 100.0, cls="interactive"))


def test_a_tenant_over_its_share_yields_while_another_is_there() -> None:
    waiting = {"light": 1}
    y = _yields(waiting)
    for i in range(4):
        y.admitted(f"h{i}", "heavy", None)
    # light waits: heavy holds 4 of 4 against a half share
    assert y.yields("h0")
    assert y.protected(QueueEntry("l0", "light", 0.0, 10, 100.0, cls="interactive"))
    assert not y.protected(QueueEntry("h4", "heavy", 0.0, 10, 100.0, cls="interactive"))
    waiting.clear()
    y.admitted("l0", "light", None)
    assert y.yields("h0") and not y.yields("l0")  # 4 of 5 against 2.5
    y.ended("l0")
    assert not y.yields("h0")  # light is gone: heavy is alone again


def test_a_one_shot_task_of_the_first_class_leaves_no_room_for_others() -> None:
    # Over its share beside a light tenant, a tenant's sessions yield; those that return wait in
    # the gate for room beside the light tenant's forecasts, its one-shot tasks do not (their KV
    # is gone when their call ends) unless they are of a later class, as they asked.
    tasks = {"t0", "tb"}
    y = Yields(ServiceClasses(), lambda _t: 1.0, lambda: {}, one_shot=tasks.__contains__)
    for k in ("t0", "s0", "s1"):
        y.admitted(k, "heavy", None)
    y.admitted("tb", "heavy", "batch")
    y.admitted("l0", "light", None)
    assert all(y.yields(k) for k in ("t0", "s0", "tb")) and not y.yields("l0")
    assert [y.first_class_task(k) for k in ("t0", "s0", "tb", "l0")] == [True, False, False,
                                                                         False]


def test_weights_set_the_share() -> None:
    y = _yields({}, {"big": 3.0})
    for i in range(3):
        y.admitted(f"b{i}", "big", None)
    y.admitted("s0", "small", None)
    assert not y.over_share("big") and not y.over_share("small")  # 3 of 4 at a 3/4 share
    y.admitted("b3", "big", None)
    assert y.over_share("big") and y.rank("b0") == 1
    y.admitted("x", "big", "batch")
    assert y.rank("x") == 2  # a later class and over its share


def test_between_tenants_that_both_ask_for_more_than_their_share_nobody_yields() -> None:
    waiting = {"a": 3, "b": 3}
    y = _yields(waiting)
    for i in range(4):
        y.admitted(f"a{i}", "a", None)
    y.admitted("b0", "b", None)
    # a holds 4 of 5, but b asks for 4 in all: more than its share; the queue's turns even
    # them out, yielding would only overcommit the KV.
    assert not y.yields("a0")
    waiting["b"] = 0  # b is light now: everything it asks for is within its share
    assert y.yields("a0") and not y.yields("b0")


def test_nobody_yields_with_one_tenant_of_the_first_class() -> None:
    waiting: dict[str, int] = {}
    y = _yields(waiting)
    assert y.nobody()
    y.admitted("a", "t", None)
    waiting["t"] = 3  # its own sessions waiting change nothing
    assert y.nobody()
    waiting["u"] = 1  # another tenant waits: the shares count now
    assert not y.nobody()
    del waiting["u"]
    y.admitted("b", "t", "batch")  # a later class is there
    assert not y.nobody() and y.rank("b") == 1
    y.ended("b")
    assert y.nobody()
    y.admitted("c", "u", None)  # a second tenant admitted
    assert not y.nobody()


def test_a_backlogged_tenant_yields_to_a_light_one_even_at_its_share() -> None:
    # heavy holds 1 of 2 admitted sessions (its share) but asks for 4: it gives way to light,
    # whose whole demand (1) is within its share; the shares alone would say nobody yields.
    waiting = {"heavy": 3}
    y = _yields(waiting)
    y.admitted("h0", "heavy", None)
    y.admitted("l0", "light", None)
    assert y.yields("h0") and not y.yields("l0")
    # light's next session, waiting, would yield to nobody once admitted: it is fitted
    # against the KV of the sessions that do not yield
    waiting["light"] = 1
    assert y.protected(QueueEntry("l1", "light", 0.0, 10, 100.0, cls="interactive"))
    assert not y.yields("h0")  # light asks for 2 of 2 now: both above their share
    del waiting["light"]
    waiting["heavy"] = 0  # heavy asks for its share alone: both light, nobody yields
    assert not y.yields("h0") and not y.yields("l0")


def test_a_session_away_asks_for_nothing_until_it_is_back() -> None:
    # Sessions that hold no slot (a batch key's tasks after their call) are no part of their
    # tenant's demand: heavy (3 admitted) stays over its share beside light (1) however many
    # there are; one that sends another call counts again, and ending an away session, or
    # sending one away twice, takes nothing more off.
    y = _yields({})
    for i in range(3):
        y.admitted(f"h{i}", "heavy", None)
    y.admitted("l0", "light", None)
    for i in range(10):
        y.admitted(f"t{i}", "batch", None)
        y.away(f"t{i}")
    y.away("t0")
    y.ended("t1")
    assert y.yields("h0") and not y.yields("l0") and not y.over_share("batch")
    for i in range(2, 10):
        y.back(f"t{i}")  # 8 in a call: batch asks for 8 of 12 against a third
    assert y.over_share("batch") and not y.over_share("heavy")
    y.back("t2")  # back already: counted once
    for i in range(2, 10):
        y.ended(f"t{i}")
    assert y.yields("h0")
    y.ended("l0")
    assert y.single_tenant("heavy")  # nothing of batch's left counted


def test_a_later_class_session_away_yields_nothing_and_leaves_nobody_yielding() -> None:
    y = _yields({})
    y.admitted("i", "t", "interactive")
    y.admitted("b", "t", "batch")
    assert not y.nobody()
    y.away("b")
    assert y.nobody()
    y.back("b")
    assert not y.nobody() and y.rank("b") == 1
