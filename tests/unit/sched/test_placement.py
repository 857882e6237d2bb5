from marsproxy.sched.placement import Placement

W = ["a", "b", "c"]


def test_new_sessions_go_to_least_loaded_ties_by_config_order() -> None:
    p = Placement(W)
    assert [p.assign(s, W) for s in ("s1", "s2", "s3", "s4")] == ["a", "b", "c", "a"]
    assert p.load() == {"a": 2, "b": 1, "c": 1}


def test_affinity_while_healthy() -> None:
    p = Placement(W)
    p.assign("s1", W)
    p.assign("s2", W)
    for _ in range(3):
        assert p.assign("s1", W) == "a"
        assert p.assign("s2", W) == "b"


def test_session_moves_when_its_worker_is_unhealthy_and_stays_moved() -> None:
    p = Placement(W)
    assert p.assign("s1", W) == "a"
    p.assign("s2", W)  # b has one
    assert p.assign("s1", ["b", "c"]) == "c"
    assert p.load() == {"a": 0, "b": 1, "c": 1}
    assert p.assign("s1", W) == "c"  # a is back, but the session stays where its cache is


def test_exclude_and_no_worker() -> None:
    p = Placement(W)
    assert p.assign("s1", W, exclude={"a"}) == "b"
    assert p.assign("s2", []) is None
    assert p.worker_of("s2") is None
    assert p.assign("s1", []) is None and p.worker_of("s1") == "b"


def test_release_frees_the_slot() -> None:
    p = Placement(W)
    p.assign("s1", W)
    p.release("s1")
    p.release("unknown")
    assert p.load()["a"] == 0 and p.worker_of("s1") is None
