"""A compiled call's small host arrays as one buffer: one transfer per call instead of one per array.

Every numpy array handed to a compiled function is its own host-to-device transfer, with its own
buffer to allocate and its own bookkeeping in the runtime: about 4 us an array on our CPU
(docs/benchmarks.md "The host path"), more on a GPU, where each is a separate copy. A decode step
hands over about 20 (the step's token ids, positions, slots, block tables and counts; the
sampler's temperatures, top-k/p, seeds and banned ids), whatever the batch size. An
`InputLayout` places such arrays, each of a 4-byte type (int32, uint32, float32) or bool, side by
side in one int32 buffer: the host `pack`s them (one concatenation), the compiled function
`unpack`s them (slices and bitcasts, exact bit for bit), and the program is otherwise the one it
was. The layout is fixed by the shapes a program is compiled for, so it is built once per program.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)
PACKABLE = frozenset({np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(bool)})


@dataclass(frozen=True)
class _Field:
    name: str
    offset: int                  # in int32 words
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class InputLayout:
    """Where each named array lives in one int32 buffer of `size` words (in name order)."""

    fields: tuple[_Field, ...]
    size: int

    @classmethod
    def of(cls, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> InputLayout:
        """A layout for arrays of these (shape, dtype), every dtype in PACKABLE."""
        fields, offset = [], 0
        for name in sorted(shapes):
            shape, dtype = shapes[name]
            dtype = np.dtype(dtype)
            if dtype not in PACKABLE:
                raise ValueError(f"{name}: dtype {dtype} cannot be packed (only {sorted(map(str, PACKABLE))})")
            f = _Field(name, offset, tuple(int(d) for d in shape), dtype)
            fields.append(f)
            offset += f.size
        return cls(tuple(fields), offset)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def spec(self, sharding=None) -> jax.ShapeDtypeStruct:
        """The buffer as a compiled function's argument."""
        return jax.ShapeDtypeStruct((self.size,), jnp.int32, sharding=sharding)

    def pack(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """The host arrays (at least this layout's names; shapes and dtypes as laid out) in one
        int32 buffer."""
        parts = []
        for f in self.fields:
            a = np.asarray(arrays[f.name])
            if a.shape != f.shape or a.dtype != f.dtype:
                raise ValueError(f"{f.name}: got {a.dtype}{list(a.shape)}, laid out as {f.dtype}{list(f.shape)}")
            parts.append(a.reshape(-1).astype(_WORD) if f.dtype == np.bool_ else a.reshape(-1).view(_WORD))
        if not parts:
            return np.zeros(0, _WORD)
        return np.concatenate(parts)

    def unpack(self, buffer: jax.Array) -> dict[str, jax.Array]:
        """Inside a traced function: the arrays back from the buffer, bit for bit."""
        out = {}
        for f in self.fields:
            words = jax.lax.slice(buffer, (f.offset,), (f.offset + f.size,)).reshape(f.shape)
            if f.dtype == np.bool_:
                out[f.name] = words != 0
            elif f.dtype == _WORD:
                out[f.name] = words
            else:
                out[f.name] = jax.lax.bitcast_convert_type(words, jnp.dtype(f.dtype))
        return out


class PackedSampler:
    """A sampler compiled as f(logits, buffer, other arrays, prev_tokens), called as the sampler
    always was, f(logits, arrays dict, prev_tokens): the arrays `layout` names go in the buffer."""

    __slots__ = ("compiled", "layout", "_names")

    def __init__(self, compiled, layout: InputLayout):
        self.compiled = compiled
        self.layout = layout
        self._names = frozenset(layout.names)

    def __call__(self, logits, arrays: Mapping, prev_tokens):
        names = self._names
        rest = {k: v for k, v in arrays.items() if k not in names}
        return self.compiled(logits, self.layout.pack(arrays), rest, prev_tokens)

    def __getattr__(self, name):
        # as_text(), cost_analysis() and the like: the compiled executable's
        return getattr(self.compiled, name)
