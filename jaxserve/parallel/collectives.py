"""The collectives in a compiled step: read from its optimized HLO text.

What XLA's SPMD partitioner inserted is visible only after compilation (the lowered program
holds named shardings, not collectives). Tests and `jaxserve.bench.tp_report` count them to
check the partition is the one designed: per layer one all-reduce after attention and one after
the MLP, plus, when the vocabulary is split, one for the embedding lookup and one all-gather of
the sampled rows' logits; never an all-gather of a weight or of the KV arena.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = f32[4,64]{1,0} all-reduce(`, or its async form `all-reduce-start(` (a tuple result: the
# first element's shape is reported)
_OP = re.compile(r"=\s*(\([^)]*\)|\S+)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}.get(self.dtype, 4)
        n = 1
        for d in self.shape:
            n *= d
        return n * size


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of an optimized HLO module's text, in order."""
    found = []
    for result, kind in _OP.findall(hlo_text):
        m = _SHAPE.search(result)
        dims = tuple(int(d) for d in m.group(2).split(",") if d) if m else ()
        found.append(Collective(kind, m.group(1) if m else "", dims))
    return found


def count_by_kind(ops: list[Collective]) -> dict[str, int]:
    counts = {k: 0 for k in KINDS}
    for op in ops:
        counts[op.kind] += 1
    return counts
