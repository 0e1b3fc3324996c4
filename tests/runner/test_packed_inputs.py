"""One buffer for a compiled call's small arrays (runner/packed_inputs.py): every packable dtype
comes back bit for bit inside a compiled function (floats' NaN and infinities, uint32 above
int32's range, bools), wrong shapes or dtypes are refused with the names, and a packed sampler is
called with the whole dict. Every engine test runs its steps and samplers through these buffers
(the greedy parity tests among them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.packed_inputs import InputLayout, PackedSampler


def _arrays(rng) -> dict[str, np.ndarray]:
    f = rng.standard_normal((3, 5)).astype(np.float32)
    f[0, :3] = [np.nan, np.inf, -np.inf]
    return {
        "ints": rng.integers(-2**31, 2**31 - 1, (7,), dtype=np.int64).astype(np.int32),
        "seeds": rng.integers(0, 2**32 - 1, (4,), dtype=np.uint64).astype(np.uint32),
        "floats": f,
        "flags": rng.random((2, 3)) < 0.5,
        "empty": np.zeros((0, 4), np.int32),
        "one": np.array([42], np.int32),
    }


def test_every_packable_dtype_comes_back_bit_for_bit_in_a_compiled_function():
    rng = np.random.default_rng(0)
    arrays = _arrays(rng)
    layout = InputLayout.of({k: (v.shape, v.dtype) for k, v in arrays.items()})
    assert layout.size == 7 + 4 + 15 + 6 + 0 + 1
    unpack = jax.jit(layout.unpack).lower(layout.spec()).compile()
    for _ in range(3):
        arrays = _arrays(rng)
        buf = layout.pack(arrays)
        assert buf.dtype == np.int32 and buf.shape == (layout.size,)
        got = {k: np.asarray(v) for k, v in unpack(buf).items()}
        assert set(got) == set(arrays)
        for k, want in arrays.items():
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            # bits, not values: NaN == NaN here
            assert got[k].tobytes() == want.tobytes(), k


def test_pack_refuses_a_wrong_shape_or_dtype_and_unknown_dtypes():
    layout = InputLayout.of({"a": ((3,), np.int32), "b": ((2,), np.float32)})
    with pytest.raises(ValueError, match=r"a: got int32\[4\], laid out as int32\[3\]"):
        layout.pack({"a": np.zeros(4, np.int32), "b": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=r"b: got float64"):
        layout.pack({"a": np.zeros(3, np.int32), "b": np.zeros(2)})
    with pytest.raises(ValueError, match="int64 cannot be packed"):
        InputLayout.of({"c": ((2,), np.int64)})


def test_a_packed_sampler_is_called_with_the_whole_dict():
    layout = InputLayout.of({"t": ((2,), np.float32), "k": ((2,), np.int32)})

    def f(logits, buffer, rest, prev):
        a = {**layout.unpack(buffer), **rest}
        return logits * a["t"][:, None] + a["k"][:, None] + a["bias"] + prev[0]

    rest_spec = {"bias": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((2, 3), jnp.float32), layout.spec(), rest_spec,
                                jax.ShapeDtypeStruct((1,), jnp.int32)).compile()
    sampler = PackedSampler(compiled, layout)
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    arrays = {"t": np.array([2.0, 3.0], np.float32), "k": np.array([1, -1], np.int32),
              "bias": np.full((2, 3), 0.5, np.float32)}
    out = np.asarray(sampler(logits, arrays, np.array([10], np.int32)))
    np.testing.assert_array_equal(out, logits * arrays["t"][:, None] + arrays["k"][:, None] + 0.5 + 10)

