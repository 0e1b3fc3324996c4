"""Turning a step's updates into what users see: detokenizing, stop strings, logprobs (and prompt
logprobs), RequestOutputs (cumulative, delta or final only), and the engine's output counters.

The engine calls `process` once per step with the scheduler's updates and the runner's sampled
tokens. It never writes the scheduler's state: a stop string found here is returned, and the
engine ends that request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from jaxserve.embedding_outputs import EmbeddingOutput, EmbeddingRequestOutput
from jaxserve.engine.request_state import RequestState, SampleState
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import OutputKind
from jaxserve.sched.scheduler_output import RequestUpdate


@dataclass(slots=True)
class OutputCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)

    def count_finished(self, reason: str) -> None:
        self.finished += 1
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1


@dataclass(frozen=True, slots=True)
class StopStringHit:
    scheduler_id: str
    stop: str


@dataclass(frozen=True, slots=True)
class ProcessedStep:
    outputs: list[RequestOutput]
    stop_string_hits: list[StopStringHit]  # still running in the scheduler: the engine ends them


class OutputProcessor:
    def __init__(self) -> None:
        self._requests: dict[str, RequestState] = {}
        # scheduler request id -> (its request, its sample): an index into _requests' states
        self._samples: dict[str, tuple[RequestState, SampleState]] = {}
        # scheduler ids of samples no step has scheduled yet (their first_scheduled_time is open):
        # a step with none of them marks nothing, instead of looking up every scheduled request
        self._unscheduled: set[str] = set()
        self.counters = OutputCounters()

    # ---- live requests ------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        """The live requests' ids, in the order they were added."""
        return list(self._requests)

    def add(self, state: RequestState) -> None:
        self._requests[state.request_id] = state
        plain = len(state.samples) == 1 and state.pooled is None and state.prompt_logprobs is None
        for s in state.samples:
            self._samples[s.scheduler_id] = (state, s)
            self._unscheduled.add(s.scheduler_id)
            s.plain = plain and s.logprobs is None and (s.detok is None or not s.detok.has_stop_strings)
        self.counters.prompt_tokens += len(state.prompt_token_ids)

    def remove(self, request_ids: Iterable[str], reason: str | None = None) -> list[str]:
        """Forget requests (aborted); returns their scheduler ids. Counts each as finished with
        `reason` when given."""
        scheduler_ids = []
        for rid in request_ids:
            state = self._requests.pop(rid, None)
            if state is None:
                continue
            for s in state.samples:
                self._samples.pop(s.scheduler_id, None)
                self._unscheduled.discard(s.scheduler_id)
                scheduler_ids.append(s.scheduler_id)
            if reason is not None:
                self.counters.count_finished(reason)
        return scheduler_ids

    def scheduler_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return [s.scheduler_id for s in state.samples] if state is not None else [request_id]

    def mark_scheduled(self, scheduler_ids: Iterable[str], now: float) -> None:
        unscheduled = self._unscheduled
        if not unscheduled:     # the steady state: every live sample has run before
            return
        for sid in scheduler_ids:
            if sid in unscheduled:
                unscheduled.discard(sid)
                metrics = self._samples[sid][0].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now

    # ---- a step -------------------------------------------------------------------------------
    def process(self, updates: Sequence[RequestUpdate], logprobs: Mapping[str, Sequence], now: float, *,
                prompt_logprobs: Mapping | None = None, pooled: Mapping | None = None) -> ProcessedStep:
        """`logprobs[scheduler id]`: the runner's SampledTokens of this step (with their logprobs),
        for the samples that asked for logprobs; `prompt_logprobs[scheduler id]`: the prompt
        positions its rows described (a PromptLogprobChunk)."""
        hits: list[StopStringHit] = []
        for sid, chunk in (prompt_logprobs or {}).items():
            entry = self._samples.get(sid)
            if entry is not None and entry[0].prompt_logprobs is not None:
                entry[0].record_prompt_logprobs(chunk)
        for sid, chunk in (pooled or {}).items():   # embeddings' sums (runner/pooling.PooledChunk)
            entry = self._samples.get(sid)
            if entry is not None and entry[0].pooled is not None:
                entry[0].pooled.add(chunk)
        # outputs in the order of the updates: a plain step's output at once, the others' (None
        # here) built below from their state, once per request (n > 1 samples share one)
        outputs: list[RequestOutput | None] = []
        touched: dict[str, tuple[RequestState, int]] = {}
        plain_tokens = 0
        samples = self._samples
        for u in updates:
            entry = samples.get(u.request.request_id)
            if entry is None:
                continue  # aborted since the step was scheduled
            state, sample = entry
            new = u.new_token_ids
            if sample.plain and len(new) == 1 and not u.finished and sample.finish_reason is None:
                out = self._plain_step(state, sample, new[0], u.request.num_cached_tokens, now)
                if out is not None:      # a final-only request shows nothing until it ends
                    outputs.append(out)
                plain_tokens += 1
                continue
            sample.started = True
            if u.request.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = u.request.num_cached_tokens
            if u.new_token_ids and sample.finish_reason is None and state.pooled is None:   # an embedding's token is dropped
                self._append(state, sample, u.new_token_ids,
                             logprobs.get(sample.scheduler_id, ()) if sample.logprobs is not None else (), now)
                if sample.detok is not None and sample.detok.stopped_by is not None:
                    sample.finish("stop", sample.detok.stopped_by)  # a stop string wins over a limit
                    if not u.finished:
                        hits.append(StopStringHit(sample.scheduler_id, sample.detok.stopped_by))
            if u.finished:
                sample.finish(u.request.finish_reason or "stop", u.request.stop_reason)
            if state.request_id not in touched:
                touched[state.request_id] = (state, len(outputs))
                outputs.append(None)
        self.counters.generation_tokens += plain_tokens
        for state, i in touched.values():
            outputs[i] = self._output(state, now)
        return ProcessedStep([o for o in outputs if o is not None] if touched else outputs, hits)

    def _plain_step(self, state: RequestState, sample: SampleState, token_id: int, num_cached: int,
                    now: float) -> RequestOutput | None:
        """The common step, what `process` does for it without the general path's branches: one
        new token of a running request with one sample, no logprobs, no stop strings (so all of
        it is sendable at once), no prompt logprobs; streamed (DELTA), cumulative, or final only
        (no output: LLM.generate's requests)."""
        sample.started = True
        if num_cached > state.num_cached_tokens:
            state.num_cached_tokens = num_cached
        detok = sample.detok
        text = detok.append_one(token_id) if detok is not None else ""
        sample.token_ids.append(token_id)
        metrics = state.metrics
        metrics.token_times.append(now)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        kind = state.params.output_kind
        if kind is OutputKind.FINAL_ONLY:
            return None
        token_ids = sample.token_ids
        if kind is OutputKind.DELTA and sample.sent_tokens + 1 == len(token_ids):
            # everything before was sent (nothing is held back without stop strings)
            sample.sent_tokens += 1
            sample.sent_text += len(text)
            completion = CompletionOutput(sample.index, text, [token_id])
        else:
            completion = _completion(sample, kind)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], False,
                             state.num_cached_tokens, metrics)

    def _append(self, state: RequestState, sample: SampleState, token_ids, sampled_tokens, now: float) -> None:
        # the runner's tokens of a multi-token step go past a stop the scheduler found among them
        sampled_tokens = sampled_tokens[:len(token_ids)]
        if sample.detok is not None:
            sample.detok.append(token_ids)
            # a stop string ends the output at the token that completed it; a step that produced
            # several tokens (speculative decoding) drops those after it, as one-token steps would
            # never have sampled them
            token_ids = token_ids[:sample.detok.num_consumed]
            sampled_tokens = sampled_tokens[:len(token_ids)]
        self.counters.generation_tokens += len(token_ids)
        if len(token_ids) == 1:
            state.metrics.token_times.append(now)
        else:
            state.metrics.token_times.extend([now] * len(token_ids))
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        sample.token_ids.extend(token_ids)
        if sample.logprobs is not None:
            k = state.params.logprobs
            for s in sampled_tokens:
                entry = {s.token_id: Logprob(s.logprob)}
                for rank, (tid, lp) in enumerate(s.top_logprobs[:k], start=1):
                    entry.setdefault(tid, Logprob(lp, rank))
                sample.logprobs.append(entry)
                sample.cumulative_logprob += s.logprob

    def _output(self, state: RequestState, now: float) -> RequestOutput | None:
        done = state.finished
        if done:
            state.metrics.finished_time = now
            self.remove([state.request_id], reason=state.finish_reason)
        kind = state.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not done:
            return None
        if state.pooled is not None:   # an embedding: its one sampled token is not shown
            return EmbeddingRequestOutput(state.request_id, state.prompt, list(state.prompt_token_ids),
                                          EmbeddingOutput(state.pooled.embedding()), metrics=state.metrics)
        if len(state.samples) == 1:
            completions = [_completion(state.samples[0], kind)]
        else:  # n > 1 outputs are cumulative whatever the kind: each completion carries its index
            completions = [_completion(s, OutputKind.CUMULATIVE) for s in state.samples if s.started]
        # every output of a request carries the same list (one copy, made at the door), not a
        # fresh copy of the prompt per streamed output
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, done,
                             num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
                             prompt_logprobs=None if state.prompt_logprobs is None else _prompt_logprobs(state, kind))


def _prompt_logprobs(state: RequestState, kind: OutputKind) -> list | None:
    """The prompt logprobs once every position has them (None before, and for a request that did
    not ask); a DELTA stream carries them in one output only."""
    if state.prompt_logprobs is None or state.prompt_logprobs_missing:
        return None
    if kind is OutputKind.DELTA:
        if state.prompt_logprobs_sent:
            return None
        state.prompt_logprobs_sent = True
    return list(state.prompt_logprobs)


def _completion(s: SampleState, kind: OutputKind) -> CompletionOutput:
    # a running sample shows its tokens and text up to what is sendable (a possible stop string's
    # beginning waits), so cumulative outputs only grow and deltas never send text the end cuts
    num_tokens, num_chars = s.sendable()
    # one slice each, of what the output carries: a delta copies only its new tokens and text,
    # never the whole output so far
    first_token, first_char = (s.sent_tokens, s.sent_text) if kind is OutputKind.DELTA else (0, 0)
    logprobs = s.logprobs[first_token:num_tokens] if s.logprobs is not None else None
    if kind is OutputKind.DELTA:
        s.sent_tokens, s.sent_text = num_tokens, num_chars
    return CompletionOutput(
        index=s.index, text=s.text[first_char:num_chars], token_ids=s.token_ids[first_token:num_tokens],
        finish_reason=s.finish_reason, stop_reason=s.stop_reason, logprobs=logprobs,
        cumulative_logprob=s.cumulative_logprob)
