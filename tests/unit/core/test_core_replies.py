"""Which worker made each reply (core/replies.py): scoped by tenant, the least recently named
forgotten first, ids kept as hashes only."""

from marsproxy.core.replies import ReplyWorkers, reply_hash, reply_key


def test_the_latest_replies_name_their_workers_per_tenant() -> None:
    r = ReplyWorkers(cap=2)
    r.made("t", "resp_1", "w0")
    r.made("t", "resp_2", "w1")
    assert (r.worker("t", "resp_1"), r.worker("u", "resp_1")) == ("w0", None)
    r.made("t", "resp_3", "w0")  # over the cap: resp_2 was named least recently
    assert [r.worker("t", k) for k in ("resp_1", "resp_2", "resp_3")] == ["w0", None, "w0"]
    r.made("t", "resp_1", "w1")  # made again elsewhere (a retry): the latest counts
    assert r.worker("t", "resp_1") == "w1" and len(r) == 2


def test_workers_that_keep_no_reply_of_an_id_are_believed_for_a_while() -> None:
    r = ReplyWorkers(cap=2)
    r.denied("t", "resp_1", frozenset({"w0"}), until=10.0)
    assert (r.deniers("t", "resp_1", 9.0), r.worker("t", "resp_1")) == (frozenset({"w0"}), None)
    assert r.deniers("t", "resp_1", 10.0) == frozenset()  # past it: asked again
    assert r.deniers("u", "resp_1", 9.0) == frozenset()  # per tenant
    r.denied("t", "resp_1", frozenset({"w0", "w1"}), until=20.0)
    assert r.deniers("t", "resp_1", 15.0) == frozenset({"w0", "w1"})
    r.made("t", "resp_1", "w2")  # a worker made it: that is what counts
    r.denied("t", "resp_1", frozenset({"w0"}), until=30.0)
    assert (r.worker("t", "resp_1"), r.deniers("t", "resp_1", 25.0)) == ("w2", frozenset())
    r.denied("t", "resp_2", frozenset({"w0"}), until=30.0)
    r.denied("t", "resp_3", frozenset({"w0"}), until=30.0)  # over the cap: resp_1 goes
    assert (r.worker("t", "resp_1"), len(r)) == (None, 2)


def test_ids_are_kept_as_hashes() -> None:
    assert len(reply_hash("resp_" + "x" * 10_000)) == 16
    assert reply_hash("a\udcff") != reply_hash("a")  # any str hashes, lone surrogates too
    key = reply_key("t", "resp_secret")
    assert key.startswith("t:") and "secret" not in key
