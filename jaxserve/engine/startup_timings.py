"""StartupTimings: where an engine's start-up went, phase by phase.

`build_engine` records one (reachable as `engine.startup_timings`) and logs it at INFO as one line;
`scripts/bench_startup.py` reads that line from `jaxserve generate` and `jaxserve serve`.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator


@dataclass(frozen=True, slots=True)
class StartupTimings:
    weights: float = 0.0        # reading (and for a GGUF dequantizing) the checkpoint's tensors
    tokenizer: float = 0.0      # building the tokenizer
    identity: float = 0.0       # the checkpoint identity hash (or finding it in the cache)
    params: float = 0.0         # host tensors -> device params in the engine's layout and dtype
    kv_arena: float = 0.0       # allocating the KV arena (and the host swap pool)
    executables: float = 0.0    # loading (or compiling) the steps and samplers, and the block-copy helpers
    warm_up: float = 0.0        # first runs of the steps, so that no request pays one
    calibration: float = 0.0    # timing measurements (and the steps they load), or reading them from the cache
    draft_model: float = 0.0    # speculative decoding's draft model: loading, compiling, warming, timing it
    total: float = 0.0          # wall clock of the whole build, from its first phase to the engine

    PREFIX = "start-up"

    @classmethod
    def phase_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "total")

    def phases(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.phase_names()}

    @property
    def other(self) -> float:
        """What no phase accounts for (building the scheduler and the engine, bookkeeping)."""
        return max(0.0, self.total - sum(self.phases().values()))

    def plus(self, **seconds: float) -> "StartupTimings":
        """These timings with `seconds` added to the named phases and to the total."""
        added = {name: getattr(self, name) + s for name, s in seconds.items()}
        return dataclasses.replace(self, **added, total=self.total + sum(seconds.values()))

    def describe(self) -> str:
        """One line: "start-up 8.1 s: weights 0.61, tokenizer 0.37, ... (other 0.02)"."""
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases().items())
        return f"{self.PREFIX} {self.total:.1f} s: {parts} (other {self.other:.2f})"

    @classmethod
    def parse(cls, line: str) -> "StartupTimings":
        """The timings a `describe()` line holds (the line may carry a log prefix)."""
        text = line[line.index(cls.PREFIX) + len(cls.PREFIX):]
        total, _, rest = text.partition(" s: ")
        values = {"total": float(total)}
        for item in rest.split(" (other")[0].split(", "):
            name, _, seconds = item.rpartition(" ")
            values[name] = float(seconds)
        return cls(**values)


class PhaseClock:
    """Adds up the seconds spent in named phases; `timings()` closes the books."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        if name not in StartupTimings.phase_names():
            raise ValueError(f"unknown start-up phase {name!r}; phases: {StartupTimings.phase_names()}")
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def timings(self) -> StartupTimings:
        return StartupTimings(**self._seconds, total=time.perf_counter() - self._start)
