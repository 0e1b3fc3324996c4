"""The mixture-of-experts layer: routing, and the experts as a grouped matmul over tokens sorted by
expert, capacity-free (no token is ever dropped, so outputs equal HF's dense-loop ones).

The interface (everything a model file or an expert-parallel wrapper needs):

    route(router_logits [T, E], *, top_k, norm_topk_prob) -> Routing(expert_ids [T, K] int32,
                                                                     weights [T, K] float32)
        softmax over the E experts in float32, the top k (ties: the lower id), and with
        `norm_topk_prob` the k weights divided by their sum (Mixtral always, Qwen3-MoE per config).

    moe_mlp(x [T, D], routing, experts, *, activation, expert_offset=0, impl=None) -> [T, D]
        sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), each expert act(x @ gate) * (x @ up) @ down.
        `experts` is an `ExpertWeights` of stacked leaves for E_local experts (float: gate_up
        [E_local, D, 2F] columns gate | up, down [E_local, F, D]; quantized: the leaves of
        models/linear.py's forms with a leading expert axis, below). The experts held are the ids
        [expert_offset, expert_offset + E_local): a routed (token, slot) whose expert lies outside
        contributes zero, so an expert-parallel wrapper runs this per shard on its own slice of
        the experts (expert_offset = shard * E_local) and sums the shards' outputs (psum /
        reduce-scatter), or dispatches only the tokens a shard needs; E_local = E on one device.

    expert_counts(routing, num_experts, valid=None) -> [E] int32
        tokens routed to each expert (a bincount of the ids; rows with valid False left out): the
        routing statistics the step returns.

    grouped_matmul(x [N, D], w, group_sizes [G], *, impl=None) -> [N, F]
        lax.ragged_dot's semantics: rows [start_g, start_g + group_sizes[g]) times expert g's
        [D, F] weight (any form `w` holds), rows past sum(group_sizes) zero.

    moe_mlp_dense_reference(x, routing, experts, *, activation) -> [T, D]
        the dense-all-experts form (every expert over every token, weighted by the routing,
        zero weight for experts not chosen): the reference tests and the benchmark compare with.
        Never used by a model.

How the grouped matmul runs (`impl`, chosen by platform when None):
- "ragged_dot": `jax.lax.ragged_dot` (group sizes from the bincount). GPU and TPU lower it to a
  grouped kernel. XLA:CPU does not: jax lowers it there to the dense form (each row multiplied
  against every group's weight, masked), as costly as the dense-all-experts form (measured:
  2.2 ms against 2.9 ms dense for 8 rows over 16 experts of 256 x 512).
- "tiled" (the CPU default): the sorted rows cut into tiles of `tile` rows that never straddle
  two experts (each expert's rows padded up to a whole tile), every tile multiplied by its own
  expert's weight gathered for it, one batched dot. The tile count is static, at most
  N // tile + min(E, N), so a step compiles once; the work is the routed rows' (plus padding up
  to a tile per expert), and the weights read are those of the experts some token chose: at
  decode (a few rows) a tile is one row and only the chosen experts' weights are read.

Quantized experts (stacked per expert, as models/linear.py's forms with the expert axis first):
int8 per output channel (qweight int8 [E, in, out], scale [E, 1, out]): the int8 weight enters
the dot widened, the scale multiplies each row's result by its own expert's scale; int4 and
group-wise int8 (scale / offset [E, G, out]): the gathered tile weights (tiled) or the whole
stack (ragged_dot) dequantized in front of the dot. w8a8 and fp8 experts are refused at
quantization (quant/checkpoint.py): their activation scales are calibrated per projection input,
and an expert's input is only the tokens routed to it, which the calibration pass does not
separate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.linear import dequantize_weight, matmul_precision, quant_kind

Weights = dict      # one stacked projection's leaves: {"kernel"} or {"qweight", "scale"[, "offset"]}

TILED, RAGGED_DOT = "tiled", "ragged_dot"
_MAX_TILE = 64      # rows per tile of the tiled form at prefill sizes


@dataclass(frozen=True)
class Routing:
    expert_ids: jax.Array      # [T, K] int32, each token's experts, best first
    weights: jax.Array         # [T, K] float32, their combine weights


@dataclass(frozen=True)
class ExpertWeights:
    gate_up: Weights           # [E, D, 2F]: columns gate | up
    down: Weights              # [E, F, D]

    @property
    def num_experts(self) -> int:
        return _leading(self.down)


jax.tree_util.register_dataclass(Routing, data_fields=["expert_ids", "weights"], meta_fields=[])
jax.tree_util.register_dataclass(ExpertWeights, data_fields=["gate_up", "down"], meta_fields=[])


def route(router_logits: jax.Array, *, top_k: int, norm_topk_prob: bool) -> Routing:
    """router_logits [T, E] (any float dtype) -> each token's top-k experts and weights."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)         # [T, E]
    weights, ids = jax.lax.top_k(probs, top_k)                                   # [T, K] each
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(expert_ids=ids.astype(jnp.int32), weights=weights)


def expert_counts(routing: Routing, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
    """[E] int32: how many of the (valid) tokens chose each expert (each token counts once per
    expert it chose)."""
    ids = routing.expert_ids
    hits = jnp.ones(ids.shape, jnp.int32) if valid is None else jnp.broadcast_to(valid[:, None], ids.shape).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(hits.reshape(-1), mode="drop")


def default_impl() -> str:
    return RAGGED_DOT if jax.default_backend() in ("gpu", "tpu") else TILED


def moe_mlp(x: jax.Array, routing: Routing, experts: ExpertWeights, *, activation: Callable,
            expert_offset: int | jax.Array = 0, impl: str | None = None) -> jax.Array:
    """x [T, D] -> [T, D]: the routed experts' outputs, weighted (see the module doc)."""
    t, k = routing.expert_ids.shape
    local = experts.num_experts
    ids = routing.expert_ids.reshape(-1) - expert_offset                         # [T*K]
    held = (ids >= 0) & (ids < local)
    sort_key = jnp.where(held, ids, local)            # experts held elsewhere sort last, in no group
    order = jnp.argsort(sort_key, stable=True)                                   # [T*K]
    group_sizes = jnp.zeros((local,), jnp.int32).at[sort_key].add(1, mode="drop")
    rows = x[order // k]                                                         # [T*K, D], by expert
    y = expert_mlp(rows, group_sizes, experts, activation=activation, impl=impl)  # [T*K, D]
    unsorted = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)             # [T, K, D]
    weights = jnp.where(held.reshape(t, k), routing.weights, 0.0)
    out = jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def expert_mlp(rows: jax.Array, group_sizes: jax.Array, experts: ExpertWeights, *, activation: Callable,
               impl: str | None = None) -> jax.Array:
    """rows [N, D] sorted by expert, group_sizes [E] -> each row through its expert's MLP [N, D]."""
    gate_up = grouped_matmul(rows, experts.gate_up, group_sizes, impl=impl)      # [N, 2F]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return grouped_matmul(activation(gate) * up, experts.down, group_sizes, impl=impl)


def grouped_matmul(x: jax.Array, w: Weights, group_sizes: jax.Array, *, impl: str | None = None) -> jax.Array:
    """x [N, D], w stacked [G, D, F] (any form), group_sizes [G] -> [N, F] in x's dtype."""
    impl = impl or default_impl()
    if impl == RAGGED_DOT:
        return _ragged_dot(x, w, group_sizes)
    if impl == TILED:
        return _tiled(x, w, group_sizes)
    raise ValueError(f"impl={impl!r} is not {TILED!r} or {RAGGED_DOT!r}")


def _leading(w: Weights) -> int:
    return (w["kernel"] if "kernel" in w else w["qweight"]).shape[0]


def _per_channel_int8(w: Weights) -> bool:
    return "qweight" in w and quant_kind(w["qweight"]) == "int8" and w["scale"].shape[1] == 1 and "offset" not in w


def _check_form(w: Weights) -> None:
    if "act_smooth" in w or ("qweight" in w and quant_kind(w["qweight"]) == "fp8"):
        raise ValueError("w8a8 and fp8 experts are not supported (their activation scales would need a "
                         "per-expert calibration); quantize a MoE model with int8 or int4")


def _ragged_dot(x: jax.Array, w: Weights, group_sizes: jax.Array) -> jax.Array:
    _check_form(w)
    dtype = x.dtype
    precision = matmul_precision(dtype)
    if "kernel" in w:
        return jax.lax.ragged_dot(x, w["kernel"].astype(dtype), group_sizes, precision=precision)
    if _per_channel_int8(w):
        y = jax.lax.ragged_dot(x, w["qweight"].astype(dtype), group_sizes, precision=precision,
                               preferred_element_type=jnp.float32)
        row_expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=x.shape[0])
        return (y * w["scale"][row_expert, 0]).astype(dtype)
    dense = jax.vmap(lambda p: dequantize_weight(p, dtype))(w)                    # [G, D, F]
    return jax.lax.ragged_dot(x, dense, group_sizes, precision=precision)


def tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile for N sorted rows over G groups: about the mean group size, a power of two
    (1 at decode sizes, where every tile's weight is read for a row or two anyway)."""
    mean = max(1, num_rows // max(1, num_groups))
    return int(min(_MAX_TILE, 1 << int(np.log2(mean))))


def _tile_plan(group_sizes: jax.Array, num_rows: int, tile: int):
    """Each tile's group [n], its rows [n, tile] and which of them are real (a group's last tile
    is padded, tiles past the last group's are empty)."""
    groups = group_sizes.shape[0]
    num_tiles = min(num_rows, num_rows // tile + min(groups, num_rows))   # sum_g ceil(n_g / tile) <= this
    tiles = (group_sizes + tile - 1) // tile                                     # [G]
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_end = jnp.cumsum(group_sizes)
    row_start = row_end - group_sizes
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), groups - 1).astype(jnp.int32)
    first = row_start[group] + (j - tile_start[group]) * tile                    # [n]
    rows = first[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]           # [n, tile]
    real = (j < tile_end[-1])[:, None] & (rows < row_end[group][:, None])
    return group, rows, real


def _tiled(x: jax.Array, w: Weights, group_sizes: jax.Array) -> jax.Array:
    _check_form(w)
    n, dtype = x.shape[0], x.dtype
    precision = matmul_precision(dtype)
    group, rows, real = _tile_plan(group_sizes, n, tile_rows(n, group_sizes.shape[0]))
    x_tiles = jnp.where(real[..., None], x[jnp.where(real, rows, 0)], 0).astype(dtype)   # [n, tile, D]
    dims = (((2,), (1,)), ((0,), (0,)))
    if "kernel" in w:
        y = jax.lax.dot_general(x_tiles, w["kernel"][group].astype(dtype), dims, precision=precision)
    elif _per_channel_int8(w):
        y = jax.lax.dot_general(x_tiles, w["qweight"][group].astype(dtype), dims, precision=precision,
                                preferred_element_type=jnp.float32)
        y = (y * w["scale"][group]).astype(dtype)                                # [n, tile, F] * [n, 1, F]
    else:
        tile_w = jax.vmap(lambda p: dequantize_weight(p, dtype))(jax.tree.map(lambda a: a[group], w))
        y = jax.lax.dot_general(x_tiles, tile_w, dims, precision=precision)
    out = jnp.zeros((n, y.shape[-1]), dtype)
    return out.at[jnp.where(real, rows, n).reshape(-1)].set(y.reshape(-1, y.shape[-1]), mode="drop")


def dense_expert_weights(w: Weights, dtype: Any) -> jax.Array:
    """A stacked projection's float [E, in, out] weight, whatever form it holds."""
    if "kernel" in w:
        return w["kernel"].astype(dtype)
    _check_form(w)
    return jax.vmap(lambda p: dequantize_weight(p, dtype))(w)


def moe_mlp_dense_reference(x: jax.Array, routing: Routing, experts: ExpertWeights, *,
                            activation: Callable) -> jax.Array:
    """The dense-all-experts form: every expert over every token [E, T, D], combined with each
    token's routing weights (zero for the experts it did not choose). A reference, for tests and
    the benchmark; its cost grows with E, not with top_k."""
    dtype = x.dtype
    precision = matmul_precision(dtype)
    gate_up = dense_expert_weights(experts.gate_up, dtype)                       # [E, D, 2F]
    down = dense_expert_weights(experts.down, dtype)                             # [E, F, D]
    gate, up = jnp.split(jnp.einsum("td,edf->etf", x, gate_up, precision=precision), 2, axis=-1)
    y = jnp.einsum("etf,efd->etd", activation(gate) * up, down, precision=precision)   # [E, T, D]
    e = down.shape[0]
    combine = jnp.zeros((x.shape[0], e), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], routing.expert_ids].add(routing.weights)  # [T, E]
    out = jnp.einsum("etd,te->td", y.astype(jnp.float32), combine, precision=jax.lax.Precision.HIGHEST)
    return out.astype(dtype)
