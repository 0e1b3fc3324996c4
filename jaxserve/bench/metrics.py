"""Per-request timings and the summary statistics every benchmark reports.

A backend turns each request into a `RequestRecord` (perf_counter timestamps); `summarize` turns
a run's records into `BenchmarkMetrics`. The definitions follow vLLM's serving benchmark so the
numbers can be read side by side with its output:

- TTFT (time to first token) = first_token_time - arrival_time.
- E2E (end-to-end latency) = finished_time - arrival_time.
- TPOT (time per output token) = (E2E - TTFT) / (output_len - 1), for requests with at least two
  output tokens (a one-token request has no decode phase and is left out, as in vLLM).
- ITL (inter-token latency) = differences of consecutive `token_times` of one request, pooled
  over all requests. Backends that cannot observe per-token times leave `token_times` empty and
  contribute no ITL samples. A request read from an HTTP stream of text chunks (`chunked`: a
  chunk may hold several tokens) has one time per non-empty chunk, so its ITL samples are the
  gaps between chunks; its output_len is the server's count.
- Queue time = first_scheduled_time - arrival_time (requests without that time are left out).
- Duration = last finished_time - first arrival_time; request throughput = completed requests /
  duration; output throughput = sum of output tokens / duration; total throughput adds the prompt
  tokens.
- Percentiles: `numpy.percentile` with its default linear interpolation (vLLM computes them the
  same way): for sorted samples x[0..n-1], percentile p sits at rank r = p/100 * (n-1) and is
  x[floor(r)] + (r - floor(r)) * (x[ceil(r)] - x[floor(r)]). The median is the 50th percentile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one backend observed for one request; all times are time.perf_counter() seconds."""

    request_id: str
    prompt_len: int
    output_len: int                      # output tokens counted for this request
    arrival_time: float                  # when the request was (meant to be) sent
    first_token_time: float
    finished_time: float
    first_scheduled_time: float | None = None
    token_times: tuple[float, ...] = ()  # one per output token, or empty where not observable
    num_cached_tokens: int = 0           # prompt tokens served from a prefix cache
    group: str = ""                      # the workload's label, e.g. "chat" or "long"
    chunked: bool = False                # token_times: one per streamed chunk, not per token


    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.output_len < 0:
            raise ValueError(f"output_len must be >= 0, got {self.output_len}")
        if self.first_token_time < self.arrival_time:
            raise ValueError(
                f"first_token_time {self.first_token_time} is before arrival_time {self.arrival_time}"
            )
        if self.finished_time < self.first_token_time:
            raise ValueError(
                f"finished_time {self.finished_time} is before first_token_time {self.first_token_time}"
            )
        if self.chunked and len(self.token_times) > self.output_len:
            raise ValueError(
                f"token_times has {len(self.token_times)} chunks for output_len {self.output_len}"
            )
        if not self.chunked and self.token_times and len(self.token_times) != self.output_len:
            raise ValueError(
                f"token_times has {len(self.token_times)} entries for output_len {self.output_len}"
            )

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_times"] = list(self.token_times)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**{**d, "token_times": tuple(d.get("token_times", ()))})


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """mean / median / percentiles of one latency, in seconds; n = number of samples."""

    n: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, samples: Iterable[float]) -> "LatencyStats":
        x = np.asarray(list(samples), dtype=np.float64)
        if x.size == 0:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        p50, p90, p99 = np.percentile(x, PERCENTILES)  # linear interpolation, as documented above
        return cls(int(x.size), float(x.mean()), float(p50), float(p90), float(p99), float(x.max()))


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """The summary of one run (one backend, one workload)."""

    completed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float    # requests / s
    output_throughput: float     # output tokens / s
    total_throughput: float      # (prompt + output) tokens / s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    queue: LatencyStats
    num_cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> BenchmarkMetrics:
    """Summary statistics of one run; duration defaults to first arrival -> last finish."""
    if not records:
        raise ValueError("records must not be empty")
    if duration_s is None:
        duration_s = max(r.finished_time for r in records) - min(r.arrival_time for r in records)
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    prompt = sum(r.prompt_len for r in records)
    output = sum(r.output_len for r in records)
    tpots = [t for r in records if (t := r.tpot) is not None]
    queues = [q for r in records if (q := r.queue_time) is not None]
    return BenchmarkMetrics(
        completed=len(records),
        duration_s=duration_s,
        total_prompt_tokens=prompt,
        total_output_tokens=output,
        request_throughput=len(records) / duration_s,
        output_throughput=output / duration_s,
        total_throughput=(prompt + output) / duration_s,
        ttft=LatencyStats.of(r.ttft for r in records),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of(x for r in records for x in r.itls),
        e2e=LatencyStats.of(r.e2e for r in records),
        queue=LatencyStats.of(queues),
        num_cached_tokens=sum(r.num_cached_tokens for r in records),
    )


def metrics_from_dict(d: dict[str, Any]) -> BenchmarkMetrics:
    """Inverse of BenchmarkMetrics.as_dict (for `bench report` and `plan`)."""
    lat = {k: LatencyStats(**d[k]) for k in ("ttft", "tpot", "itl", "e2e", "queue")}
    plain = {k: v for k, v in d.items() if k not in lat and k != "prefix_hit_rate"}
    return BenchmarkMetrics(**plain, **lat)
