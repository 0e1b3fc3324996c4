"""The configurations `jaxserve bench sweep` measures: a grid over four engine settings.

Every axis is an EngineConfig field that changes the shape of the compiled decode step:
max_model_len and block_size (through the KV table's width, ceil((max_model_len + prefill_tile)
/ block_size) blocks), prefill_tile (the same width) and max_num_seqs (the rows of a full batch).
By default one axis varies at a time from the default configuration (what a user who changes
one flag gets); `full` takes every combination.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

AXES = ("max_model_len", "max_num_seqs", "block_size", "prefill_tile")
GRIDS = ("axes", "full")


@dataclass(frozen=True, slots=True)
class SweepPoint:
    label: str                     # "default", "max_model_len=1024", or every setting for --grid full
    settings: dict[str, int]       # one value per axis
    varied: tuple[str, ...]        # the axes that differ from the default configuration

    @property
    def is_default(self) -> bool:
        return not self.varied


def parse_values(text: str, flag: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024): positive, sorted, no duplicates."""
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{flag} must list positive integers, got {text!r}")
    return tuple(values)


def sweep_points(default: Mapping[str, int], axes: Mapping[str, Sequence[int]], grid: str = "axes") -> list[SweepPoint]:
    """The default configuration first, then the grid's other points, each once."""
    if grid not in GRIDS:
        raise ValueError(f"grid={grid!r} must be one of {GRIDS}")
    missing = [a for a in AXES if a not in default or a not in axes]
    if missing:
        raise ValueError(f"every axis needs a default and a list of values; missing: {missing}")
    base = {a: int(default[a]) for a in AXES}
    if grid == "axes":
        candidates = [{**base, axis: v} for axis in AXES for v in axes[axis]]
    else:
        candidates = [dict(zip(AXES, combo)) for combo in itertools.product(*(axes[a] for a in AXES))]
    points = [SweepPoint("default", base, ())]
    seen = {tuple(base.values())}
    for settings in candidates:
        key = tuple(settings.values())
        if key in seen:
            continue
        seen.add(key)
        varied = tuple(a for a in AXES if settings[a] != base[a])
        shown = varied if grid == "axes" else AXES
        points.append(SweepPoint(", ".join(f"{a}={settings[a]}" for a in shown), settings, varied))
    return points
