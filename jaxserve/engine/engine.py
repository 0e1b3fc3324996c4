"""Engine: the step loop gluing the scheduler (host) and the model runner (device).

One step: `schedule()` -> `runner.dispatch` -> `runner.collect` -> `scheduler.update` -> the
output processor (detokenize, stop strings, RequestOutputs). Requests are validated at the door
(`add_request`, engine/input_processor.py), so nothing bad reaches the scheduler, and a bad
request never stops the engine.

With `async_scheduling` (the default) the loop runs one step ahead: a `step()` call schedules and
dispatches step N+1 *before* it waits for step N's sampled tokens, so the host's scheduling and
packing overlap the device's work, and the host's output processing of step N overlaps step N+1.
Step N's tokens stay on the device and feed step N+1 there (placeholders, see
sched/scheduler_output.py); a request that step N ends may already be in step N+1, whose token for
it is dropped. Outputs are the same with the loop on and off.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from jaxserve.engine.control_plane import EngineControl
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.draft_proposer import draft_sampling
from jaxserve.engine.expert_load import ExpertLoad
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.engine.kv_transfer_request import mark_kv_transfer
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.pooled_embedding import PooledEmbedding
from jaxserve.engine.request_state import RequestState, SampleState
from jaxserve.engine.sampling_options import sampling_options
from jaxserve.engine.stats import (ONE_DEVICE, EngineStats, ExpertLoadStats, KVArenaStats, Lifecycle,
                                   RequestTotals, StepStats, WeightStats)
from jaxserve.engine.chunk_policy import NO_CHUNK_CAP
from jaxserve.engine.startup_calibration import StartupCalibration
from jaxserve.engine.startup_timings import StartupTimings
from jaxserve.engine.step_timing import StepTimer
from jaxserve.lora.engine_methods import EngineLoRAMethods
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.runner import compile_counter
from jaxserve.runner.protocol import Runner, carries
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.kv_connector import KVLoadFailed
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

@dataclass(slots=True)
class _InFlight:
    """A dispatched step whose sampled tokens the host has not read yet."""

    sched_out: SchedulerOutput
    handle: Any
    dispatched_at: float


class Engine(EngineControl, EngineLoRAMethods):
    def __init__(self, *, scheduler: Scheduler, runner: Runner, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int], seed: int = 0, checkpoint_identity: str = "",
                 model_name: str = "", calibration: StartupCalibration | None = None,
                 async_scheduling: bool = True,
                 draft_runner: Runner | None = None, startup_timings: StartupTimings | None = None,
                 requantize=None, lora=None, deferred_calibration=None, background_warm_up=None):
        """The builder's parts (engine/builder.py): calibration, what start-up measured (the chunk
        policy, the swap cost; engine/startup_calibration.py); startup_timings, what building took;
        requantize, a quantized engine's pass from checkpoint-named float tensors to its params
        (weight updates); lora, the adapters (lora/engine_lora.py EngineLoRA; None: enable_lora
        off); deferred_calibration, a cold server's start-up calibration, run by run_idle_work
        (engine/deferred_calibration.py); background_warm_up, the thread warming the buckets not
        needed yet (engine/warm_start.py; warm_up="background")."""
        self.scheduler = scheduler
        # speculative decoding's draft model (engine/draft_proposer.py): every step runs on it too,
        # and without lookahead (a placeholder would name a token its own sampler never saw)
        self.draft_runner = draft_runner
        # none handed in (an engine built by hand): the scheduler's own caps, no derived policy
        self.calibration = calibration if calibration is not None else StartupCalibration(NO_CHUNK_CAP)
        self.expert_load = ExpertLoad()       # a mixture-of-experts model's tokens per expert
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.checkpoint_identity = checkpoint_identity
        self.model_name = model_name
        self.async_scheduling = async_scheduling and draft_runner is None
        self.input_processor = InputProcessor(tokenizer=tokenizer, vocab_size=vocab_size,
                                              limits=scheduler.limits, eos_token_ids=self.eos_token_ids,
                                              prompt_logprobs=carries(runner, "prompt_logprobs"),
                                              embeddings=carries(runner, "pooling"))
        self.outputs = OutputProcessor()
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._start = time.monotonic()
        self._compilations = compile_counter.CompileCounter()  # this engine's own, after construction
        self._timer = StepTimer()
        self._in_flight: _InFlight | None = None
        self._last_done = 0.0    # when the last collected step's tokens were in (perf_counter)
        self._constrained: set[str] = set()   # scheduler ids of live samples with structured output
        # disaggregated prefill and decode (attach_kv_connector); None: colocated
        self.kv_connector = None
        self.role = "both"
        # the prefix cache's KV events go out here after every step (attach_kv_events); None: off
        self.kv_events = None
        self.startup_timings = startup_timings if startup_timings is not None else StartupTimings()
        self.requantize = requantize
        self.lora = lora
        self.deferred_calibration = deferred_calibration
        self.background_warm_up = background_warm_up
        # weights and pause (engine/weight_update.py, docs/rl.md)
        self.weights_version: int | str | None = None
        self.num_weight_updates = 0
        self.paused = False        # no step runs; requests added are held until resume()
        self.pausing = False       # pause("wait"): the requests in flight run to their end first
        self._held: list[tuple] = []        # (request_id, EngineRequest, arrival_time, kv_transfer)
        self._drained: list[RequestOutput] = []   # outputs of a step collected outside step()

    def attach_kv_connector(self, connector, role: str, load_failure_policy: str) -> None:
        """Disaggregated prefill or decode (disagg/attach.py): the connector's scheduler side goes
        to the scheduler, its runner side to the runner, its transfers' waits to this loop."""
        self.scheduler.attach_kv_connector(connector, load_failure_policy)
        self.runner.attach_kv_connector(connector)
        self.kv_connector = connector
        self.role = role

    def attach_kv_events(self, publisher) -> None:
        """Publish the prefix cache's changes (jaxserve/kv_events/publisher.py); the scheduler was
        built recording them (SchedulerConfig.kv_events)."""
        if self.scheduler.kv.cache is None or self.scheduler.kv.cache.events is None:
            raise ValueError("KV events need a scheduler built with kv_events=True and prefix caching")
        self.kv_events = publisher

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv.take_events())

    def close(self) -> None:
        """Let go of what outlives a step: the KV events' sockets (what is queued is sent first)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def record_startup(self, **seconds: float) -> StartupTimings:
        """Add start-up phases done after building (builder.prepare_for_requests' warm-up)."""
        self.startup_timings = self.startup_timings.plus(**seconds)
        return self.startup_timings

    # -- the door ----------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str | None, prompt: Any, params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request; raises ValueError (bad input, with the numbers) or
        Overloaded (the waiting queue is full). n > 1 queues n samples sharing the prompt.
        lora_request: the adapter it runs under (registered from its path if it is not yet)."""
        with compile_counter.attributed_to(self._compilations):
            return self.add_processed(request_id, self.input_processor.process(prompt, params, priority=priority,
                                                                               lora_request=lora_request),
                                      arrival_time=arrival_time)

    def add_processed(self, request_id: str | None, req: EngineRequest, *, arrival_time: float | None = None,
                      kv_transfer=None) -> str:
        """Queue a request the input processor already validated (a server may run the door, and
        its tokenization, off the step thread). kv_transfer (disaggregated serving): "send" keeps
        the prompt's KV for a decode engine when the request ends, a sched RemoteKV loads it."""
        request_id = self.new_request_id() if request_id is None else str(request_id)
        if request_id in self.outputs or any(h[0] == request_id for h in self._held):
            raise ValueError(f"request_id={request_id!r} is already in use")
        if self.paused or self.pausing:   # accepted (it passed the door), run after resume()
            self._held.append((request_id, req, time.perf_counter() if arrival_time is None else arrival_time,
                               kv_transfer))
            return request_id
        now = time.perf_counter() if arrival_time is None else arrival_time
        params = req.params
        # a bad adapter fails here, before anything is queued
        adapter = self._adapter(req.lora_request, req.lora_read)
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        # an embedding's one token is never shown: nothing to detokenize
        detok = self._detokenizer if req.pooling is None else (lambda _: None)
        samples = [SampleState(i, sid, detok(req), logprobs=[] if params.logprobs is not None else None,
                               cumulative_logprob=0.0 if params.logprobs is not None else None)
                   for i, sid in enumerate(ids)]
        banned = self.input_processor.banned_before_min_tokens(params) if params.min_tokens else ()
        for i, sid in enumerate(ids):
            seed = params.seed + i if params.seed is not None else int(self._rng.integers(0, 2**31))
            sched_req = Request(
                sid, req.prompt_token_ids, req.max_tokens, min_tokens=params.min_tokens,
                eos_token_ids=self.eos_token_ids, stop_token_ids=frozenset(params.stop_token_ids or ()),
                ignore_eos=params.ignore_eos, priority=req.priority, arrival_time=now, cache_salt=req.cache_salt,
                sampling=sampling_options(params, seed, banned, req.constraints[i] if req.constraints else None,
                                          prompt_token_ids=req.prompt_token_ids,
                                          pooling=req.pooling.pooling if req.pooling is not None else None),
                # prompt logprobs need every prompt position's logits, embeddings its hidden
                # states: no prefix-cache hit
                skip_reading_prefix_cache=params.prompt_logprobs is not None or req.pooling is not None,
                lora_name=adapter.request.lora_name if adapter is not None else None,
                lora_key=adapter.key if adapter is not None else None)
            if kv_transfer is not None:
                mark_kv_transfer(sched_req, kv_transfer, params.n, self.kv_connector, self.role)
            if req.constraints:
                self._constrained.add(sid)
            if i == 0:
                self.scheduler.add_request(sched_req)   # may raise Overloaded: nothing recorded yet
            else:  # the other samples share the first one's prompt blocks
                self.scheduler.fork_request(ids[0], sched_req)
        self.outputs.add(RequestState(request_id, req.prompt, list(req.prompt_token_ids), params,
                                      RequestMetrics(arrival_time=now), samples,
                                      pooled=(PooledEmbedding(req.pooling, len(req.prompt_token_ids))
                                              if req.pooling is not None else None)))
        return request_id

    def take_request_errors(self) -> list[tuple[str, Exception]]:
        """Requests the engine ended with an error since the last call (a KV load that failed
        under the `fail` policy): their ids and the error their streams should raise."""
        errors = self.scheduler.kv_loads.take_errors()
        if not errors:
            return []
        self.outputs.remove([rid for rid, _ in errors], reason="abort")
        return [(rid, KVLoadFailed(msg)) for rid, msg in errors]

    def _detokenizer(self, req: EngineRequest) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        p = req.params
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                                      stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self._held:
            gone = set(ids)
            self._held = [h for h in self._held if h[0] not in gone]
        scheduler_ids = [sid for rid in ids for sid in self.outputs.scheduler_ids(rid)]
        self.scheduler.abort_requests(scheduler_ids)
        self.outputs.remove(ids, reason="abort")

    # -- the loop ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: never while paused (requests kept then are not stepped) or
        asleep (requests added then wait for wake_up)."""
        if self.paused or self.asleep:
            return False
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def chunk_policy(self):
        """How prompt chunks are sized (engine/chunk_policy.py)."""
        return self.calibration.chunk_policy

    @property
    def idle_work_pending(self) -> bool:
        """Whether run_idle_work has something left to do (the step thread then polls while idle)."""
        return self.deferred_calibration is not None and self.deferred_calibration.pending

    def run_idle_work(self) -> bool:
        """The start-up calibration a cold server deferred, if the engine is idle and warm
        (engine/deferred_calibration.py); returns whether it ran (or was given up for good)."""
        if not self.idle_work_pending or self._held or self._in_flight is not None:
            return False
        calibration = self.deferred_calibration.run_if_idle(self)
        if calibration is not None:
            self.calibration = calibration
        return not self.deferred_calibration.pending

    def step(self) -> list[RequestOutput]:
        """Run one step. With async scheduling it returns the outputs of the step before."""
        if self.paused or self.asleep:
            return self.take_drained()
        outputs = self.take_drained() + self._step()
        self._publish_kv_events()
        if self.pausing and not self.has_unfinished_requests():
            self.pausing, self.paused = False, True   # pause("wait"): the last request in flight ended
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.kv_connector is not None and self._in_flight is None and self.scheduler.only_waiting_for_kv():
            self.kv_connector.wait(0.01)   # nothing to compute until a KV load ends: no busy loop
        self._timer.step_started()
        if self.runner.owner is not self:
            self._take_over_runner()
        with compile_counter.attributed_to(self._compilations):
            speculate = self.scheduler.wants_drafts()
            if self.async_scheduling and not speculate and not self._constrained_live():
                outputs = self._step_one_ahead()
            else:
                # a grammar's mask needs every token before it, and so do speculative guesses: no
                # step is scheduled while one is in flight (the step that was ends first)
                behind, self._in_flight = self._in_flight, None
                outputs = self._finish(behind)
                outputs += self._finish(self._dispatch(self.scheduler.schedule(drafts=speculate)))
        self._timer.step_ended(self.has_unfinished_requests())
        # what a step without lookahead costs: the host's work is then not hidden behind the device
        if self.scheduler.speculation is not None:
            self.scheduler.speculation.host_seconds_per_step = self._timer.recent_host_s
        return outputs

    def _constrained_live(self) -> bool:
        """Whether a request with structured output is waiting or running (pruned as they end)."""
        if self._constrained:
            self._constrained = {sid for sid in self._constrained if self.scheduler.get_request(sid) is not None}
        return bool(self._constrained)

    def _step_one_ahead(self) -> list[RequestOutput]:
        ahead = self._dispatch(self.scheduler.schedule())
        behind, self._in_flight = self._in_flight, ahead
        return self._finish(behind)

    def _dispatch(self, sched_out: SchedulerOutput) -> _InFlight | None:
        self.runner.owner = self     # whose block ids the arena's contents now follow
        self.outputs.mark_scheduled((r.request_id for r in sched_out.requests), time.perf_counter())
        if self.draft_runner is None:
            handle = self.runner.dispatch(sched_out)   # block operations run even with no request
        else:
            # its K/V follow the target's; the target's sampled rows are coupled with its draws
            draft = self.draft_runner.dispatch(draft_sampling(sched_out)).sampler_out
            handle = self.runner.dispatch(sched_out, draft_sample=draft)
        return _InFlight(sched_out, handle, time.perf_counter()) if sched_out.requests else None

    def _finish(self, step: _InFlight | None) -> list[RequestOutput]:
        """Wait for a dispatched step's tokens, update the scheduler, build the outputs."""
        if step is None:
            return []
        asked = time.perf_counter()
        ready = self.runner.is_ready(step.handle)
        result = self.runner.collect(step.handle)
        done = time.perf_counter()
        self._timer.collected(step.dispatched_at, asked, ready)
        if not ready and step.sched_out.predicted_s is not None:
            # the host waited for it, so it ended just now; it started at its dispatch or when the
            # step before it ended, whichever was later (the device runs steps in order)
            self.scheduler.observe_step_time(step.sched_out.predicted_s,
                                             done - max(step.dispatched_at, self._last_done))
        self._last_done = done
        features = result.features
        if "expert_counts" in features:
            self.expert_load.add(features["expert_counts"])
        updates = self.scheduler.update(step.sched_out, result.token_ids)
        if self._constrained:
            updates = self._advance_grammars(updates)
        processed = self.outputs.process(updates, result.logprobs, time.perf_counter(),
                                         prompt_logprobs=features.get("prompt_logprobs"),
                                         pooled=features.get("pooling"))
        for hit in processed.stop_string_hits:
            self.scheduler.finish_requests([hit.scheduler_id], "stop", stop_reason=hit.stop)
        return processed.outputs

    def _advance_grammars(self, updates):
        """Feed each constrained sample its new tokens; one whose grammar reached its end (nothing
        may follow) finishes with reason "stop" now, as EOS would end it."""
        out = []
        for u in updates:
            c = getattr(u.request.sampling, "constraint", None)
            if c is not None and u.new_token_ids:
                c.consume(u.new_token_ids)
                if c.finished and not u.finished:
                    error = c.error
                    if error is not None:
                        log.warning("request %s: structured output stopped by a grammar matcher error: %s",
                                    u.request.request_id, error)
                    self.scheduler.finish_requests([u.request.request_id], "stop",
                                                   stop_reason=None if error is None else f"grammar error: {error}")
                    u = dataclasses.replace(u, finished=True)
            out.append(u)
        return out

    def _take_over_runner(self) -> None:
        """Another engine on the same runner (LLM.sharing_runner) ran steps since this one did:
        they wrote arena blocks this engine's prefix cache still names, so it forgets them."""
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("two engines sharing one runner cannot both have requests running; finish one "
                               "engine's requests before stepping the other")
        self.runner.owner = self

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (they return to the free pool)."""
        if self._in_flight is not None or not self.scheduler.reset_prefix_cache():
            raise RuntimeError("cannot reset the prefix cache while requests are running")
        self._publish_kv_events()

    # -- introspection -----------------------------------------------------------------------
    @property
    def finished_by_reason(self) -> dict[str, int]:
        return dict(self.outputs.counters.finished_by_reason)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        config, c, timing = self.scheduler.config, self.outputs.counters, self._timer.stats()
        return EngineStats(
            scheduler=s,
            kv=KVArenaStats.of(self.runner.arena_spec, s),
            steps=StepStats(num_steps=timing.steps, host_ms_per_step=timing.host_ms_per_step,
                            device_idle_fraction=timing.device_idle_fraction,
                            num_compilations_after_warmup=self._compilations.count,
                            prefill_policy=self.chunk_policy.describe(),
                            prefill_chunk_tokens=config.long_prefill_token_threshold or config.decode_step_prefill_cap),
            requests=RequestTotals(prompt_tokens_total=c.prompt_tokens, generation_tokens_total=c.generation_tokens,
                                   num_finished=c.finished, num_held=len(self._held)),
            weights=WeightStats(version="" if self.weights_version is None else str(self.weights_version),
                                num_updates=self.num_weight_updates),
            lifecycle=Lifecycle(uptime_s=time.monotonic() - self._start, paused=self.paused, asleep=self.asleep,
                                sleep_level=self.runner.sleep_state.level if self.asleep else -1),
            experts=ExpertLoadStats(tokens_window=self.expert_load.window_per_expert,
                                    tokens_total=self.expert_load.total_per_expert,
                                    imbalance=self.expert_load.imbalance),
            mesh=self.runner.mesh_info or ONE_DEVICE,
        )
