"""AdmissionCore with service classes and tenant shares: the class goes through to the queue,
a refusal names its reason, and a response's uncached tokens are charged to its tenant."""

from __future__ import annotations

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig

FREE = WorkerSignals(kv_usage=0.0, free_blocks=10_000, total_blocks=10_000, block_size=16)


def test_the_class_reaches_the_queue_and_sets_the_deadline() -> None:
    core = AdmissionCore(AdmissionConfig(queue_deadline_s=60.0), ["w"])  # all stale: all wait
    d = core.on_request(0.0, "b", "t", 100, cls="batch")
    assert d.kind is DecisionKind.WAIT
    e = core.queue.get("b")
    assert e is not None and e.cls == "batch" and e.deadline == 3600.0
    assert core.on_request(0.0, "i", "t", 100).kind is DecisionKind.WAIT
    assert [x.session for x in core.queue.ordered(1.0)] == ["i", "b"]


def test_a_tenant_over_its_share_is_refused_with_that_reason() -> None:
    core = AdmissionCore(AdmissionConfig(queue_max=4), ["w"])
    for i in range(2):
        assert core.on_request(0.0, f"a{i}", "a", 100).kind is DecisionKind.WAIT
    assert core.on_request(0.0, "b0", "b", 100).kind is DecisionKind.WAIT
    d = core.on_request(0.0, "a2", "a", 100)
    assert d.kind is DecisionKind.REJECT and d.status == 429
    assert d.reason == "tenant_over_share" and d.retry_after_s is not None


def test_uncached_prompt_and_completion_are_charged_to_the_tenant() -> None:
    core = AdmissionCore(AdmissionConfig(), ["w"])
    core.tick(0.0, {"w": FREE})
    assert core.on_request(0.0, "s", "t", 100).kind is DecisionKind.ADMITTED
    before = core.queue.shares.tag("t")
    core.on_response_end(1.0, "s", prompt_tokens=1000, cached_tokens=800, completion_tokens=50)
    # 250 served, of which the admission's credit (its estimate, 100) was charged already.
    assert core.queue.shares.tag("t") == before + 150
