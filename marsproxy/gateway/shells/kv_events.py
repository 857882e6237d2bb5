"""The asyncio shell of the KV index: subscribes to each worker's KV event stream.

For every worker with ``kv_events`` configured: a SUB socket on its endpoint and topic feeds a
:class:`~marsproxy.probes.kv_index.KVIndex`; a gap (or a (re)connection) asks the worker's
replay socket for the missing batches through a short-lived DEALER. All of it runs in its own
tasks: the request path only reads the indexes, which answer in time proportional to the
prompt's blocks and never wait.

A publisher that is down, never answers or sends garbage leaves its worker without an index:
:meth:`KVEventsShell.resident_prefix_tokens` and :meth:`session_blocks` answer None, and the
proxy behaves exactly as without ``kv_events``. ZMQ reconnects by itself; each new connection
starts the index over from the publisher's replay buffer (the worker may have restarted).
A frame it cannot read is counted and skipped; a batch whose number is readable and whose
payload is not counts as one that may have removed any block. A frame over
``max_message_bytes`` drops its connection (ZMQ's MAXMSGSIZE): the index starts over, or the
replay is given up. A replay the index no longer waits for (a reconnection superseded it, or
it ran too long) is hung up on. An error of the index itself starts that worker's index over
rather than ending its task.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.probes.config import KVEventsSourceConfig, KVEventsTuning
from marsproxy.probes.kv_index import MEDIUM_GPU, KVIndex, Step
from marsproxy.probes.kv_wire import (
    END_SEQ,
    EventBatch,
    WireError,
    batch_seq,
    decode_batch,
    replay_request,
    unreadable_batch,
)
from marsproxy.telemetry.kv_index import KVIndexWorkerState

log = logging.getLogger("marsproxy.gateway.shells.kv_events")


def sets_session_id(cfg: MarsConfig) -> bool:
    """Whether relayed requests carry the proxy's session key as ``session_id``."""
    mode = cfg.probes.kv_events.session_id
    return mode == "always" or (mode == "auto" and any(w.kv_events for w in cfg.workers))


class _Source:
    """One worker's subscription: its index and what the state document shows of the link."""

    def __init__(self, worker: WorkerConfig, src: KVEventsSourceConfig, cfg: KVEventsTuning):
        self.label = worker.label
        self.src = src
        self.index = KVIndex(replay=src.replay_endpoint is not None,
                             max_pending=cfg.max_pending_batches,
                             max_pending_bytes=cfg.max_pending_bytes,
                             rate_window_s=cfg.rate_window_s)
        self.connected = False
        self.connects_total = 0
        self.bad_frames_total = 0
        self.replays_total = 0
        self.replays: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # (start, replay id)

    @property
    def usable(self) -> bool:
        ix = self.index
        return self.connected and ix.synced and not ix.replaying


class KVEventsShell:
    def __init__(self, cfg: MarsConfig, wall: Callable[[], float] = time.time,
                 engine_blocks: Callable[[str], int | None] = lambda _: None) -> None:
        self.cfg = cfg.probes.kv_events
        self.tuning = cfg.probes.tuning.kv_events
        self.wall = wall
        self._engine_blocks = engine_blocks  # the worker's num_gpu_blocks, as scraped
        self.sources: dict[str, _Source] = {
            w.label: _Source(w, w.kv_events, self.tuning) for w in cfg.workers if w.kv_events
        }
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for s in self.sources.values():
            for coro, name in ((self._subscribe(s), "sub"), (self._replayer(s), "replay")):
                task = asyncio.create_task(coro, name=f"kv-{name}-{s.label}")
                task.add_done_callback(functools.partial(self._died, s))
                self._tasks.append(task)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @staticmethod
    def _died(s: _Source, task: asyncio.Task[None]) -> None:
        """A subscriber task that ended other than by cancellation: the worker has no index
        from now on (never a stale one)."""
        s.connected = False
        if not task.cancelled() and task.exception() is not None:
            log.error("KV events of %s: subscriber died", s.label, exc_info=task.exception())

    # -- reading (the request path and the state document) --------------------------------------

    def index(self, worker: str) -> KVIndex | None:
        """The worker's index while it is connected and in sequence; else None (no index)."""
        s = self.sources.get(worker)
        return s.index if s is not None and s.usable else None

    def resident_prefix_tokens(
        self, worker: str, token_ids: Sequence[int], medium: str = MEDIUM_GPU
    ) -> int | None:
        ix = self.index(worker)
        return None if ix is None else ix.resident_prefix_tokens(token_ids, medium)

    def session_blocks(self, worker: str, session: str, medium: str = MEDIUM_GPU) -> int | None:
        ix = self.index(worker)
        return None if ix is None else ix.session_blocks(session, medium)

    def state(self) -> dict[str, KVIndexWorkerState]:
        now = self.wall()
        out: dict[str, KVIndexWorkerState] = {}
        for label, s in self.sources.items():
            ix = s.index
            out[label] = {
                "endpoint": s.src.endpoint, "replay_endpoint": s.src.replay_endpoint,
                "topic": s.src.topic, "connected": s.connected, "usable": s.usable,
                "block_size": ix.block_size, "blocks": ix.blocks_by_medium(),
                "sessions": ix.sessions(), "events_total": ix.events_total,
                "batches_total": ix.batches_total, "events_per_s": ix.events_per_s(now),
                "lag_s": ix.last_lag_s, "last_seq": ix.last_seq, "pending": ix.pending,
                "resyncs_total": ix.resyncs_total, "replays_total": s.replays_total,
                "connects_total": s.connects_total, "bad_frames_total": s.bad_frames_total,
                "unknown_removals_total": ix.unknown_removals_total,
                "engine_blocks": ix.engine_blocks,
                "dropped_blocks_total": ix.dropped_blocks_total,
                "bad_events_total": ix.bad_events_total,
                "stale_replay_batches_total": ix.stale_replay_batches_total,
                "replays_cut_total": ix.replays_cut_total,
                "pending_overflows_total": ix.pending_overflows_total,
            }
        return out

    # -- the subscriber -------------------------------------------------------------------------

    async def _subscribe(self, s: _Source) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RECONNECT_IVL, int(self.tuning.reconnect_s * 1000))
        sub.setsockopt(zmq.MAXMSGSIZE, self.tuning.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, s.src.topic.encode())
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sub.connect(s.src.endpoint)
        watch = asyncio.create_task(self._watch(s, sub, monitor), name=f"kv-monitor-{s.label}")
        try:
            while True:
                self._on_frames(s, await sub.recv_multipart())
                # A frame already queued is read without a pause: without this, a burst (a
                # backlog after a stall) would be applied in one go while requests wait.
                await asyncio.sleep(0)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch(self, s: _Source, sub: zmq.asyncio.Socket,
                     monitor: zmq.asyncio.Socket) -> None:
        retried = True
        while True:
            if not retried and not await monitor.poll(int(self.tuning.reconnect_s * 1000)):
                # ZMQ retries a lost connection at once (EVENT_CONNECT_RETRIED), but never one
                # it dropped for a protocol error, such as a frame over max_message_bytes.
                s.bad_frames_total += 1
                log.warning("KV events of %s: %s sent what ZMQ refused; reconnecting",
                            s.label, s.src.endpoint)
                sub.disconnect(s.src.endpoint)
                sub.connect(s.src.endpoint)
                retried = True
                continue
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            retried = event != zmq.EVENT_DISCONNECTED
            if event == zmq.EVENT_CONNECTED:
                s.connected = True
                s.connects_total += 1
                log.info("KV events of %s: connected to %s", s.label, s.src.endpoint)
                self._ask_replay(s, s.index.begin())
            elif event == zmq.EVENT_DISCONNECTED:
                s.connected = False
                log.warning("KV events of %s: publisher %s went away", s.label, s.src.endpoint)

    def _on_frames(self, s: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != s.src.topic.encode():
            s.bad_frames_total += 1  # a longer topic with ours as prefix, or not vLLM's framing
            return
        try:
            seq = batch_seq(frames[1])
        except WireError as exc:  # its place in the stream is unknown: as if never sent
            s.bad_frames_total += 1
            log.debug("KV events of %s: bad frame: %s", s.label, exc)
            return
        self._feed(s, seq, frames[2])

    def _decode(self, s: _Source, payload: bytes) -> EventBatch:
        try:
            return decode_batch(payload)
        except WireError as exc:  # counted by the index, as one unreadable event
            log.debug("KV events of %s: bad payload: %s", s.label, exc)
            return unreadable_batch(self.wall(), str(exc))

    def _feed(self, s: _Source, seq: int, payload: bytes, replay: int | None = None) -> None:
        batch = self._decode(s, payload)
        s.index.engine_blocks = self._engine_blocks(s.label)
        try:
            step = s.index.on_batch(seq, batch, self.wall(), replay=replay, size=len(payload))
        except Exception:  # a defect of the index: never believe it, never end the task
            log.exception("KV events of %s: the index failed on batch %d; starting over",
                          s.label, seq)
            step = s.index.begin()
        self._ask_replay(s, step)

    @staticmethod
    def _ask_replay(s: _Source, step: Step) -> None:
        if step.replay_from is not None:
            # The newest request supersedes any not yet served (each (re)connection starts
            # the index over): a publisher that flaps must not queue replays without bound.
            while not s.replays.empty():
                s.replays.get_nowait()
            s.replays.put_nowait((step.replay_from, step.replay_id))

    # -- replays --------------------------------------------------------------------------------

    async def _replayer(self, s: _Source) -> None:
        while True:
            start, rid = await s.replays.get()
            if s.src.replay_endpoint is None:
                s.index.replay_done(self.wall(), rid)
                continue
            s.replays_total += 1
            try:
                await self._replay(s, s.src.replay_endpoint, start, rid)
            except (zmq.ZMQError, WireError) as exc:
                log.warning("KV events of %s: replay from %d failed: %s", s.label, start, exc)
            except Exception:  # a defect: the gap stays open (resync), the task goes on
                log.exception("KV events of %s: replay from %d failed", s.label, start)
            s.index.replay_done(self.wall(), rid)

    async def _replay(self, s: _Source, endpoint: str, start: int, rid: int) -> None:
        assert self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.tuning.max_message_bytes)
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart(replay_request(start))
            while s.index.awaits(rid):
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(),
                                                    self.tuning.replay_timeout_s)
                except TimeoutError:
                    log.warning("KV events of %s: replay from %d timed out", s.label, start)
                    return
                if len(frames) != 4:
                    raise WireError(f"replay answer has {len(frames)} frames, not 4")
                if frames[2] == END_SEQ:
                    return
                self._feed(s, batch_seq(frames[2]), frames[3], rid)
                await asyncio.sleep(0)  # as in _subscribe: a replay is a burst
        finally:
            dealer.close(linger=0)
