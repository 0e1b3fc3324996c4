"""Linear: the one place a projection's matmul is written, for every form its weight takes.

A `Linear` module reads its own params and picks the matmul from what they hold (at trace time,
so a step is compiled for exactly one form):
    float  kernel [in, out] (+ bias [out])                 x @ kernel, nn.Dense's arithmetic
    int8   qweight int8 [in, out], scale f32 [G, out]
    int4   qweight uint8 [in // 2, out], scale f32 [G, out], offset f32 [G, out] (Q4_1 form only)
    fp8    qweight float8_e4m3fn [in, out], scale f32 [1, out], act_scale f32 []
    w8a8   qweight int8 [out, in], scale f32 [1, out], act_smooth f32 [in]
(the values: models/quantized_tensor.py). With LoRA slots (`lora_a`, `lora_b` beside the weight)
each row's adapter delta is added to the result (models/lora_delta.py). A fused projection (`parts`: q | k | v, gate | up)
returns its parts; under tensor parallelism (`shards` > 1) its columns are stored shard-major
(each shard's slice of every part together: parallel/layout.py), and the split is taken per
shard. Its input's per-channel maximum is recorded (flax `sow`, collection "intermediates")
when the caller asks for that collection: the calibration pass (quant/calibration.py) reads
every projection's input this way, under the projection's path.

How the scale meets the dot:
- per-channel (G == 1: int8, fp8): the integer / e4m3 weight goes into the dot as it is (cast to
  the compute dtype: an elementwise producer XLA fuses into the dot's operand read) and the
  scale multiplies the [T, out] result: one multiply per output, not per weight.
- group-wise (int4, GGUF blocks): the groups are dequantized to the compute dtype in front of the
  dot (unpack, subtract, scale: elementwise ops XLA fuses into the operand of the dot on GPU; on
  the CPU it materializes the [in, out] weight per step). With the CPU kernels on, a step of a
  few rows (at most cpu_kernels/int4_dot.py's MAX_ROWS) instead runs the native int4 kernel on
  the packed bytes, its activations rounded to int8 per group (llama.cpp's Q4 x Q8 dot), and a
  bigger step rounds its activations the same way before XLA's dot.
- fp8: x / act_scale cast to e4m3, an e4m3 x e4m3 dot accumulated in float32 (an FP8 GEMM on
  Hopper), times act_scale * scale.
- w8a8: x * act_smooth rounded to int8 with one scale per row (token), an int8 x int8 dot
  accumulated in int32 (exact), times the row's scale and the weight's (quant/w8a8.py).
Dot accumulation is float32 (w8a8: int32) in every quantized case; the result is cast to the
compute dtype.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import int4_dot, int8_dot
from jaxserve.models import batch_invariant
from jaxserve.models.lora_delta import current_rows, has_lora, lora_delta

E4M3_MAX = 448.0


def quant_kind(qweight: jax.Array) -> str:
    dt = jnp.dtype(qweight.dtype)
    if dt == jnp.int8:
        return "int8"
    if dt == jnp.uint8:
        return "int4"
    if dt == jnp.dtype(jnp.float8_e4m3fn):
        return "fp8"
    raise ValueError(f"qweight dtype {dt} is not a quantized form")


def dequantize_weight(p: dict, dtype: Any) -> jax.Array:
    """The [in, out] weight in `dtype` that params `p` stand for (int4 / grouped int8)."""
    q = p["qweight"]
    scale = p["scale"]                                                       # [G, out]
    groups, out = scale.shape
    if quant_kind(q) == "int4":
        half = q.shape[0] // groups                                          # group // 2
        packed = q.reshape(groups, 1, half, out)
        vals = jnp.concatenate([packed & 15, packed >> 4], axis=1)          # [G, 2, g/2, out]
        vals = vals.reshape(groups, 2 * half, out).astype(jnp.float32)
        if "offset" not in p:
            vals = vals - 8.0
    else:
        vals = q.reshape(groups, -1, out).astype(jnp.float32)               # [G, g, out]
    w = vals * scale[:, None, :]
    if "offset" in p:
        w = w + p["offset"][:, None, :]
    return w.reshape(-1, out).astype(dtype)


def matmul(x: jax.Array, p: dict, dtype: Any, precision=None) -> jax.Array:
    """x [T, in] -> [T, out] in `dtype` (bias not included), whatever form `p` holds."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if "kernel" in p:
        # a float projection (and one left float in a partly quantized model, e.g. a GGUF whose
        # other block types were kept as float): nn.Dense's arithmetic, bit for bit
        kernel = p["kernel"].astype(dtype)
        if batch_invariant.active():      # every row through the same [ROW_TILE, in] dot
            return batch_invariant.row_tiled(lambda t: jax.lax.dot_general(t, kernel, dims, precision=precision),
                                             x.astype(dtype))
        return jax.lax.dot_general(x.astype(dtype), kernel, dims, precision=precision)
    if batch_invariant.active():
        raise ValueError("the batch-invariant mode computes float weights only (a quantized projection's "
                         "dot is not row-tiled)")
    if "act_smooth" in p:      # w8a8: nothing is widened
        return _w8a8_matmul(x, p["qweight"], p["scale"][0], p["act_smooth"]).astype(dtype)
    q, scale = p["qweight"], p["scale"]
    if quant_kind(q) == "int4" and _int4_native(x, scale):
        if int(np.prod(x.shape[:-1])) <= int4_dot.MAX_ROWS:
            # a decode step's few rows on the CPU: the packed nibbles straight into the native kernel
            # (cpu_kernels/int4_dot.py), the activations rounded to int8 per group as llama.cpp's
            # are; nothing is widened, so the ordering below is not needed
            lead = x.shape[:-1]
            y = int4_dot.int4_dot(x.reshape(-1, x.shape[-1]), q, scale, p.get("offset"))
            return y.reshape(*lead, q.shape[1]).astype(dtype)
        # a bigger step keeps XLA's dot but rounds its activations as the kernel does, so a row's
        # result does not depend on how many rows its step carried (beyond float summation order)
        x = int4_dot.round_activations(x, x.shape[-1] // scale.shape[0])
    # XLA:CPU runs independent thunks concurrently, and nothing ties a weight's widening to the
    # layer it serves: it widened every layer's weights at the start of the step, writing and
    # reading back hundreds of MB (int8 decoded 5.8x slower than float32). Tied to the layer's
    # input, each weight is widened just before its dot, while the result is still in cache
    # (docs/benchmarks.md). Elsewhere it only orders what the dot already orders.
    x, p = jax.lax.optimization_barrier((x, p))
    q, scale = p["qweight"], p["scale"]
    kind = quant_kind(q)
    if kind == "fp8":
        act = p["act_scale"].astype(jnp.float32)
        xq = jnp.clip(x.astype(jnp.float32) / act, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
        y = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.float32)
        return (y * (act * scale[0])).astype(dtype)
    if scale.shape[0] == 1 and kind == "int8":
        y = jax.lax.dot_general(x.astype(dtype), q.astype(dtype), dims, precision=precision,
                                preferred_element_type=jnp.float32)
        return (y * scale[0]).astype(dtype)
    w = dequantize_weight(p, dtype)
    return jax.lax.dot_general(x.astype(dtype), w, dims, precision=precision,
                               preferred_element_type=jnp.float32).astype(dtype)


def _int4_native(x: jax.Array, scale: jax.Array) -> bool:
    """Whether this int4 matmul computes the native kernel's arithmetic (traced with the CPU
    kernels on, a weight the kernel computes)."""
    return int8_dot.active() and int4_dot.supports(x.shape[-1], scale.shape[0])


# XLA:CPU's int8 dot takes a slow path for a single row (148 ms against 11 ms for two rows over the
# embedded model's projections, docs/benchmarks.md): one row is computed as two (unless the native
# kernel serves the step: cpu_kernels/int8_dot.py).
_W8A8_MIN_ROWS = 2
_INV_127 = np.float32(1.0 / 127.0)


def _w8a8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, act_smooth: jax.Array) -> jax.Array:
    """x [..., in] float, q int8 [out, in], scale / act_smooth float32 -> [..., out] float32."""
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n).astype(jnp.float32)
    rows = x2.shape[0]
    if int8_dot.active() and rows <= int8_dot.max_rows():
        # a decode step's few rows on the CPU: the native kernel (cpu_kernels/) computes all of the
        # below in one call, bit for bit
        return int8_dot.w8a8_dot(x2, act_smooth, q, scale).reshape(*lead, q.shape[0])
    xs = x2 * act_smooth
    if rows < _W8A8_MIN_ROWS:
        xs = jnp.pad(xs, ((0, _W8A8_MIN_ROWS - rows), (0, 0)))
    # written as the multiplications XLA rewrites these divisions into anyway (by a constant's and
    # a broadcast's reciprocal), so the native kernel can repeat them exactly
    absmax = jnp.max(jnp.abs(xs), axis=1, keepdims=True)
    row_scale = jnp.where(absmax > 0, absmax * _INV_127, 1.0)                # [R, 1]: per token
    xq = jnp.round(xs * (1.0 / row_scale)).astype(jnp.int8)                  # |xs / row_scale| <= 127
    acc = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * row_scale * scale                          # [R, out]
    return y[:rows].reshape(*lead, q.shape[0])


def is_quantized(params: dict) -> bool:
    """Whether a params pytree holds any quantized projection."""
    return any(getattr(path[-1], "key", None) == "qweight"
               for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def matmul_precision(dtype: Any) -> jax.lax.Precision | None:
    """float32 models get true float32 matmuls everywhere.

    JAX's default precision lets GPUs run float32 dots as TF32 (10-bit mantissa), which breaks
    parity with the PyTorch fp32 path; bf16 is the fast path, fp32 the accurate one. XLA:CPU
    computes float32 dots exactly either way.
    """
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def split_columns(y: jax.Array, parts: tuple[int, ...], shards: int = 1) -> tuple[jax.Array, ...]:
    """A fused projection's output [..., sum(parts)] -> one array per part [..., part]. With
    shards > 1 the columns are shard-major (shard s holds its parts[i] / shards columns of every
    part, side by side), so each part is gathered from every shard's group in shard order."""
    lead = y.shape[:-1]
    if shards == 1:
        bounds = np.cumsum((0,) + tuple(parts))
        return tuple(y[..., bounds[i]:bounds[i + 1]] for i in range(len(parts)))
    per = [p // shards for p in parts]
    grouped = y.reshape(*lead, shards, sum(per))                                 # [..., S, sum / S]
    bounds = np.cumsum([0] + per)
    return tuple(grouped[..., bounds[i]:bounds[i + 1]].reshape(*lead, parts[i]) for i in range(len(parts)))


class Linear(nn.Module):
    """x [..., in] -> [..., out] in `dtype`, or the tuple of its `parts` (see the module doc).
    The params are whatever form the checkpoint gave (the loaders build them); `init` creates the
    float form, which is how a test checks the declared layout against the module."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    parts: tuple[int, ...] = ()       # a fused projection's outputs, in order (sum = features)
    shards: int = 1                   # tensor-parallel shards of a fused projection's columns

    @nn.compact
    def __call__(self, x: jax.Array):
        if self.is_initializing():
            self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.dtype)
            if self.use_bias:
                self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        p = dict(self.variables["params"])
        if self.is_mutable_collection("intermediates"):
            self.sow("intermediates", "input_absmax", jnp.max(jnp.abs(x.reshape(-1, x.shape[-1])), axis=0))
        y = matmul(x, p, self.dtype, matmul_precision(self.dtype))   # [..., out]
        if has_lora(p) and current_rows() is not None:
            # LoRA slots (models/lora_delta.py): each row's adapter delta, in float, on top of
            # whatever form the base weight has; fused parts get theirs through their own columns
            y = y + lora_delta(x, p, current_rows(), self.dtype, matmul_precision(self.dtype))
        if self.use_bias:
            y = y + p["bias"].astype(self.dtype)
        if self.parts:
            return split_columns(y, self.parts, self.shards)
        return y


def recorded_inputs(intermediates: dict) -> dict[str, jax.Array]:
    """Module path ("layers_0/self_attn/qkv_proj") -> its input's max |x| per channel, from a
    model applied with the "intermediates" collection mutable."""
    out = {}
    for path, value in jax.tree_util.tree_flatten_with_path(intermediates, is_leaf=lambda x: isinstance(x, tuple))[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys and keys[-1] == "input_absmax":
            out["/".join(keys[:-1])] = value[0]
    return out


def lm_head_logits(params: dict, hidden: jax.Array, *, tied: bool) -> jax.Array:
    """hidden [S, D] -> logits [S, V] float32 (accumulated in float32 even for bf16 params): the
    LM head, float unless quantize_lm_head quantized it (`lm_head/qweight`: w8a8's [V, D] or
    int4's [D / 2, V], through their matmul, tied or not), which is the embedding [V, D] when
    `tied` (stored once, so both operands' D is contracted) and `lm_head/kernel` [D, V] otherwise."""
    quantized = params.get("lm_head", {})
    if "qweight" in quantized and batch_invariant.active():
        raise ValueError("the batch-invariant mode computes a float LM head only")
    if "act_smooth" in quantized:
        return _w8a8_matmul(hidden, quantized["qweight"], quantized["scale"][0], quantized["act_smooth"])
    if "qweight" in quantized:        # int4: the native kernel for a few rows on a CPU (matmul)
        return matmul(hidden, quantized, jnp.float32)
    precision = matmul_precision(hidden.dtype)
    if tied:
        embedding = params["embed_tokens"]["embedding"]                         # [V, D]
        head = lambda h: jax.lax.dot_general(h, embedding, (((1,), (1,)), ((), ())),
                                             precision=precision, preferred_element_type=jnp.float32)
    else:
        head = lambda h: jnp.matmul(h, params["lm_head"]["kernel"], precision=precision,
                                    preferred_element_type=jnp.float32)
    if batch_invariant.active():          # a sampled row's logits whatever the step samples beside it
        return batch_invariant.row_tiled(head, hidden)
    return head(hidden)
