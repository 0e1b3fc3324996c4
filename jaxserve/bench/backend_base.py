"""What every backend returns: the records of one run, plus what the engine says about itself.

A backend is built once per model (loading weights and compiling is not part of any timed run)
and then `run` is called with the workload's requests; it returns a `BackendRun`. Backends differ
in what they can observe, and say so in `notes` rather than inventing numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.workloads import BenchRequest


@dataclass(frozen=True, slots=True)
class RunOptions:
    max_concurrency: int | None = None  # requests in flight at once (None: unlimited)
    progress: bool = True               # show a progress bar
    timed_arrivals: bool = False        # honour arrival offsets (False: send everything at once)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(slots=True)
class BackendRun:
    backend: str                                   # "jaxserve", "hf", "hf-cb", "vllm", ...
    label: str                                     # backend plus its variant, e.g. "jaxserve[chunk=256]"
    records: list[RequestRecord]
    duration_s: float                              # first arrival -> last finish (wall clock)
    checkpoint_identity: str
    config: dict[str, Any] = field(default_factory=dict)
    engine_stats: dict[str, Any] | None = None
    kv_usage: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    output_token_ids: dict[str, list[int]] = field(default_factory=dict)  # for cross-backend agreement


class Backend(Protocol):
    name: str
    label: str

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun: ...

    def close(self) -> None: ...


class UnsupportedBackend(RuntimeError):
    """A backend that cannot run here (not installed, or lacks the feature): skipped with this message."""
