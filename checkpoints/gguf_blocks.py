"""llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks as QuantizedTensors, read from the raw bytes.

A block covers 32 consecutive inputs of one output row and starts with its float16 scale `d`
(and for Q4_1 a float16 minimum `m`):
    Q8_0  d, 32 x int8 q                 w = d * q
    Q4_0  d, 16 bytes of nibbles         w = d * (nibble - 8)
    Q4_1  d, m, 16 bytes of nibbles      w = d * nibble + m
Nibble j of a block is byte j's low half for j < 16 and byte j-16's high half otherwise: the
packing models/quantized_tensor.py uses, so the bytes are kept as they are. Nothing is
dequantized: the scales widen from float16 to float32 (exact), the quantized values are copied.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor

QK = 32
# GGML type name -> (bytes per block, kind, has a minimum)
BLOCKS = {"Q8_0": (2 + QK, "int8", False), "Q4_0": (2 + QK // 2, "int4", False), "Q4_1": (4 + QK // 2, "int4", True)}


def native_kind(type_name: str) -> str | None:
    """"int8" / "int4" for a block type read natively, else None."""
    return BLOCKS[type_name][1] if type_name in BLOCKS else None


def block_tensor(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    """data: the tensor's raw uint8 bytes (rows x bytes per row); shape: HF [out, in]."""
    size, kind, has_min = BLOCKS[type_name]
    out, n = shape
    blocks = np.asarray(data, np.uint8).reshape(out, n // QK, size)
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)   # [out, G]
    offset = None
    start = 2
    if has_min:
        offset = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        start = 4
    body = np.ascontiguousarray(blocks[..., start:]).reshape(out, -1)
    qweight = body.view(np.int8) if kind == "int8" else body
    return QuantizedTensor(kind, qweight, scale, offset)
