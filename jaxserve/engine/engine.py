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

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine import weight_update
from jaxserve.engine.draft_proposer import draft_sampling
from jaxserve.engine.deferred_calibration import run_if_idle
from jaxserve.engine.expert_load import ExpertLoad
from jaxserve.lora.request import LoRARequest
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.pooled_embedding import PooledEmbedding
from jaxserve.engine.request_state import RequestState, SampleState
from jaxserve.engine.sampling_options import sampling_options
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.step_timing import StepTimer
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.runner import compile_counter
from jaxserve.runner import sleep as runner_sleep
from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions
from jaxserve.runner.protocol import Runner, carries
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.kv_connector import KVLoadFailed
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What one update_weights call did."""

    version: int | str | None
    seconds: float                   # checks, placement and the swap, on the calling thread
    num_requests_recomputed: int     # requests that held KV and will recompute it
    num_prefix_blocks_flushed: int   # cached prefix blocks forgotten


@dataclass(slots=True)
class _InFlight:
    """A dispatched step whose sampled tokens the host has not read yet."""

    sched_out: SchedulerOutput
    handle: Any
    dispatched_at: float


class Engine:
    def __init__(self, *, scheduler: Scheduler, runner: Runner, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int], seed: int = 0, checkpoint_identity: str = "",
                 model_name: str = "", chunk_policy=None, async_scheduling: bool = True,
                 draft_runner: Runner | None = None):
        self.scheduler = scheduler
        # speculative decoding's draft model (engine/draft_proposer.py): every step runs on it too,
        # and without lookahead (a placeholder would name a token its own sampler never saw)
        self.draft_runner = draft_runner
        self.chunk_policy = chunk_policy      # how the prefill chunk size was chosen (engine/chunk_policy.py)
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
        # disaggregated prefill and decode (jaxserve/disagg/attach.py); None: colocated
        self.kv_connector = None
        self.role = "both"
        # weights and pause (engine/weight_update.py, docs/rl.md)
        self.weights_version: int | str | None = None
        self.num_weight_updates = 0
        self.paused = False        # no step runs; requests added are held until resume()
        self.pausing = False       # pause("wait"): the requests in flight run to their end first
        self._held: list[tuple] = []        # (request_id, EngineRequest, arrival_time, kv_transfer)
        self._drained: list[RequestOutput] = []   # outputs of a step collected outside step()
        # a quantized engine's pass from checkpoint-named float tensors to its params (builder.py)
        self.requantize = None
        # warm_up="background": the thread warming the buckets not needed yet (engine/warm_start.py)
        self.background_warm_up = None
        # a cold server's start-up calibration, run by run_idle_work (engine/deferred_calibration.py)
        self.deferred_calibration = None
        # LoRA adapters (lora/engine_lora.py): set by the builder with enable_lora, else None
        self.lora = None

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
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.paused or self.pausing:   # accepted (it passed the door), run after resume()
            self._held.append((request_id, req, time.perf_counter() if arrival_time is None else arrival_time,
                               kv_transfer))
            return request_id
        now = time.perf_counter() if arrival_time is None else arrival_time
        params = req.params
        adapter = self._adapter(req.lora_request)   # a bad adapter fails here, before anything is queued
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
            if isinstance(sched_req.sampling, AdjustedSamplingOptions) and sched_req.sampling.adjust is not None:
                sched_req.sampling.adjust.tokens.request = sched_req   # the penalties read its tokens
            if kv_transfer is not None:
                self._mark_kv_transfer(sched_req, kv_transfer, params.n)
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

    def _adapter(self, lora_request: LoRARequest | None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine built with enable_lora=True "
                             f"(jaxserve serve --enable-lora)")
        return self.lora.resolve(lora_request)

    # -- LoRA adapters (lora/engine_lora.py; vLLM's names) ----------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter from its PEFT directory on the host (read and checked now; a device
        slot is given when a request needs it). False: that adapter is registered already."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine built with enable_lora=True")
        return self.lora.add(lora_request)

    def remove_lora(self, name_or_id: str | int) -> bool:
        """Unregister an adapter by name or lora_int_id. False: no such adapter. ValueError while
        requests under it are live."""
        if self.lora is None:
            return False
        return self.lora.remove(name_or_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def _mark_kv_transfer(self, sched_req: Request, kv_transfer, n: int) -> None:
        side = "send" if kv_transfer == "send" else "load"
        conn = self.kv_connector
        have = conn is not None and (conn.can_send if side == "send" else conn.can_load)
        if not have:
            raise ValueError(f"kv_transfer {side}: this engine's role is {self.role!r} (a KV {side} needs "
                             f"--role {'prefill' if side == 'send' else 'decode'})")
        if n != 1:
            raise ValueError(f"kv_transfer needs n=1, got n={n}")
        if side == "load" and sched_req.sampling.num_prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need the prompt computed here, not loaded with kv_transfer")
        if side == "load" and sched_req.sampling.pooling is not None:
            raise ValueError("an embedding needs the prompt computed here, not loaded with kv_transfer")
        if side == "send":
            sched_req.kv_send = True
        else:
            sched_req.remote_kv = kv_transfer

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
    def idle_work_pending(self) -> bool:
        """Whether run_idle_work has something left to do (the step thread then polls while idle)."""
        return self.deferred_calibration is not None

    def run_idle_work(self) -> bool:
        """The start-up calibration a cold server deferred, if the engine is idle and warm
        (engine/deferred_calibration.py); returns whether it ran."""
        if self._held or self._in_flight is not None:
            return False
        return run_if_idle(self)

    def step(self) -> list[RequestOutput]:
        """Run one step. With async scheduling it returns the outputs of the step before."""
        if self.paused or self.asleep:
            return self.take_drained()
        outputs = self.take_drained() + self._step()
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
        if sched_out.lora_loads:     # adapters this step's schedule put into slots, written first
            self.lora.apply_loads(sched_out.lora_loads)
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

    # -- weights and pause (docs/rl.md) ------------------------------------------------------
    def update_weights(self, update: Any, *, version: int | str | None = None) -> WeightUpdate:
        """Serve new weights from the next step on (engine/weight_update.py: a params pytree, or
        (checkpoint name, array) pairs). Nothing compiles: the steps take the params as an
        argument. KV computed under the old weights is never read again: requests holding KV go
        back to the waiting queue and recompute theirs (they keep their outputs), and the prefix
        cache is flushed. Every check runs first: a bad update raises ValueError, changes nothing."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
            raise ValueError(f"version must be an int, a str or None, got {version!r}")
        if self.runner.step_mirror is not None:
            raise RuntimeError("update_weights is not built for an engine on several hosts (the followers would "
                               "keep the old weights)")
        if self.kv_connector is not None:
            raise RuntimeError("update_weights is not built for disaggregated prefill/decode roles (a KV transfer "
                               "between two weight versions is not guarded)")
        t0 = time.perf_counter()
        new = weight_update.new_params(self.runner, update, requantize=self.requantize)
        self._drain()
        recomputed = self.scheduler.recompute_all()
        flushed = self.scheduler.stats().num_kv_blocks_cached
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be flushed: blocks are still held")  # a bug
        self.runner.params = new
        self.weights_version = version
        self.num_weight_updates += 1
        return WeightUpdate(version=version, seconds=time.perf_counter() - t0,
                            num_requests_recomputed=recomputed, num_prefix_blocks_flushed=flushed)

    def pause(self, mode: str = "abort") -> list[str]:
        """Stop stepping. mode: "abort" ends every request in flight or held (finish_reason
        "abort"; returns their ids); "wait" lets the requests in flight run to their end first
        (paused once they have: `paused`, meanwhile `pausing`); "keep" holds them where they are,
        to continue after resume() (under new weights if update_weights ran meanwhile). Requests
        added while paused or pausing are accepted and held until resume()."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        aborted: list[str] = []
        if mode == "wait":
            self.pausing = not self.paused and self.has_unfinished_requests()
            self.paused = not self.pausing
            return aborted
        self._drain()
        if mode == "abort":
            aborted = self.outputs.request_ids() + [h[0] for h in self._held]
            self.abort(aborted)
        self.pausing, self.paused = False, True
        return aborted

    def resume(self) -> list[tuple[str, Exception]]:
        """Step again; the requests held while paused are queued now, in the order they came.
        Returns those that could not be (their id and the error, e.g. the queue is full)."""
        self.paused = self.pausing = False
        held, self._held = self._held, []
        failed = []
        for request_id, req, arrival_time, kv_transfer in held:
            try:
                self.add_processed(request_id, req, arrival_time=arrival_time,
                                   **({"kv_transfer": kv_transfer} if kv_transfer is not None else {}))
            except Exception as e:  # noqa: BLE001 - each held request fails alone, as at the door
                failed.append((request_id, e))
        return failed

    def take_drained(self) -> list[RequestOutput]:
        """Outputs of a step collected outside step() (by pause or update_weights), not yet returned."""
        out, self._drained = self._drained, []
        return out

    def _drain(self) -> None:
        """Collect the step in flight (the one-step-ahead loop's), keeping its outputs for the caller."""
        behind, self._in_flight = self._in_flight, None
        if behind is not None:
            with compile_counter.attributed_to(self._compilations):
                self._drained += self._finish(behind)

    # -- sleep and wake up (runner/sleep.py, docs/rl.md) ---------------------------------------
    @property
    def asleep(self) -> bool:
        """Between sleep() and wake_up(): no step runs (the runner's, so engines sharing it agree)."""
        return self.runner.sleep_state is not None

    def sleep(self, level: int = 1) -> runner_sleep.SleepReport:
        """Give the device memory back until wake_up(): level 0 frees the KV arena, 1 also moves the
        weights to host memory, 2 drops them (update_weights must bring new ones before wake_up).
        Refused while requests run unless the engine is paused: then requests kept ("keep") lose
        their KV and recompute it after wake_up and resume, as after update_weights. The prefix
        cache is flushed (the arena's contents are gone). Requests added while asleep wait for
        wake_up. Returns the bytes released (runner/sleep.py)."""
        if level not in runner_sleep.LEVELS:
            raise ValueError(f"sleep level must be one of {runner_sleep.LEVELS}, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is asleep already (level {self.runner.sleep_state.level}): wake_up() first")
        if self.pausing or (not self.paused and self.has_unfinished_requests()):
            raise RuntimeError("cannot sleep while requests are running: let them finish, or pause() first "
                               "(\"abort\" ends them; \"keep\" holds them to recompute after wake_up and resume)")
        if self.runner.step_mirror is not None:
            raise RuntimeError("sleep is not built for an engine on several hosts (the followers would keep "
                               "their memory)")
        if self.kv_connector is not None:
            raise RuntimeError("sleep is not built for disaggregated prefill/decode roles (leases hold arena blocks)")
        if self.background_warm_up is not None:
            self.background_warm_up.join()    # its first runs read the weights that sleep lets go
        t0 = time.perf_counter()
        self._drain()
        self.scheduler.recompute_all()
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be flushed: blocks are still held")  # a bug
        runners = [self.runner] + ([self.draft_runner] if self.draft_runner is not None else [])
        with compile_counter.attributed_to(self._compilations):
            released = [runner_sleep.sleep(r, level) for r in runners]
        return runner_sleep.report(level, released, time.perf_counter() - t0)

    def wake_up(self) -> runner_sleep.WakeUpReport:
        """Take the arena (zeroed) and the weights back; nothing compiles. After sleep(level=2)
        every weight must have come with update_weights first (else ValueError, still asleep).
        Awake already: nothing to do."""
        t0 = time.perf_counter()
        runners = [r for r in [self.runner, self.draft_runner] if r is not None and r.sleep_state is not None]
        for r in runners:
            runner_sleep.check_can_wake(r)
        kv = weights = 0
        with compile_counter.attributed_to(self._compilations):
            for r in runners:
                a, w = runner_sleep.wake_up(r)
                kv, weights = kv + a, weights + w
        return runner_sleep.WakeUpReport(kv_cache_bytes=kv, weight_bytes=weights, seconds=time.perf_counter() - t0)

    # -- introspection -----------------------------------------------------------------------
    @property
    def finished_by_reason(self) -> dict[str, int]:
        return dict(self.outputs.counters.finished_by_reason)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        config = self.scheduler.config
        c = self.outputs.counters
        arena = self.runner.arena_spec
        bytes_per_block = arena.bytes_per_block if arena is not None else 0
        timing = self._timer.stats()
        return EngineStats(
            num_kv_blocks_total=s.num_kv_blocks_total,
            num_kv_blocks_free=s.num_kv_blocks_free,
            num_kv_blocks_cached=s.num_kv_blocks_cached,
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            num_compilations_after_warmup=self._compilations.count,
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_requests_finished=c.finished,
            uptime_s=time.monotonic() - self._start,
            num_preemptions_recompute=s.num_preemptions_recompute,
            num_preemptions_swap=s.num_preemptions_swap,
            num_swapped_blocks=s.num_swapped_blocks,
            prefill_chunk_tokens=config.long_prefill_token_threshold or config.decode_step_prefill_cap,
            prefix_cache_nodes=s.prefix_cache_nodes,
            prefix_cache_host_hits=s.prefix_cache_host_hits,
            num_host_blocks_total=s.num_host_blocks_total,
            num_host_blocks_cached=s.num_host_blocks_cached,
            num_host_blocks_in_use=s.num_host_blocks_in_use,
            kv_offload_bytes_saved=s.kv_blocks_saved * bytes_per_block,
            kv_offload_bytes_loaded=s.kv_blocks_loaded * bytes_per_block,
            prefill_policy=self.chunk_policy.describe() if self.chunk_policy is not None else "",
            step_time_scale=s.step_time_scale,
            host_ms_per_step=timing.host_ms_per_step,
            device_idle_fraction=timing.device_idle_fraction,
            num_steps=timing.steps,
            kv_cache_dtype=str(arena.dtype) if arena is not None else "",
            kv_cache_bytes_per_block=bytes_per_block,
            spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            spec_num_verifications=s.spec_num_verifications,
            weights_version="" if self.weights_version is None else str(self.weights_version),
            num_weight_updates=self.num_weight_updates,
            paused=self.paused,
            num_requests_held=len(self._held),
            asleep=self.asleep,
            sleep_level=self.runner.sleep_state.level if self.asleep else -1,
            expert_tokens_window=self.expert_load.window_per_expert,
            expert_tokens_total=self.expert_load.total_per_expert,
            expert_load_imbalance=self.expert_load.imbalance,
            **_mesh_stats(self.runner),
        )


def _mesh_stats(runner) -> dict:
    """The stats fields of the mesh the runner's model is split over (none: one device)."""
    mesh = runner.mesh_info
    if mesh is None:
        return {}
    return dict(mesh_num_devices=mesh.num_devices, mesh_num_hosts=mesh.num_hosts, mesh_axis_sizes=mesh.axis_sizes)
