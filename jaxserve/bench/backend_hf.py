"""The PyTorch path with static batching: HF transformers `generate`, left padding, greedy.

Requests are cut into consecutive batches (default 16) in workload order; each batch generates
max(output_len) tokens for every row (min_new_tokens = max_new_tokens, so EOS never ends a row
early), and each request keeps its own first output_len tokens: only those count as output
("useful tokens"), as in vLLM's HF throughput baseline.

What static `generate` lets us observe: a StoppingCriteria hook runs after every decoding step
and stamps the time, so token i of every row in a batch gets that step's time (TTFT and ITL
are real). A request is only handed back when its whole batch returns, so its finished time is
the batch's end (E2E and TPOT include waiting for longer rows). Every request arrives at the
start of the run; a later batch's requests wait in the queue for the earlier batches.

`hf-compiled` is the same path as the PyTorch side serves it at its best on one machine: a static
KV cache (`cache_implementation="static"`, sized once for the run's longest sequence) and the
decode step `torch.compile`d (transformers' own compile of generate's decoding forward, asked for
on every device; the prompt's forward stays eager, as transformers runs it). Every batch is padded
to the batch size with copies of its first request, so the compiled step meets one shape; the
copies' tokens are not counted. Its compilation runs in the warmup, untimed.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.hf_loading import load_hf_model, pad_token_id
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.model_files import ModelSpec, files_sha256
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest


class _StepClock:
    """A stopping criterion that never stops: it records when each generation step ended."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFStaticBackend:
    def __init__(self, spec: ModelSpec, batch_size: int = 16, label: str | None = None, dtype: str = "float32",
                 *, compiled: bool = False, max_seq_len: int = 2048) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.compiled = compiled
        self.name = "hf-compiled" if compiled else "hf"
        self.label = label or f"{self.name}[batch={batch_size}]"
        self.max_cache_len = max_seq_len
        self.compile_config = _compile_everywhere() if compiled else None
        t = time.perf_counter()
        self.model = load_hf_model(spec, dtype)
        self.startup_s = time.perf_counter() - t
        self.pad_id = pad_token_id(self.model)
        self.checkpoint_identity = files_sha256(spec)

    def _generate(self, batch: Sequence[BenchRequest]) -> tuple[Any, list[float], int]:
        import torch
        from transformers import StoppingCriteriaList

        if self.compiled:     # one shape for the compiled step: whole batches (the copies are not counted)
            batch = list(batch) + [batch[0]] * (self.batch_size - len(batch))
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends at the same column
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        n = max(r.output_len for r in batch)
        clock = _StepClock()
        dev = self.model.device
        static = (dict(cache_implementation="static", max_cache_len=max(self.max_cache_len, width + n),
                       compile_config=self.compile_config) if self.compiled else {})
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([clock]), **static,
            )
        return out.cpu(), clock.times, width

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        if requests:
            self._generate(list(requests)[: self.batch_size])

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        if any(r.temperature for r in requests):
            raise UnsupportedBackend("hf (static batching) here decodes greedily; a sampled workload (--temperature) runs on jaxserve")
        if options.timed_arrivals or options.max_concurrency is not None:
            raise UnsupportedBackend("hf (static batching) sends every request at once: "
                                     "use --request-rate inf and no --max-concurrency, or hf-cb")
        records, outputs = [], {}
        t0 = time.perf_counter()
        with progress_bar(len(requests), self.label, options.progress) as bar:
            for b in range(0, len(requests), self.batch_size):
                batch = requests[b:b + self.batch_size]
                start = time.perf_counter()
                out, times, width = self._generate(batch)
                end = time.perf_counter()
                for i, r in enumerate(batch):
                    toks = out[i, width:width + r.output_len].tolist()
                    outputs[r.request_id] = toks
                    records.append(RequestRecord(
                        request_id=r.request_id, prompt_len=len(r.prompt_token_ids), output_len=len(toks),
                        arrival_time=t0, first_token_time=times[0], finished_time=end,
                        first_scheduled_time=start, token_times=tuple(times[:len(toks)]), group=r.group,
                    ))
                bar.update(len(batch))
        notes = ["token times are the batch's step times; a request finishes when its batch returns",
                 "each batch generates its longest output for every row; only requested tokens count"]
        config = {"batch_size": self.batch_size, "startup_s": self.startup_s, "padding": "left"}
        if self.compiled:
            config.update(cache="static", max_cache_len=self.max_cache_len, compiled="decode step (inductor)")
            notes.append("static KV cache; the decode step torch.compile'd (compiled in the warmup); batches "
                         "padded to batch_size rows")
        return BackendRun(self.name, self.label, records, time.perf_counter() - t0, self.checkpoint_identity,
                          config=config, output_token_ids=outputs, notes=notes)

    def close(self) -> None:
        self.model = None


def _compile_everywhere():
    """transformers' compile of generate's decoding forward, on the CPU too (it compiles only on
    accelerators unless asked): static shapes, inductor's default mode (reduce-overhead's CUDA
    graphs have no CPU counterpart)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True
    return config
