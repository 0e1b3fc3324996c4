"""The arrays of LoRA slots: how an adapter's factors are laid into one slot of every projection.

Per projection (models/lora_delta.py reads them), with N slots of rank R and P fused parts:
    lora_a  [in, N, P * R]     slot s's column block: part i's A^T [in, r] at columns i*R .. i*R + r
    lora_b  [N, P * R, out]    slot s's row block: part i's B^T * scale [r, out_i] at rows i*R .. i*R + r
                               and part i's output columns; everything else zero
A smaller rank is padded with zero columns / rows (they add nothing), a part or a projection the
adapter does not target stays zero, and the scale is folded into B, so the step's arithmetic is
the same for every adapter. Under tensor parallelism lora_b's columns follow the base kernel's
shard-major order (lora/targets.py), and the arrays split with their projection
(parallel/sharding.py): a column-parallel one's A replicated and B split by output columns, a
row-parallel one's A split by input rows and B replicated. An adapter's slot values are built once, on the host, when it is
registered (`slot_values`), and loading it into a slot is a copy of them (lora/device_slots.py).
"""

from __future__ import annotations

import numpy as np

from jaxserve.lora.peft_adapter import PeftAdapter
from jaxserve.lora.targets import LoRATargets
from jaxserve.models.tensor_layout import Path

LORA_A, LORA_B = "lora_a", "lora_b"


def empty_slots(targets: LoRATargets, max_loras: int, max_rank: int, dtype) -> dict[Path, dict[str, np.ndarray]]:
    """Every projection's zero slot arrays (what a fresh engine holds: no adapter resident)."""
    out = {}
    for path, module in targets.modules.items():
        pr = len(module.parts) * max_rank
        out[path] = {LORA_A: np.zeros((module.in_features, max_loras, pr), dtype),
                     LORA_B: np.zeros((max_loras, pr, module.stored_out_features), dtype)}
    return out


def slot_values(adapter: PeftAdapter, targets: LoRATargets, max_rank: int) -> dict[Path, tuple[np.ndarray, np.ndarray]]:
    """One slot's (a [in, P*R], b [P*R, out]) float32 per projection, for `adapter`."""
    values = {path: (np.zeros((m.in_features, len(m.parts) * max_rank), np.float32),
                     np.zeros((len(m.parts) * max_rank, m.out_features), np.float32))
              for path, m in targets.modules.items()}
    for name, f in adapter.factors.items():
        part = targets.parts[name]
        a, b = values[part.path]
        rows = slice(part.index * max_rank, part.index * max_rank + f.rank)
        a[:, rows] = f.a.T
        b[rows, part.column:part.column + part.out_features] = f.b.T * np.float32(f.scale)
    # tensor parallelism: lora_b's columns in the base kernel's shard-major order
    return {path: (a, b if targets.modules[path].columns is None else np.ascontiguousarray(b[:, targets.modules[path].columns]))
            for path, (a, b) in values.items()}
