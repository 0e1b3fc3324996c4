"""What a request returns: RequestOutput, CompletionOutput, RequestMetrics (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times from time.perf_counter(); benchmarks read latencies from these."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # one per output token


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # LLM.chat with tools or a reasoning parser: the text as reasoning, content and tool calls
    # (jaxserve/chat_output.py ChatMessageOut)
    message: object | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # before it); set once every position is computed (by the output that carries the first token;
    # with DELTA outputs in that one output only)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
