"""Test oracle: the engine model as first written (straightforward, O(context) per call).

A frozen copy of marsproxy/emulator/{kv_cache,engine}.py before the performance work: every step
re-walks the prompt's hash chain and sums its hit blocks, hashes every prompt block with a slice
per block, keeps block state in objects. tests/unit/emulator/test_emulator_fast_path.py drives it
and the package's engine with the same seeded workloads and requires identical results. Do not
optimise this file; it is the specification the fast path is checked against. The KV cache part
is in reference_kv_cache.py (split off to keep each file under 400 lines).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from marsproxy.emulator.engine import Policy
from marsproxy.emulator.profiles import EngineProfile
from marsproxy.emulator.request import FinishedEvent, RequestError
from marsproxy.emulator.step_time import StepBatch, step_duration
from marsproxy.emulator.tokenizer import filler_token_id

from .reference_kv_cache import KVCache, KVSeq


@dataclass(eq=False)
class EngineRequest:
    req_id: str
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    target_output: int  # tokens to generate before finishing
    final_reason: str  # finish_reason once target_output is reached
    priority: int
    arrival_time: float
    seq: int  # arrival counter, breaks ties between equal arrival times
    num_computed: int = 0  # tokens whose KV is computed
    cached_tokens: int | None = None  # prefix-cache hit at first scheduling (usage field)
    pending_preemptions: int = 0  # preemptions not yet reported (see StepResult)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    finish_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    kv: KVSeq = field(default_factory=KVSeq)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def finished_event(self) -> FinishedEvent:
        assert self.first_token_time is not None and self.finish_time is not None
        return FinishedEvent(
            req_id=self.req_id,
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=self.num_output,
            finish_reason=self.final_reason,
            num_preemptions=self.num_preemptions,
            arrival_time=self.arrival_time,
            first_scheduled_time=(
                self.first_scheduled_time
                if self.first_scheduled_time is not None
                else self.arrival_time
            ),
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            token_gaps=tuple(self.token_gaps),
        )


@dataclass
class RefStepResult:
    """Outcome of one step. Events happen at ``now + duration``."""

    duration: float
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    first_token: list[str] = field(default_factory=list)
    finished: list[FinishedEvent] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Preemptions as real vLLM 0.32 *reports* them: when the preempted request emits again.
    preemptions_reported: int = 0
    # Prompt lengths of requests that got their first token (how vllm:prompt_tokens counts).
    prompt_tokens: int = 0
    generation_tokens: int = 0
    batch: StepBatch = field(default_factory=StepBatch)


@dataclass
class RefEngineStats:
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int  # counted when they happen


class _FcfsQueue:
    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def push(self, req: EngineRequest) -> None:
        self._q.append(req)

    def push_front(self, req: EngineRequest) -> None:
        self._q.appendleft(req)

    def peek(self) -> EngineRequest:
        return self._q[0]

    def pop(self) -> EngineRequest:
        return self._q.popleft()

    def remove(self, req: EngineRequest) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)


class _PriorityQueue:
    """Lower ``priority`` first, ties by arrival; preempted requests keep their original key."""

    def __init__(self) -> None:
        self._h: list[tuple[int, float, int, EngineRequest]] = []

    def push(self, req: EngineRequest) -> None:
        heapq.heappush(self._h, (req.priority, req.arrival_time, req.seq, req))

    push_front = push

    def peek(self) -> EngineRequest:
        return self._h[0][3]

    def pop(self) -> EngineRequest:
        return heapq.heappop(self._h)[3]

    def remove(self, req: EngineRequest) -> None:
        self._h = [e for e in self._h if e[3] is not req]
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)


class ReferenceEngine:
    def __init__(self, profile: EngineProfile, policy: Policy = "fcfs") -> None:
        self.profile = profile
        self.policy: Policy = policy
        self.kv = KVCache(profile.block_size, profile.num_blocks)
        self._waiting: _FcfsQueue | _PriorityQueue = (
            _PriorityQueue() if policy == "priority" else _FcfsQueue()
        )
        self._running: list[EngineRequest] = []
        self._requests: dict[str, EngineRequest] = {}
        self._seq = 0
        self.num_preemptions = 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int | None,
        ignore_eos: bool = False,
        priority: int = 0,
        now: float = 0.0,
    ) -> EngineRequest:
        """Queue a request. Raises :class:`RequestError` for prompts that cannot be served."""
        if req_id in self._requests:
            raise RequestError(f"duplicate request id {req_id!r}")
        prof = self.profile
        n = len(prompt_token_ids)
        max_len = prof.effective_max_model_len
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request"
                f" has {n} input tokens. Please reduce the length of the input messages."
            )
        if max_tokens is not None and max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        room = max_len - n
        limit = room if max_tokens is None else min(max_tokens, room)
        if ignore_eos or prof.natural_output_tokens >= limit:  # max_tokens ends it
            target, reason = limit, "length"
        else:
            target, reason = prof.natural_output_tokens, "stop"
        self._seq += 1
        req = EngineRequest(
            req_id=req_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=n,
            target_output=target,
            final_reason=reason,
            priority=priority if self.policy == "priority" else 0,
            arrival_time=now,
            seq=self._seq,
        )
        self.kv.extend_hashes(req.kv, req.token_ids)
        self._requests[req_id] = req
        self._waiting.push(req)
        return req

    def abort(self, req_id: str, now: float) -> bool:
        """Drop a request (client went away); frees its blocks. False if unknown or finished."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self.kv.free(req.kv)
        req.finish_time = now
        return True

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def has_work(self) -> bool:
        return bool(self._running) or len(self._waiting) > 0

    def stats(self) -> RefEngineStats:
        return RefEngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
        )

    # -- scheduling --------------------------------------------------------------------------
    def _pick_victim(self) -> EngineRequest:
        if self.policy == "priority":
            return max(self._running, key=lambda r: (r.priority, r.arrival_time, r.seq))
        return self._running[-1]

    def _preempt(self, req: EngineRequest, result: RefStepResult) -> None:
        self._running.remove(req)
        self.kv.free(req.kv)
        req.num_computed = 0
        req.pending_preemptions += 1
        req.num_preemptions += 1
        self.num_preemptions += 1
        result.preempted.append(req.req_id)
        self._waiting.push_front(req)

    def step(self, now: float) -> RefStepResult:
        """Run one iteration starting at ``now``; returns what happened and how long it took."""
        result = RefStepResult(duration=0.0)
        budget = self.profile.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # req_id -> tokens scheduled this step

        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self.kv.allocate(req.kv, req.num_computed + num_new):
                victim = self._pick_victim()
                if victim.req_id in scheduled:  # give back what it got earlier this step
                    budget += scheduled.pop(victim.req_id)
                    i -= 1
                self._preempt(victim, result)
                if victim is req:
                    num_new = 0
                    break
            if num_new == 0:
                continue  # ``req`` left the running list; index i now points at the next one
            scheduled[req.req_id] = num_new
            budget -= num_new
            i += 1

        if not result.preempted:
            while (
                len(self._waiting) > 0
                and budget > 0
                and len(self._running) < self.profile.max_num_seqs
            ):
                req = self._waiting.peek()
                hit = self.kv.find_prefix(req.kv, req.num_tokens)
                num_cached = len(hit) * self.kv.block_size
                num_new = min(req.num_tokens - num_cached, budget)
                if not self.kv.allocate(req.kv, num_cached + num_new, hit):
                    break
                self._waiting.pop()
                self.kv.stats.queries += req.num_tokens
                self.kv.stats.hits += num_cached
                req.num_computed = num_cached
                if req.cached_tokens is None:
                    req.cached_tokens = num_cached
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                self._running.append(req)
                scheduled[req.req_id] = num_new
                budget -= num_new

        return self._execute(now, scheduled, result)

    def _execute(
        self, now: float, scheduled: dict[str, int], result: RefStepResult
    ) -> RefStepResult:
        batch = result.batch
        for req_id, num_new in scheduled.items():
            req = self._requests[req_id]
            if num_new == 1 and req.num_output > 0 and req.num_computed == req.num_tokens - 1:
                batch.add_decode(req.num_computed + 1)
            else:
                batch.add_prefill(num_new, req.num_computed)
        result.duration = step_duration(self.profile.step, batch)
        t_end = now + result.duration

        finished: list[EngineRequest] = []
        for req_id, num_new in scheduled.items():
            req = self._requests[req_id]
            req.num_computed += num_new
            if req.num_computed < req.num_tokens:
                self.kv.cache_full_blocks(req.kv, req.num_computed)
                continue  # partial prefill chunk: no token sampled yet
            tok = filler_token_id(req.num_output)
            req.token_ids.append(tok)
            self.kv.extend_hashes(req.kv, req.token_ids)
            self.kv.cache_full_blocks(req.kv, req.num_computed)
            result.new_tokens[req_id] = [tok]
            result.generation_tokens += 1
            if req.pending_preemptions:
                result.preemptions_reported += req.pending_preemptions
                req.pending_preemptions = 0
            if req.first_token_time is None:
                req.first_token_time = t_end
                result.first_token.append(req_id)
                result.prompt_tokens += req.num_prompt_tokens
            else:
                req.token_gaps.append(t_end - req.last_token_time)
            req.last_token_time = t_end
            if req.num_output >= req.target_output:
                finished.append(req)

        for req in finished:
            self._running.remove(req)
            del self._requests[req.req_id]
            self.kv.free(req.kv)
            req.finish_time = t_end
            result.finished.append(req.finished_event())
        return result
