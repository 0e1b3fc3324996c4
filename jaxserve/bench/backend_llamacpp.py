"""llama.cpp on the same GGUF, through llama-cpp-python (an optional extra: `pip install -e .[llamacpp]`).

The binding runs one sequence at a time, so requests go one after another in workload order, each
from a fresh context (no prefix reuse): what it measures is batch-1 prefill and decode, the
comparison the quantization benchmark asks for. Greedy only (top_k 1, temperature 0, no repeat
penalty), for as many tokens as the request asks whatever the model samples (EOS included), like
the other backends with EOS ignored. Every token's time is observed as the generator yields it.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.model_files import ModelSpec, files_sha256
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest


class LlamaCppBackend:
    name = "llamacpp"

    def __init__(self, spec: ModelSpec, *, max_seq_len: int = 2048, n_threads: int | None = None,
                 label: str | None = None) -> None:
        if spec.kind != "gguf":
            raise UnsupportedBackend(f"llamacpp reads GGUF files; {spec.path!r} is a Hugging Face directory")
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise UnsupportedBackend(f"llamacpp needs llama-cpp-python ({e}): pip install -e .[llamacpp]") from e
        self.n_threads = n_threads or len(os.sched_getaffinity(0))
        self.label = label or f"llamacpp[threads={self.n_threads}]"
        t = time.perf_counter()
        self.llm = Llama(model_path=spec.path, n_ctx=max_seq_len, n_threads=self.n_threads,
                         n_threads_batch=self.n_threads, verbose=False)
        self.startup_s = time.perf_counter() - t
        self.max_seq_len = max_seq_len
        self.checkpoint_identity = files_sha256(spec)

    def _generate(self, r: BenchRequest) -> tuple[list[int], list[float]]:
        if len(r.prompt_token_ids) + r.output_len > self.max_seq_len:
            raise ValueError(f"request {r.request_id!r}: {len(r.prompt_token_ids)} + {r.output_len} tokens exceed "
                             f"llamacpp's context of {self.max_seq_len}")
        tokens, times = [], []
        for t in self.llm.generate(list(r.prompt_token_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                   repeat_penalty=1.0, reset=True):
            tokens.append(int(t))
            times.append(time.perf_counter())
            if len(tokens) == r.output_len:
                break
        return tokens, times

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        if requests:
            self._generate(requests[0])

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        if any(r.temperature for r in requests):
            raise UnsupportedBackend("llamacpp here decodes greedily; a sampled workload (--temperature) runs on jaxserve")
        if options.timed_arrivals:
            raise UnsupportedBackend("llamacpp runs one request at a time: use --request-rate inf")
        records, outputs = [], {}
        t0 = time.perf_counter()
        with progress_bar(len(requests), self.label, options.progress) as bar:
            for r in requests:
                start = time.perf_counter()
                toks, times = self._generate(r)
                outputs[r.request_id] = toks
                records.append(RequestRecord(
                    request_id=r.request_id, prompt_len=len(r.prompt_token_ids), output_len=len(toks),
                    arrival_time=t0, first_token_time=times[0], finished_time=times[-1],
                    first_scheduled_time=start, token_times=tuple(times), group=r.group))
                bar.update(1)
        return BackendRun(
            self.name, self.label, records, time.perf_counter() - t0, self.checkpoint_identity,
            config={"n_threads": self.n_threads, "startup_s": self.startup_s, "n_ctx": self.max_seq_len},
            output_token_ids=outputs,
            notes=["one request at a time (the binding decodes one sequence), each from a fresh context"])

    def close(self) -> None:
        self.llm = None
