"""The PyTorch path with transformers' own continuous batching (`init_continuous_batching`).

transformers runs its scheduler in a background thread; we add requests when the dispatcher says
they are due (so timed arrivals work) and read streamed partial outputs from its queue. Its
`record_timestamps` stamps every generated token (perf_counter), its `lifespan` gives the first
scheduled and finished times. `eos_token_id=-1` disables EOS, so lengths are exact. The KV
cache is sized for max_requests sequences of the workload's longest prompt + output. The manager
is started and warmed up (one tiny request) when the backend is built: the first step of a fresh
manager takes seconds of one-off set-up that is not part of serving.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.hf_loading import load_hf_model
from jaxserve.bench.dispatch import Dispatcher
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.model_files import ModelSpec, files_sha256
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest, at_once


class HFContinuousBackend:
    name = "hf-cb"

    def __init__(self, spec: ModelSpec, max_requests: int = 16, max_batch_tokens: int = 512,
                 label: str | None = None, dtype: str = "float32", max_seq_len: int = 2048,
                 page_size: int = 256) -> None:
        from transformers import GenerationConfig

        t = time.perf_counter()
        self.model = load_hf_model(spec, dtype)
        if not hasattr(self.model, "init_continuous_batching"):
            raise UnsupportedBackend("this transformers' models have no init_continuous_batching")
        self.label = label or f"hf-cb[seqs={max_requests},tokens={max_batch_tokens}]"
        # Size the KV cache for the workload: left unset, transformers takes 90% of free memory,
        # which on a CPU host means most of the machine's RAM.
        num_blocks = max_requests * math.ceil(max_seq_len / page_size) + max_requests
        self.config = {"max_requests_per_batch": max_requests, "max_batch_tokens": max_batch_tokens,
                       "num_blocks": num_blocks, "page_size": page_size}
        try:
            from transformers.generation import ContinuousBatchingConfig
        except ImportError:  # older transformers (before ~5.2x) read these settings off the GenerationConfig
            self.manager = self.model.init_continuous_batching(generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=16, num_blocks=num_blocks, block_size=page_size,
                max_batch_tokens=max_batch_tokens))
        else:
            self.manager = self.model.init_continuous_batching(
                generation_config=GenerationConfig(do_sample=False, max_new_tokens=16),
                continuous_batching_config=ContinuousBatchingConfig(**self.config),
            )
        self.manager.start()
        self._counter = 0
        try:
            self._drain([self._add([1, 2, 3, 4], 2, "hf-cb-warmup")], options=RunOptions(progress=False))
        except BaseException:
            self.manager.stop(block=True, timeout=10)  # the thread is running: never leave it behind
            raise
        self.startup_s = time.perf_counter() - t
        self.checkpoint_identity = files_sha256(spec)

    def _add(self, ids: Sequence[int], n: int, rid: str) -> str:
        try:
            got = self.manager.add_request(list(ids), request_id=rid, max_new_tokens=n, record_timestamps=True,
                                           eos_token_id=-1, streaming=True)
        except TypeError as e:  # an add_request without per-token timestamps or an EOS override
            raise UnsupportedBackend(f"this transformers' continuous batching lacks what hf-cb needs: {e}") from e
        if got is None:
            raise RuntimeError(f"transformers' continuous batching refused request {rid}")
        return got

    def _drain(self, ids: list[str], options: RunOptions) -> dict[str, Any]:
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            r = self.manager.get_result(timeout=1.0)
            if r is None and not self.manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            if r is not None and r.is_finished():
                results[r.request_id] = r
        return results

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        ids = [self._add(r.prompt_token_ids, r.output_len, f"{r.request_id}-{self._next()}") for r in requests]
        self._drain(ids, RunOptions(progress=False))

    def _next(self) -> int:
        self._counter += 1
        return self._counter

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        if any(r.temperature for r in requests):
            raise UnsupportedBackend("hf-cb here decodes greedily; a sampled workload (--temperature) runs on jaxserve")
        run_tag = self._next()
        by_tid = {f"{r.request_id}#{run_tag}": r for r in requests}
        start = time.perf_counter()
        sendable = requests if options.timed_arrivals else [at_once(r) for r in requests]
        disp = Dispatcher(sendable, start, options.max_concurrency)
        finals: dict[str, Any] = {}
        started: set[str] = set()
        with progress_bar(len(requests), self.label, options.progress) as bar:
            while len(finals) < len(requests):
                for r in disp.pop_due(time.perf_counter()):
                    self._add(r.prompt_token_ids, r.output_len, f"{r.request_id}#{run_tag}")
                nxt = disp.next_due()
                wait = 0.5 if nxt is None else max(0.0, min(0.5, nxt - time.perf_counter()))
                res = self.manager.get_result(timeout=wait) if disp.num_in_flight else None
                if res is None:
                    if disp.num_in_flight and not self.manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped")
                    if not disp.num_in_flight and nxt is not None:
                        time.sleep(max(0.0, nxt - time.perf_counter()))
                    continue
                req = by_tid.get(res.request_id)
                if req is None:
                    continue  # a stale partial output of an earlier run
                if res.timestamps and req.request_id not in started:
                    started.add(req.request_id)
                    disp.first_token(req.request_id, req.group, res.timestamps[0])
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"hf-cb request {req.request_id} failed: {res.error}")
                    finals[req.request_id] = res
                    disp.finished(req.request_id, res.lifespan[1])
                    bar.update(1)
        records = [self._record(finals[r.request_id], r, disp.sent_at[r.request_id]) for r in requests]
        duration = max(x.finished_time for x in records) - min(x.arrival_time for x in records)
        return BackendRun(
            self.name, self.label, records, duration, self.checkpoint_identity,
            config={**self.config, "startup_s": self.startup_s},
            output_token_ids={rid: list(res.generated_tokens) for rid, res in finals.items()},
            notes=["transformers continuous batching; token times from record_timestamps"],
        )

    @staticmethod
    def _record(res: Any, req: BenchRequest, arrival: float) -> RequestRecord:
        times = tuple(res.timestamps or ())
        toks = list(res.generated_tokens)
        first = times[0] if times else res.lifespan[1]
        return RequestRecord(
            request_id=req.request_id, prompt_len=len(req.prompt_token_ids), output_len=len(toks),
            arrival_time=min(arrival, first), first_token_time=first, finished_time=max(res.lifespan[1], first),
            first_scheduled_time=res.lifespan[0] if res.lifespan[0] > 0 else None,
            token_times=times if len(times) == len(toks) else (), group=req.group,
        )

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=10)
            self.manager = None
        self.model = None

