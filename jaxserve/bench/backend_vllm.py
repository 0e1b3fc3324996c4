"""vLLM, where it is importable (GPU machines): its engine's step loop, timed from our side.

vLLM's per-request metrics differ between versions, so this driver stamps times itself: a token
counts as produced when the `step()` that returned it ends. Requests are added as the dispatcher
says they are due, exactly as for jaxserve's step loop.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.dispatch import Dispatcher
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.model_files import ModelSpec, files_sha256
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest, at_once


class VLLMBackend:
    name = "vllm"

    def __init__(self, spec: ModelSpec, engine_kwargs: dict[str, Any] | None = None, label: str | None = None) -> None:
        try:
            import vllm
        except ImportError as e:
            raise UnsupportedBackend(f"vllm is not importable here: {e}") from e
        self._vllm = vllm
        self.label = label or "vllm"
        kwargs = dict(engine_kwargs or {})
        if spec.kind == "gguf":
            kwargs.setdefault("tokenizer", spec.directory)
        t = time.perf_counter()
        self.llm = vllm.LLM(model=spec.path, **kwargs)
        self.startup_s = time.perf_counter() - t
        self.engine_kwargs = kwargs
        self.checkpoint_identity = files_sha256(spec)

    def _params(self, n: int) -> Any:
        return self._vllm.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        if requests:
            self.llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                              [self._params(r.output_len) for r in requests], use_tqdm=False)

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        eng = self.llm.llm_engine
        by_id = {r.request_id: r for r in requests}
        start = time.perf_counter()
        disp = Dispatcher(requests if options.timed_arrivals else [at_once(r) for r in requests],
                          start, options.max_concurrency)
        times: dict[str, list[float]] = {r.request_id: [] for r in requests}
        finals: dict[str, Any] = {}
        with progress_bar(len(requests), self.label, options.progress) as bar:
            while disp.has_waiting or eng.has_unfinished_requests():
                for r in disp.pop_due(time.perf_counter()):
                    eng.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_token_ids)},
                                    self._params(r.output_len))
                if not eng.has_unfinished_requests():
                    nxt = disp.next_due()
                    if nxt is None:
                        raise RuntimeError("requests wait for a group that can never start")
                    time.sleep(max(0.0, nxt - time.perf_counter()))
                    continue
                outs = eng.step()
                now = time.perf_counter()
                for out in outs:
                    rid = out.request_id
                    new = len(out.outputs[0].token_ids) - len(times[rid])
                    if new > 0 and not times[rid]:
                        disp.first_token(rid, by_id[rid].group, now)
                    times[rid].extend([now] * max(new, 0))
                    if out.finished:
                        finals[rid] = out
                        disp.finished(rid, now)
                        bar.update(1)
        records = []
        for r in requests:
            ts, toks = times[r.request_id], list(finals[r.request_id].outputs[0].token_ids)
            records.append(RequestRecord(
                request_id=r.request_id, prompt_len=len(r.prompt_token_ids), output_len=len(toks),
                arrival_time=disp.sent_at[r.request_id], first_token_time=ts[0], finished_time=ts[-1],
                token_times=tuple(ts) if len(ts) == len(toks) else (), group=r.group,
            ))
        duration = max(x.finished_time for x in records) - min(x.arrival_time for x in records)
        return BackendRun(
            self.name, self.label, records, duration, self.checkpoint_identity,
            config={"engine_kwargs": self.engine_kwargs, "startup_s": self.startup_s,
                    "version": getattr(self._vllm, "__version__", "?")},
            output_token_ids={rid: list(o.outputs[0].token_ids) for rid, o in finals.items()},
            notes=["vllm step loop; token times stamped when the step returning them ended"],
        )

    def close(self) -> None:
        self.llm = None
