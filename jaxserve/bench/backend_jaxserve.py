"""The jaxserve backend: `LLM.generate` for offline runs, the engine's step loop for timed arrivals.

Offline (everything sent at once, no concurrency cap) goes through `LLM.generate`, the API a user
calls. Timed arrivals, a concurrency cap, or a KV trace go through `llm.engine`: requests are added
when the dispatcher says they are due and `step()` is called until nothing is left; after every
step the engine's stats are sampled for the KV-usage trace. Weights are loaded and every bucket
compiled when the backend is built, outside any timed run.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions
from jaxserve.bench.dispatch import Dispatcher
from jaxserve.bench.kv_usage import KVSample, KVTrace
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest, at_once
from jaxserve.sched.errors import Overloaded


def load_llm(model_path: str, engine_kwargs: dict[str, Any], progress: bool = True) -> Any:
    """Indirection so tests can substitute a fake LLM with the same shape. `progress` shows the
    engine's compile and warm-up bars."""
    from jaxserve import LLM

    return LLM(model=model_path, progress=progress, **engine_kwargs)


def sampling_params(**kwargs: Any) -> Any:
    from jaxserve import SamplingParams

    return SamplingParams(**kwargs)


def greedy_params(output_len: int) -> Any:
    """Exactly output_len tokens, EOS ignored, greedy: the same contract every backend gets."""
    return sampling_params(max_tokens=output_len, ignore_eos=True, temperature=0.0)


def request_params(req: BenchRequest, index: int) -> Any:
    """Greedy, or for a sampled workload the request's temperature with a seed of its own, so
    two runs (with and without a feature) draw the same tokens where the feature keeps them."""
    if not req.temperature:
        return greedy_params(req.output_len)
    return sampling_params(max_tokens=req.output_len, ignore_eos=True, temperature=req.temperature, seed=index)


def _stats_dict(llm: Any) -> dict[str, Any]:
    return llm.stats().as_dict()


class JaxServeBackend:
    name = "jaxserve"

    def __init__(self, model_path: str, engine_kwargs: dict[str, Any] | None = None,
                 label: str | None = None, api: str = "auto", kv_trace: bool = True,
                 progress: bool = True) -> None:
        if api not in ("auto", "generate", "engine"):
            raise ValueError(f"api must be 'auto', 'generate' or 'engine', got {api!r}")
        self.engine_kwargs = dict(engine_kwargs or {})
        self.label = label or self.name
        self.api = api
        self.kv_trace = kv_trace
        t = time.perf_counter()
        self.llm = load_llm(model_path, self.engine_kwargs, progress)
        self.startup_s = time.perf_counter() - t
        self.checkpoint_identity = str(getattr(self.llm, "checkpoint_identity", "unknown"))

    def _record(self, out: Any, req: BenchRequest, arrival: float) -> RequestRecord:
        m = out.metrics
        tokens = list(out.outputs[0].token_ids)
        token_times = tuple(m.token_times or ())
        return RequestRecord(
            request_id=req.request_id, prompt_len=len(req.prompt_token_ids), output_len=len(tokens),
            arrival_time=min(arrival, m.first_token_time), first_token_time=m.first_token_time,
            finished_time=m.finished_time, first_scheduled_time=m.first_scheduled_time,
            token_times=token_times if len(token_times) == len(tokens) else (),
            num_cached_tokens=int(out.num_cached_tokens or 0), group=req.group,
        )

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        if requests:
            self.llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                              [request_params(r, i) for i, r in enumerate(requests)], use_tqdm=False)

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        # every run starts from a cold prefix cache, so a backend that runs the same prompts
        # again (bench throughput --repeats) is not answered from its previous run
        reset = getattr(self.llm.engine, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        use_engine = self.api == "engine" or (
            self.api == "auto" and (options.timed_arrivals or options.max_concurrency is not None))
        run = self._run_engine(requests, options) if use_engine else self._run_generate(requests, options)
        run.config.update({"api": "engine" if use_engine else "generate", "engine_kwargs": self.engine_kwargs,
                           "startup_s": self.startup_s})
        run.engine_stats = _stats_dict(self.llm)
        asked = {q.request_id: q.output_len for q in requests}
        short = [r.request_id for r in run.records if r.output_len != asked[r.request_id]]
        if short:
            run.notes.append(f"{len(short)} requests produced a different number of tokens than asked: {short[:5]}")
        return run

    def _run_generate(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
        params = [request_params(r, i) for i, r in enumerate(requests)]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=options.progress)
        t1 = time.perf_counter()
        records = [self._record(o, r, t0) for o, r in zip(outs, requests)]
        return BackendRun(
            self.name, self.label, records, t1 - t0, self.checkpoint_identity,
            output_token_ids={r.request_id: list(o.outputs[0].token_ids) for o, r in zip(outs, requests)},
            notes=["offline: LLM.generate with every request sent at once; no KV trace in this mode"],
        )

    def _run_engine(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        eng = self.llm.engine
        by_id = {r.request_id: r for r in requests}
        index = {r.request_id: i for i, r in enumerate(requests)}
        block_size = self.llm.engine.scheduler.config.block_size
        trace = KVTrace(block_size, self.llm.engine.max_model_len)
        start = time.perf_counter()
        if not options.timed_arrivals:
            requests = [at_once(r) for r in requests]
        disp = Dispatcher(requests, start, options.max_concurrency)
        started: set[str] = set()
        live: dict[str, int] = {}
        finals: dict[str, Any] = {}
        rejected: list[str] = []
        with progress_bar(len(requests), "jaxserve", options.progress) as bar:
            while disp.has_waiting or eng.has_unfinished_requests():
                for r in disp.pop_due(time.perf_counter()):
                    # the engine's arrival is the request's due time, not when this loop got round to it
                    try:
                        eng.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_token_ids)},
                                        request_params(r, index[r.request_id]),
                                        arrival_time=disp.sent_at[r.request_id])
                    except Overloaded:
                        # turned away (max_waiting_requests), as a server answers RESOURCE_EXHAUSTED:
                        # the request gets no record (a goodput sweep counts it as a miss)
                        rejected.append(r.request_id)
                        disp.first_token(r.request_id, r.group, time.perf_counter())
                        disp.finished(r.request_id, time.perf_counter())
                        bar.update(1)
                if not eng.has_unfinished_requests():
                    nxt = disp.next_due()
                    if nxt is None:
                        raise RuntimeError("requests wait for a group that can never start")
                    time.sleep(max(0.0, nxt - time.perf_counter()))
                    continue
                for out in eng.step():
                    rid, req = out.request_id, by_id[out.request_id]
                    if out.outputs[0].token_ids and rid not in started:
                        started.add(rid)
                        disp.first_token(rid, req.group, out.metrics.first_token_time)
                    # the newest token's K/V are written by the next step, not this one
                    live[rid] = len(req.prompt_token_ids) + max(len(out.outputs[0].token_ids) - 1, 0)
                    if out.finished:
                        finals[rid] = out
                        live.pop(rid, None)
                        disp.finished(rid, out.metrics.finished_time)
                        bar.update(1)
                if self.kv_trace:
                    trace.add(self._kv_sample(live, by_id, block_size))
        records = [self._record(finals[r.request_id], r, disp.sent_at[r.request_id]) for r in requests
                   if r.request_id in finals]
        if not records:
            raise RuntimeError(f"the engine turned away all {len(rejected)} requests (max_waiting_requests)")
        duration = max(x.finished_time for x in records) - min(x.arrival_time for x in records)
        notes = ["engine step loop; arrival = due time (or time a concurrency seat freed)"]
        if rejected:
            notes.append(f"{len(rejected)} request(s) turned away by max_waiting_requests: no record")
        return BackendRun(
            self.name, self.label, records, duration, self.checkpoint_identity,
            kv_usage=trace.summary() if self.kv_trace else None,
            output_token_ids={rid: list(o.outputs[0].token_ids) for rid, o in finals.items()},
            notes=notes,
        )

    def _kv_sample(self, live: dict[str, int], by_id: dict[str, BenchRequest], block_size: int) -> KVSample:
        s = self.llm.stats().scheduler
        used = s.num_kv_blocks_total - s.num_kv_blocks_free - s.num_kv_blocks_cached
        reserve = sum(math.ceil((len(by_id[r].prompt_token_ids) + by_id[r].output_len) / block_size) for r in live)
        return KVSample(time.perf_counter(), max(used, 0), sum(live.values()), len(live), reserve)

    def close(self) -> None:
        self.llm = None

