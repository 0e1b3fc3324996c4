"""Which request rates a goodput sweep runs: a fixed list, or a bisection for the goodput.

`--request-rate 1,2,4` runs those rates; `--request-rate search:LOW:HIGH` looks for the highest
rate whose SLO attainment reaches the target within a few probes. The search assumes attainment
does not rise with the rate (more load never helps latency) and works in ratios, since rates span
orders of magnitude: it probes LOW (a miss there ends it: the goodput is below the range), then
HIGH (a pass ends it: the goodput is at least HIGH), then the geometric midpoint of the highest
passing and the lowest failing rate, until the two are within `resolution` of each other or the
probes run out. Its answer is the highest rate that passed, so a noisy probe can make it
pessimistic, never optimistic: every rate it reports was measured.

`RateSearch` is a small state machine (next_rate / observe), so the sweep can take turns between
several engine variants, one probe each, and so it is tested without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jaxserve.bench.arrivals import parse_rate

RATE_USAGE = "expected a comma-separated list of rates (e.g. 0.5,1,2,inf) or search:LOW:HIGH (e.g. search:0.25:4)"


@dataclass(frozen=True, slots=True)
class RatePlan:
    rates: tuple[float, ...] = ()                  # a fixed sweep, in the order given
    search: tuple[float, float] | None = None      # (low, high) to bisect between

    @classmethod
    def parse(cls, text: str) -> "RatePlan":
        s = str(text).strip()
        if s.lower().startswith("search"):
            parts = s.split(":")
            try:
                low, high = float(parts[1]), float(parts[2])
            except (IndexError, ValueError):
                raise ValueError(f"bad request rate {text!r}: {RATE_USAGE}") from None
            if len(parts) != 3 or not (0 < low < high < math.inf):
                raise ValueError(f"bad request rate {text!r}: search needs 0 < LOW < HIGH, both finite")
            return cls(search=(low, high))
        try:
            rates = tuple(parse_rate(t.strip()) for t in s.split(","))
        except ValueError:
            raise ValueError(f"bad request rate {text!r}: {RATE_USAGE}") from None
        return cls(rates=rates)

    def __str__(self) -> str:
        if self.search:
            return f"search:{self.search[0]:g}:{self.search[1]:g}"
        return ",".join("inf" if math.isinf(r) else f"{r:g}" for r in self.rates)


def _round3(x: float) -> float:
    """Three significant digits: probe rates people can read and type again."""
    return float(f"{x:.3g}")


@dataclass
class RateSearch:
    low: float
    high: float
    target: float = 0.9            # attainment a rate must reach to pass
    max_probes: int = 6
    resolution: float = 1.15       # stop when lowest failing / highest passing <= this
    probes: list[tuple[float, float]] = field(default_factory=list)   # (rate, attainment), in order

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high < math.inf:
            raise ValueError(f"need 0 < low < high < inf, got {self.low}, {self.high}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {self.target}")
        if self.max_probes < 2:
            raise ValueError(f"max_probes must be >= 2 (low and high), got {self.max_probes}")
        if not self.resolution > 1:
            raise ValueError(f"resolution must be > 1, got {self.resolution}")

    def _passes(self, attainment: float) -> bool:
        return attainment == attainment and attainment >= self.target   # NaN (nothing sent) fails

    @property
    def passing(self) -> float | None:
        """The highest rate that passed."""
        return max((r for r, a in self.probes if self._passes(a)), default=None)

    @property
    def failing(self) -> float | None:
        """The lowest rate that failed above the highest that passed."""
        lo = self.passing
        return min((r for r, a in self.probes if not self._passes(a) and (lo is None or r > lo)), default=None)

    def next_rate(self) -> float | None:
        """The next rate to probe, or None when the search is over."""
        if len(self.probes) >= self.max_probes:
            return None
        if not self.probes:
            return self.low
        lo, hi = self.passing, self.failing
        if lo is None:
            return None                       # LOW missed: the goodput lies below the range
        if hi is None:
            probed = {r for r, _ in self.probes}
            return None if self.high in probed else self.high
        if hi / lo <= self.resolution:
            return None
        mid = math.sqrt(lo * hi)
        rounded = _round3(mid)
        return rounded if lo < rounded < hi else mid

    def observe(self, rate: float, attainment: float) -> None:
        self.probes.append((rate, attainment))

    def as_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "target": self.target, "max_probes": self.max_probes,
                "probes": [{"rate": r, "attainment": a} for r, a in self.probes],
                "goodput_rate": self.passing, "lowest_failing_rate": self.failing}
