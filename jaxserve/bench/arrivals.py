"""When each request is sent: all at once, Poisson, or gamma-distributed gaps (vLLM's semantics).

Offsets are seconds after the start of the run. With `request_rate = inf` every request is sent
at 0. Otherwise the gaps between consecutive requests are drawn from a gamma distribution with
shape = burstiness and scale = 1 / (request_rate * burstiness): the mean gap is 1 / request_rate
whatever the burstiness; burstiness 1 is a Poisson process, smaller values are burstier and
larger values more regular. The first request is sent at 0.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`num` non-decreasing send offsets in seconds, reproducible for a given seed."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist() if num else []


def parse_rate(text: str) -> float:
    """'inf' or a positive number of requests per second."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return value
