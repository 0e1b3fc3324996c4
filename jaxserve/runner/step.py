"""The step function: one forward pass over a packed batch, compiled per bucket.

Each layer's attention writes the new K/V into the donated arena by slot mapping (runner/kv_write.py,
quantizing them when the arena is fp8/int8), then runs ragged paged attention with that layer's
scale, sliding window and soft cap (`ModelConfig.layer_attention`) twice: over the decode rows (one query per slot) and over the prefill
tiles (`tile` queries per slot). Input ids marked as placeholders (`token_src` >= 0) are taken
from `prev_tokens`, the previous step's sampled ids still on the device. It returns the logits of
the rows that sample; sampling is its own compiled function (runner/sampler.py), so the
vocabulary sort is compiled once per row count rather than once per bucket. An engine with prompt
logprobs enabled compiles steps that also return every row's final hidden state
(runner/prompt_logprobs.py reads them).

With a mesh (tensor parallelism, jaxserve/parallel/) the KV write and the attention of each
layer run per shard inside `shard_map` (parallel/attention.py) and the rest is partitioned by
the params' shardings; without one (a single device) the step is the plain program.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.models import registry
from jaxserve.models.config import LayerAttention, ModelConfig
from jaxserve.models.lora_delta import lora_rows
from jaxserve.models.invariant_attention import grouped_attention, groups_to_tiles, tiles_to_groups
from jaxserve.parallel.attention import per_shard
from jaxserve.parallel.experts import ExpertParallel, dispatch_for
from jaxserve.parallel.mesh import EXPERT_AXIS, MODEL_AXIS
from jaxserve.runner.kv_write import kv_scales, scaled_attention, write_kv


# Work granularity of the XLA attention (ignored by the GPU kernels): context chunks of
# *_CHUNK_BLOCKS blocks, *_ITEMS (sequence, chunk) pairs per loop iteration. Measured on the
# 2-core CPU for the embedded model's shapes (22 live decodes of 50..760 tokens in 32 slots):
# decodes are fastest at 8 blocks x 16 items (4.3 ms per layer against 4.8 at 4 x 32 and 5.1 at
# 16 x 8); prefill tiles of 32 rows at 16 blocks x 4 items (4.2 ms against 7.6 at 2 and 5.7 at 8
# items). Fewer iterations save per-iteration overhead; bigger ones spill the caches.
DECODE_KV_CHUNK_BLOCKS, DECODE_ITEMS = 8, 16
PREFILL_KV_CHUNK_BLOCKS, PREFILL_ITEMS = 16, 4
# A step of few decode rows has few items: 16 per iteration would gather and mask 13 padding
# chunks beside a lone 300-token decode's 3. Capped at 4 items per row (512 positions), the
# embedded w8a8 model's batch-1 step took 25.6 and 21.3 ms against 27.2 and 28.0 at 16 (two
# builds each, docs/benchmarks.md "Beside llama.cpp"); from 4 rows on nothing changes.
DECODE_ITEMS_PER_ROW = 4


def decode_items(decode_rows: int) -> int:
    """(sequence, chunk) items per attention loop iteration in a step of `decode_rows` decodes."""
    return min(DECODE_ITEMS, DECODE_ITEMS_PER_ROW * max(decode_rows, 1))


# the step's arrays a layer's KV write and attention read (replicated over a mesh)
ATTENTION_ARRAYS = ("slot_mapping", "dec_kv_lens", "dec_tables", "dec_num", "pre_kv_lens", "pre_tables", "pre_num")


def make_step(config: ModelConfig, attention_impl: Callable, *, decode_rows: int, prefill_tiles: int,
              tile: int, mesh: Mesh | None = None, model=None, return_hidden: bool = False,
              expert_dispatch: str = "auto", block_size: int | None = None,
              batch_invariant: bool = False) -> Callable:
    """attention_impl has the signature of pallas_kernels' ragged paged attention, plus
    `uniform_q_len` (the number of query rows of every slot). `mesh`: run tensor-parallel over
    its model axis (params and arena sharded as jaxserve/parallel/sharding.py says). `model`: what
    has `forward` and `compute_logits` (default: the config's architecture in the registry).
    `return_hidden`: also return every row's final hidden state [T, D] (prompt logprobs read
    them: runner/prompt_logprobs.py). `expert_dispatch`: with a mesh that has an "expert" axis (a
    mixture-of-experts model, parallel/experts.py), the dispatch form this step's row count uses.
    A mixture-of-experts model's step also returns, last, its routed tokens per (MoE layer,
    expert) [L_moe, E] int32 over the step's real rows (padding rows write the null block, slots
    below `block_size`): the load an operator watches, one small bincount per layer.
    `batch_invariant`: attention through models/invariant_attention.py's fixed program (the caller
    traces the step inside models/batch_invariant.batch_invariant() for the row-tiled matmuls and
    norms), so a row's results do not depend on what else the step holds."""
    D, P = decode_rows, prefill_tiles

    def make_layer_attention(spec: LayerAttention):
        # one layer's attention as the model declares it (scale, sliding window, soft cap): Gemma's
        # sliding and global layers differ, the Llama family's layers are all alike
        sm_scale, window, soft_cap = spec.sm_scale, spec.sliding_window, spec.soft_cap

        def layer_attention(q, k, v, k_cache, v_cache, scales, b):
            # q: [T, N, H], k, v: [T, K, H] (a shard's heads under a mesh); scales None unless quantized
            dec_cu = jnp.arange(D + 1, dtype=jnp.int32)
            pre_cu = jnp.arange(P + 1, dtype=jnp.int32) * tile
            k_cache, v_cache = write_kv(k_cache, v_cache, k, v, b["slot_mapping"], scales)
            attend = scaled_attention(attention_impl, scales)
            out = attend(q[:D], k_cache, v_cache, b["dec_kv_lens"], b["dec_tables"], dec_cu,
                         b["dec_num"], sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
                         uniform_q_len=1, kv_chunk_blocks=DECODE_KV_CHUNK_BLOCKS, items_per_iter=decode_items(D))
            if P:
                pre = attend(q[D:], k_cache, v_cache, b["pre_kv_lens"], b["pre_tables"], pre_cu,
                             b["pre_num"], sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
                             uniform_q_len=tile, kv_chunk_blocks=PREFILL_KV_CHUNK_BLOCKS,
                             items_per_iter=PREFILL_ITEMS)
                out = jnp.concatenate([out, pre], axis=0)
            return out, k_cache, v_cache

        def invariant_layer_attention(q, k, v, k_cache, v_cache, scales, b):
            # the batch-invariant mode: every query row through grouped_attention's one program
            # (a decode row is a group of its own; a prefill tile, groups of its rows)
            k_cache, v_cache = write_kv(k_cache, v_cache, k, v, b["slot_mapping"], scales)
            dec_live = jnp.arange(D) < b["dec_num"][0]
            dec_limits = jnp.where(dec_live, b["dec_kv_lens"], 0)[:, None]              # [D, 1]
            pre_live = jnp.arange(P) < b["pre_num"][0]
            pre_limits = b["pre_kv_lens"][:, None] - tile + 1 + jnp.arange(tile)[None]   # [P, tile]
            pre_limits = jnp.where(pre_live[:, None], jnp.maximum(pre_limits, 0), 0)
            parts = [(D, 1, tiles_to_groups(q[:D, None], b["dec_tables"], dec_limits)),
                     (P, tile, tiles_to_groups(q[D:].reshape(P, tile, *q.shape[1:]), b["pre_tables"], pre_limits))]
            parts = [part for part in parts if part[0]]
            qg, tables, limits = (jnp.concatenate([groups[i] for _, _, groups in parts]) for i in range(3))
            out = grouped_attention(qg, k_cache, v_cache, tables, limits, sm_scale=sm_scale,
                                    sliding_window=window, soft_cap=soft_cap)
            rows, start = [], 0
            for slots, qlen, groups in parts:
                n = groups[0].shape[0]
                rows.append(groups_to_tiles(out[start:start + n], slots, qlen))
                start += n
            return jnp.concatenate(rows), k_cache, v_cache

        return invariant_layer_attention if batch_invariant else layer_attention

    shards = 1 if mesh is None else mesh.shape[MODEL_AXIS]
    # a MoE model on a mesh: its expert layers run split over the mesh (else the model's own layer)
    experts = ({} if mesh is None or EXPERT_AXIS not in mesh.axis_names else
               {"expert_layer": ExpertParallel(mesh, dispatch_for(D + P * tile, expert_dispatch))})
    if model is None:
        model = registry.for_config(config).model()   # the architecture's forward and compute_logits
    counts_experts = bool(config.moe_layers)
    if counts_experts and block_size is None:
        raise ValueError("a mixture-of-experts step needs the arena's block_size (to tell padding rows)")

    def step(params, kv_caches, b, prev_tokens):
        # placeholders: the token the previous step sampled for that row's request, read here on
        # the device so the host never waits for it before dispatching this step
        src = b["token_src"]
        input_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], b["input_ids"])
        quantized_kv = params.get("kv_scales") is not None
        arrays = {k: b[k] for k in ATTENTION_ARRAYS}
        runs: dict[LayerAttention, Callable] = {}

        def attention(layer, q, k, v, cache):
            spec = config.layer_attention(layer)
            if spec not in runs:
                fn = make_layer_attention(spec)
                runs[spec] = fn if mesh is None else per_shard(fn, mesh, quantized_kv)
            out, k_cache, v_cache = runs[spec](q, k, v, cache[0], cache[1], kv_scales(params, layer), arrays)
            return out, (k_cache, v_cache)

        # each row's LoRA slot reaches the projections that have slots (models/lora_delta.py)
        with lora_rows(b.get("lora_slots")):
            if counts_experts:
                hidden, kv_caches, routed = model.forward(params, config, input_ids, b["positions"], kv_caches,
                                                          attention, shards=shards, return_routing=True, **experts)
            else:
                hidden, kv_caches = model.forward(params, config, input_ids, b["positions"], kv_caches, attention,
                                                  shards=shards, **experts)
        logits = model.compute_logits(params, config, hidden[b["logits_rows"]])   # [R, V] float32
        out = (kv_caches, logits) + ((hidden,) if return_hidden else ())
        if counts_experts:
            out += (routed_counts(routed, b["slot_mapping"] >= block_size, config.num_experts),)
        return out

    return step


def routed_counts(routed: jnp.ndarray, real: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """routed [L_moe, T, K] expert ids, real [T] -> [L_moe, E] int32: per layer, how many real
    rows chose each expert (a token counts once for each of its k experts)."""
    hits = jnp.broadcast_to(real[None, :, None], routed.shape).astype(jnp.int32)
    layer = jnp.broadcast_to(jnp.arange(routed.shape[0])[:, None, None], routed.shape)
    return jnp.zeros((routed.shape[0], num_experts), jnp.int32).at[layer, routed].add(hits)
