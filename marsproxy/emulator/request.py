"""Per-request state of the emulated engine and the event emitted when a request finishes."""

from __future__ import annotations

from dataclasses import dataclass, field

from marsproxy.emulator.kv_cache import KVSeq


class RequestError(ValueError):
    """A request the engine cannot serve (the server answers 400, like vLLM)."""


@dataclass(frozen=True)
class FinishedEvent:
    """A finished request with its usage and timing (modelled seconds)."""

    req_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    num_preemptions: int
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    token_gaps: tuple[float, ...]

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float:
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float:
        return self.finish_time - self.first_token_time


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
    session_id: str | None = None  # the body's session_id: carried into KV events

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
