"""The native int8 dot (cpu_kernels/int8_dot.cc) against XLA's: exact int32 sums at every shape
the kernel splits differently (row groups of 8, weight rows per thread task, K's 64-byte chunks
and their remainder), inside jit beside other ops; the fused w8a8 call (rounding, dot, rescale)
bit for bit against w8a8's matmul through XLA at those shapes, a row of zeros included, and
through a runner's step; it is built once per machine and a failed build leaves XLA's dot
serving."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels import int8_dot as int8_dot_module
from cpu_kernels.int8_dot import active, cpu_kernels, int8_dot, max_rows, w8a8_dot

pytestmark = pytest.mark.skipif(not build.registered(), reason="no C++ compiler: the kernels cannot be built")


def _xla(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(64, 1), (576, 65), (100, 130), (1, 7), (1536, 64)])
def test_equals_xlas_dot(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.integers(-127, 128, (m, k), dtype=np.int8))
    w = jnp.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8))
    np.testing.assert_array_equal(np.asarray(jax.jit(int8_dot)(x, w)), np.asarray(_xla(x, w)))


def test_extremes_sum_without_overflow_or_saturation():
    # |x| = |w| = 127 everywhere: the largest sums w8a8 produces, and the AVX2 path's int16 pairs at
    # their largest (2 * 127 * 127)
    k = 4096 + 37
    x = jnp.asarray(np.array([[127] * k, [-127] * k, [127, -127] * (k // 2) + [127]], np.int8))
    w = jnp.asarray(np.array([[127] * k, [-127] * k, [-127] * k], np.int8))
    got = np.asarray(int8_dot(x, w))
    np.testing.assert_array_equal(got, np.asarray(_xla(x, w)))
    assert got[0, 0] == 127 * 127 * k


def test_inside_a_jitted_program_with_fresh_inputs_each_call():
    f = jax.jit(lambda x, w: int8_dot(jnp.clip(x + 1, -127, 127).astype(jnp.int8), w).sum(axis=1))
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.integers(-127, 128, (300, 576), dtype=np.int8))
    for _ in range(3):
        x = jnp.asarray(rng.integers(-127, 127, (4, 576), dtype=np.int8))
        want = _xla((x + 1).astype(jnp.int8), w).sum(axis=1)
        np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(want))


def test_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="int8"):
        int8_dot(jnp.zeros((2, 8), jnp.float32), jnp.zeros((3, 8), jnp.int8))
    with pytest.raises(ValueError, match="int8"):
        int8_dot(jnp.zeros((2, 8), jnp.int8), jnp.zeros((3, 9), jnp.int8))


def _w8a8_leaves(rng, out=96, n=576):
    from jaxserve.models.params import quantized_leaves
    from jaxserve.quant.w8a8 import quantize_w8a8, smoothing

    w = rng.standard_normal((out, n)).astype(np.float32) * 0.1
    smooth = smoothing([w], np.abs(rng.standard_normal(n)).astype(np.float32) + 0.1)
    return quantized_leaves([quantize_w8a8(w, smooth)], jnp.float32)


def _w8a8_through_xla(x, leaves):
    from jaxserve.models.linear import matmul

    return np.asarray(jax.jit(lambda x: matmul(x, leaves, jnp.float32))(x))


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("k,n", [(576, 65), (100, 130), (1536, 64), (31, 5)])
def test_fused_w8a8_equals_the_matmul_through_xla(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    leaves = _w8a8_leaves(rng, out=n, n=k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m // 2] = 0.0                                    # a row of zeros: its scale is 1, not 0 / 127
    x = jnp.asarray(x)
    got = jax.jit(w8a8_dot)(x, leaves["act_smooth"], leaves["qweight"], leaves["scale"][0])
    np.testing.assert_array_equal(np.asarray(got), _w8a8_through_xla(x, leaves))


def test_fused_w8a8_refuses_what_it_does_not_compute():
    x, s, w, sc = jnp.zeros((2, 8)), jnp.ones(8), jnp.zeros((3, 8), jnp.int8), jnp.ones(3)
    with pytest.raises(ValueError, match="w8a8_dot"):
        w8a8_dot(x.astype(jnp.bfloat16), s, w, sc)
    with pytest.raises(ValueError, match="w8a8_dot"):
        w8a8_dot(x, jnp.ones(9), w, sc)
    with pytest.raises(ValueError, match="w8a8_dot"):
        w8a8_dot(x, s, w, jnp.ones(4))


@pytest.mark.parametrize("rows", [1, 2, max_rows(), max_rows() + 1])
def test_w8a8_matmul_gives_the_same_bits_with_the_kernel(rows):
    from jaxserve.models.linear import matmul

    rng = np.random.default_rng(rows)
    leaves = _w8a8_leaves(rng)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
    plain = jax.jit(lambda x: matmul(x, leaves, jnp.float32)).lower(x)
    with cpu_kernels():
        assert active()
        native = jax.jit(lambda x: matmul(x, leaves, jnp.float32)).lower(x)
    assert not active()
    assert ("jaxserve_w8a8_dot" in native.as_text()) == (rows <= max_rows())
    assert "jaxserve_w8a8_dot" not in plain.as_text()
    np.testing.assert_array_equal(np.asarray(native.compile()(x)), np.asarray(plain.compile()(x)))


@pytest.mark.parametrize("flags, rows", [("fpu sse2 avx2 avx512f avx512_vnni", int8_dot_module._MAX_ROWS_VNNI),
                                         ("fpu sse2 avx2 fma", int8_dot_module._MAX_ROWS_AVX2),
                                         ("fpu sse2", int8_dot_module._MAX_ROWS_VNNI)])
def test_the_row_limit_follows_the_cpus_instructions(monkeypatch, flags, rows):
    """XLA's own int8 dot is fast with AVX-512 VNNI and slow on AVX2 alone, so the kernel serves
    more rows there; a benchmark may trace past the limit."""
    from jaxserve.runner import fingerprint

    monkeypatch.setattr(fingerprint, "cpu_flags", lambda: flags)
    int8_dot_module._crossover_rows.cache_clear()
    try:
        assert max_rows() == rows
        with cpu_kernels(max_rows=rows + 5):
            assert max_rows() == rows + 5
        assert max_rows() == rows
    finally:
        int8_dot_module._crossover_rows.cache_clear()
    assert int8_dot_module._MAX_ROWS_AVX2 > int8_dot_module._MAX_ROWS_VNNI


def test_a_failed_build_leaves_xlas_dot_serving(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(RuntimeError, match="failed"):
        build.build_library()
    assert list(tmp_path.iterdir()) == []                 # no half-written library left behind
    build.registered.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cpu_kernels.build"):
            assert not build.registered()
            with cpu_kernels():
                assert not active()                       # the traced code keeps XLA's dot
        assert "unavailable" in caplog.text
    finally:
        monkeypatch.undo()
        build.registered.cache_clear()
        assert build.registered()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    build.registered.cache_clear()
    try:
        assert not build.registered()
    finally:
        monkeypatch.undo()
        build.registered.cache_clear()
        assert build.registered()


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("flags,name", [(("-mno-avx512f",), "avx2"), (("-mno-avx512f", "-mno-avx2"), "plain")])
def test_the_narrower_instruction_paths_equal_xlas_dot(flags, name):
    """The library is compiled for the machine that runs it, so a machine with AVX-512 VNNI never
    runs the AVX2 or plain C++ paths: build them here with those instruction sets switched off."""
    from tests.cpu_kernels.narrow_build import narrow_target

    target = narrow_target("JaxserveInt8Dot", flags, name)
    rng = np.random.default_rng(7)
    for m, k, n in [(1, 576, 65), (9, 100, 130), (3, 31, 5)]:
        x = jnp.asarray(rng.integers(-127, 128, (m, k), dtype=np.int8))
        w = jnp.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8))
        got = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.int32))(x, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_xla(x, w)))
    fused = narrow_target("JaxserveW8A8Dot", flags, name)
    leaves = _w8a8_leaves(rng, out=130, n=100)
    xf = jnp.asarray(rng.standard_normal((5, 100)).astype(np.float32))
    got = jax.ffi.ffi_call(fused, jax.ShapeDtypeStruct((5, 130), jnp.float32))(
        xf, leaves["act_smooth"], leaves["qweight"], leaves["scale"][0])
    np.testing.assert_array_equal(np.asarray(got), _w8a8_through_xla(xf, leaves))
    k = 4096 + 37                                              # the int16 pairs at their largest
    x = jnp.asarray(np.array([[127] * k, [-127] * k], np.int8))
    got = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((2, 2), jnp.int32))(x, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_xla(x, x)))
