"""The KV index's part of the state document and its Prometheus families.

``kv_index`` in ``GET /mars/v1/state`` maps each worker with ``kv_events`` configured to what its
index holds and how its event stream goes; the collector turns the same figures into
``marsproxy_kv_*`` families (labels: worker names from config and the medium; never a
session id).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypedDict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class KVIndexWorkerState(TypedDict):
    endpoint: str
    replay_endpoint: str | None
    topic: str
    connected: bool  # the SUB socket has a connection to the publisher
    usable: bool  # connected, in sequence, no replay running: the index answers queries
    block_size: int | None
    blocks: dict[str, int]  # resident blocks by medium (GPU, CPU, ...)
    sessions: int  # sessions with resident GPU blocks
    events_total: int
    batches_total: int
    events_per_s: float
    lag_s: float | None  # receipt time minus the batch's timestamp, for the latest batch
    last_seq: int | None
    pending: int  # batches held back while a gap is replayed
    resyncs_total: int  # gaps that could not be filled, restarts
    replays_total: int
    connects_total: int
    bad_frames_total: int
    unknown_removals_total: int  # removals of blocks the index never saw stored
    engine_blocks: int | None  # the worker's GPU blocks (num_gpu_blocks): the GPU index's cap
    dropped_blocks_total: int  # blocks let go beyond what the engine can hold (lost removals)
    bad_events_total: int  # events that could not be read (skipped, or the index forgot all)
    stale_replay_batches_total: int  # replayed batches of a superseded replay, dropped
    replays_cut_total: int  # replays given up for sending too many batches (an open gap resyncs)
    pending_overflows_total: int  # too many batches or bytes held in a gap (each a resync)


def kv_index_metrics(workers: Mapping[str, KVIndexWorkerState]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily("marsproxy_kv_index_blocks",
                               "Resident KV blocks the worker's events report, by medium.",
                               labels=["worker", "medium"])
    sessions = GaugeMetricFamily("marsproxy_kv_index_sessions",
                                 "Sessions with resident GPU blocks in the worker's KV index.",
                                 labels=["worker"])
    usable = GaugeMetricFamily("marsproxy_kv_index_usable",
                               "1 while the worker's KV index is connected and in sequence.",
                               labels=["worker"])
    lag = GaugeMetricFamily("marsproxy_kv_events_lag_seconds",
                            "Receipt time minus the engine's timestamp of the latest batch.",
                            labels=["worker"])
    events = CounterMetricFamily("marsproxy_kv_events", "KV events applied to the index.",
                                 labels=["worker"])
    resyncs = CounterMetricFamily(
        "marsproxy_kv_index_resyncs",
        "Times the worker's KV index started over (unfillable gap, restart).",
        labels=["worker"])
    dropped = CounterMetricFamily(
        "marsproxy_kv_index_dropped_blocks",
        "Blocks the worker's KV index let go beyond what the engine can hold (lost removals).",
        labels=["worker"])
    bad = CounterMetricFamily(
        "marsproxy_kv_events_unreadable",
        "KV event frames and events the proxy could not read (skipped or forgotten).",
        labels=["worker"])
    for w, s in workers.items():
        for medium, n in s["blocks"].items():
            blocks.add_metric([w, medium], n)
        sessions.add_metric([w], s["sessions"])
        usable.add_metric([w], 1 if s["usable"] else 0)
        if s["lag_s"] is not None:
            lag.add_metric([w], s["lag_s"])
        events.add_metric([w], s["events_total"])
        resyncs.add_metric([w], s["resyncs_total"])
        dropped.add_metric([w], s["dropped_blocks_total"])
        bad.add_metric([w], s["bad_frames_total"] + s["bad_events_total"])
    yield from (blocks, sessions, usable, lag, events, resyncs, dropped, bad)
