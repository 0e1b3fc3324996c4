"""Backends the benchmarks compare; `make_backend` builds one by name."""

from __future__ import annotations

from typing import Any

from jaxserve.bench.backend_base import Backend, BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.model_files import ModelSpec

BACKENDS = ("jaxserve", "hf", "hf-compiled", "hf-cb", "vllm", "llamacpp", "esurge")


def make_backend(name: str, spec: ModelSpec, *, engine_kwargs: dict[str, Any] | None = None,
                 label: str | None = None, hf_batch_size: int = 16, hf_cb_max_requests: int = 16,
                 hf_cb_max_batch_tokens: int = 512, jaxserve_api: str = "auto", max_seq_len: int = 2048,
                 dtype: str = "float32", progress: bool = True) -> Backend:
    """Load a backend (weights, compilation, warm threads): nothing here is timed. `progress`
    shows loading bars (jaxserve's compiling and warm-up, transformers' weight loading)."""
    if name == "jaxserve":
        from jaxserve.bench.backend_jaxserve import JaxServeBackend

        return JaxServeBackend(spec.path, engine_kwargs, label=label, api=jaxserve_api, progress=progress)
    if name in ("hf", "hf-compiled", "hf-cb") and not progress:
        from jaxserve.bench.hf_loading import disable_progress_bars

        disable_progress_bars()
    if name == "hf":
        from jaxserve.bench.backend_hf import HFStaticBackend

        return HFStaticBackend(spec, batch_size=hf_batch_size, label=label, dtype=dtype)
    if name == "hf-compiled":
        from jaxserve.bench.backend_hf import HFStaticBackend

        return HFStaticBackend(spec, batch_size=hf_batch_size, label=label, dtype=dtype, compiled=True,
                               max_seq_len=max_seq_len)
    if name == "hf-cb":
        from jaxserve.bench.backend_hf_cb import HFContinuousBackend

        return HFContinuousBackend(spec, hf_cb_max_requests, hf_cb_max_batch_tokens, label=label,
                                   max_seq_len=max_seq_len, dtype=dtype)
    if name == "vllm":
        from jaxserve.bench.backend_vllm import VLLMBackend

        return VLLMBackend(spec, label=label)
    if name == "llamacpp":
        from jaxserve.bench.backend_llamacpp import LlamaCppBackend

        return LlamaCppBackend(spec, max_seq_len=max_seq_len, label=label)
    if name == "esurge":
        from jaxserve.bench.backend_esurge import ESurgeBackend

        return ESurgeBackend(spec, engine_kwargs, max_seq_len=max_seq_len, dtype=dtype, label=label)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


def parse_backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--backend names no backend")
    for n in names:
        if n not in BACKENDS:
            raise ValueError(f"unknown backend {n!r}; choose from {', '.join(BACKENDS)}")
    return names


__all__ = ["BACKENDS", "Backend", "BackendRun", "RunOptions", "UnsupportedBackend", "make_backend", "parse_backends"]
