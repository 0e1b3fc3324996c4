"""fp8 weights x fp8 activations lower for CUDA (an H200) to a dot of two f8E4M3FN operands.

Lowered on this CPU machine with jax.export for platforms=["cuda"] (the kernels' harness,
tests/pallas_kernels/pallas_cross_lower.py). What is checked is the StableHLO handed to XLA's GPU
compiler: the dot_general's operands are f8E4M3FN and accumulate to f32, and no convert widens
the e4m3 weight before it (the "upcast then a bf16 dot" mistake). XLA:GPU rewrites such a dot
into cuBLASLt's FP8 GEMM on sm89+; that last step needs a GPU and is not run here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.params import quantized_leaves
from jaxserve.models.linear import matmul
from jaxserve.quant.fp8 import quantize_fp8
from jaxserve.quant.int8 import quantize_int8

from tests.pallas_kernels.pallas_cross_lower import export_for_cuda


def _lower(t, dtype=jnp.bfloat16) -> str:
    leaves = quantized_leaves([t], dtype)
    x = jnp.zeros((16, t.shape[1]), dtype)
    return export_for_cuda(lambda x, p: matmul(x, p, dtype), x, leaves).mlir_module()


W = np.random.default_rng(0).normal(0, 0.05, (256, 128)).astype(np.float32)


def test_fp8_matmul_lowers_to_an_f8_by_f8_dot_for_cuda():
    text = _lower(quantize_fp8(W, 4.0))
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1, dots
    # operand types: (tensor<16x128xf8E4M3FN>, tensor<128x256xf8E4M3FN>) -> tensor<16x256xf32>
    operands = re.search(r":\s*\((.*)\)\s*->\s*(tensor<[^>]*>)", dots[0])
    assert operands, dots[0]
    assert operands.group(1).count("f8E4M3FN") == 2, dots[0]
    assert "f32" in operands.group(2), dots[0]
    assert not re.search(r"stablehlo\.convert.*f8E4M3FN>\)? -> tensor<[^>]*bf16>", text), \
        "an e4m3 tensor is widened to bf16 before the dot"


def test_the_check_sees_an_upcast_dot():
    # int8 weights widen to bf16 before their dot (weight-only quantization): the same check fails
    text = _lower(quantize_int8(W))
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and not any(line.count("f8E4M3FN") == 2 for line in dots)
    assert re.search(r"stablehlo\.convert.*i8>\)? -> tensor<[^>]*bf16>", text)
