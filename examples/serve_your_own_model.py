"""Serve a model of your own, written in plain JAX, with jaxserve: no fork, no checkpoint.

    python examples/serve_your_own_model.py

The model below lives outside the jaxserve package: its own parameter pytree (nested dicts and a
list of layers), its own RoPE (interleaved pairs, GPT-J style, not HF's rotate-half), RMSNorm and
a GeGLU MLP; layer 1 attends over a sliding window and every layer soft-caps its scores. Random
weights from a seed, a tiny byte-level BPE tokenizer, and small engine shapes so it runs on a CPU
in seconds. jaxserve brings the paged KV cache, continuous batching, prefix caching, chunked
prefill and the compiled steps; the model brings `forward` and `compute_logits` (the protocol:
docs/custom_models.md).

`reference_generate` runs the same model with its own dense causal attention, recomputing the
whole sequence for every token, without the engine: tests/models/test_custom_model.py checks the
engine's greedy tokens against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# -- the model: sizes and its own functions -----------------------------------------------------

VOCAB = 320            # the tiny tokenizer's
D_MODEL = 64
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2       # grouped-query attention: 2 query heads per KV head
HEAD_DIM = 16
D_FF = 128
MAX_POSITIONS = 512
ROPE_THETA = 10_000.0
SLIDING_WINDOW = 24    # layer 1 sees the last 24 keys (the query's own included); layer 0 all of them
SLIDING_LAYERS = (1,)
SOFT_CAP = 30.0        # s -> 30 * tanh(s / 30) on every layer's attention scores


def init_params(seed: int = 0) -> dict:
    """Random weights: {"embed", "layers": [per-layer dicts], "final_norm", "unembed"}."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 7 * NUM_LAYERS))

    def normal(shape, scale):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    qkv_scale = 1.5 / np.sqrt(D_MODEL)
    layers = []
    for _ in range(NUM_LAYERS):
        layers.append({
            "attn_norm": jnp.ones((D_MODEL,), jnp.float32),
            "wq": normal((D_MODEL, NUM_HEADS * HEAD_DIM), qkv_scale),
            "wk": normal((D_MODEL, NUM_KV_HEADS * HEAD_DIM), qkv_scale),
            "wv": normal((D_MODEL, NUM_KV_HEADS * HEAD_DIM), 1 / np.sqrt(D_MODEL)),
            "wo": normal((NUM_HEADS * HEAD_DIM, D_MODEL), 1 / np.sqrt(NUM_HEADS * HEAD_DIM)),
            "mlp_norm": jnp.ones((D_MODEL,), jnp.float32),
            "w_gate": normal((D_MODEL, D_FF), 1 / np.sqrt(D_MODEL)),
            "w_up": normal((D_MODEL, D_FF), 1 / np.sqrt(D_MODEL)),
            "w_down": normal((D_FF, D_MODEL), 1 / np.sqrt(D_FF)),
        })
    return {"embed": normal((VOCAB, D_MODEL), 1.0), "layers": layers,
            "final_norm": jnp.ones((D_MODEL,), jnp.float32),
            "unembed": normal((D_MODEL, VOCAB), 2.5 / np.sqrt(D_MODEL))}


def rms_norm(x, weight, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, positions):
    """Interleaved RoPE: pairs (x[2i], x[2i+1]) rotated by position * theta^(-2i/H). x [T, heads, H]."""
    inv_freq = ROPE_THETA ** (-jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)     # [H/2]
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq                        # [T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


def forward(params, input_ids, positions, kv_caches, attention):
    """input_ids, positions [T] int32 (a packed batch: the attention callback knows who sees whom)
    -> (hidden [T, D], new per-layer KV caches)."""
    t = input_ids.shape[0]
    x = params["embed"][input_ids]                                                           # [T, D]
    new_caches = []
    for i, layer in enumerate(params["layers"]):        # a Python loop: layer i is a Python int
        h = rms_norm(x, layer["attn_norm"])
        q = rope((h @ layer["wq"]).reshape(t, NUM_HEADS, HEAD_DIM), positions)
        k = rope((h @ layer["wk"]).reshape(t, NUM_KV_HEADS, HEAD_DIM), positions)
        v = (h @ layer["wv"]).reshape(t, NUM_KV_HEADS, HEAD_DIM)
        out, cache = attention(i, q, k, v, kv_caches[i])                                     # [T, N, H]
        new_caches.append(cache)
        x = x + out.reshape(t, NUM_HEADS * HEAD_DIM) @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"])
        x = x + (jax.nn.gelu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    return rms_norm(x, params["final_norm"]), new_caches


def compute_logits(params, hidden):
    """hidden [S, D] -> logits [S, V] float32."""
    return (hidden @ params["unembed"]).astype(jnp.float32)


def partition_specs(params):
    """Tensor parallelism: q/k/v and gate/up split by columns (whole heads per device), o and down
    by rows; the rest replicated. Axis "model" is the engine's tensor-parallel mesh axis."""
    from jax.sharding import PartitionSpec as P

    column, row = P(None, "model"), P("model", None)
    split = {"wq": column, "wk": column, "wv": column, "w_gate": column, "w_up": column, "wo": row, "w_down": row}
    return {"embed": P(), "final_norm": P(), "unembed": P(),
            "layers": [{name: split.get(name, P()) for name in layer} for layer in params["layers"]]}


def custom_model(eos_token_id: int | None = None):
    """What jaxserve needs to know of the model, beside its params."""
    from jaxserve import CustomModel

    return CustomModel(
        forward=forward, compute_logits=compute_logits, name="tiny-rope-lm",
        num_layers=NUM_LAYERS, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS,
        eos_token_ids=() if eos_token_id is None else (eos_token_id,),
        sliding_window=SLIDING_WINDOW, sliding_layers=SLIDING_LAYERS, attn_soft_cap=SOFT_CAP,
        partition_specs=partition_specs)


# -- the same model without the engine: dense causal attention, the whole sequence each step ---

def dense_causal_attention(layer_idx, q, k, v, kv_cache):
    """One sequence at positions 0..T-1, no cache: the model's own definition of its attention."""
    t = q.shape[0]
    k = jnp.repeat(k, NUM_HEADS // NUM_KV_HEADS, axis=1)                                    # [T, N, H]
    v = jnp.repeat(v, NUM_HEADS // NUM_KV_HEADS, axis=1)
    scores = jnp.einsum("qnh,knh->nqk", q, k) * HEAD_DIM ** -0.5                            # [N, T, T]
    scores = SOFT_CAP * jnp.tanh(scores / SOFT_CAP)
    qi, kj = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    visible = kj <= qi
    if layer_idx in SLIDING_LAYERS:
        visible &= kj > qi - SLIDING_WINDOW
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("nqk,knh->qnh", probs, v), kv_cache


@jax.jit
def _full_logits(params, ids):
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    hidden, _ = forward(params, ids, positions, [None] * NUM_LAYERS, dense_causal_attention)
    return compute_logits(params, hidden)


def reference_generate(params, prompt_ids, max_new_tokens: int, *, pad_to: int = 256) -> tuple[list[int], float]:
    """Greedy continuation by full recomputation (the sequence padded to `pad_to`, which causal
    attention never lets an earlier position see). Returns (tokens, the smallest top-1 / top-2
    logit gap met on the way: how far each choice was from a tie)."""
    ids = list(prompt_ids)
    if len(ids) + max_new_tokens > pad_to:
        raise ValueError(f"{len(ids)} + {max_new_tokens} tokens do not fit pad_to={pad_to}")
    out, gap = [], np.inf
    for _ in range(max_new_tokens):
        logits = np.asarray(_full_logits(params, jnp.asarray(ids + [0] * (pad_to - len(ids)), jnp.int32)))
        row = logits[len(ids) - 1]
        top2 = np.sort(row)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        token = int(np.argmax(row))
        out.append(token)
        ids.append(token)
    return out, gap


# -- serving it ---------------------------------------------------------------------------------

# Small engine shapes: 4 seats, 64 tokens a step in tiles of 16, 8-token blocks; few buckets to
# compile, no disk caches (pass cache_dir to keep the compiled steps for the next start).
ENGINE = dict(max_num_seqs=4, max_model_len=256, block_size=8, prefill_tile=16, max_num_batched_tokens=64,
              num_kv_blocks=128, xla_optimization_level=0, compilation_cache_dir="", cache_dir="")


def main() -> None:
    from jaxserve import LLM, SamplingParams
    from jaxserve.testing.tiny_models import make_tokenizer

    tokenizer = make_tokenizer(VOCAB)
    params = init_params(seed=0)
    llm = LLM(model=custom_model(tokenizer.eos_token_id), params=params, tokenizer=tokenizer, progress=False,
              **ENGINE)
    prompts = ["The tide comes in", "The tide goes out", "Rivers run to the sea"]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    for out in outputs:       # random weights: the text is noise, the point is that it is the model's
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    first = outputs[0]
    reference, _ = reference_generate(params, first.prompt_token_ids, 32)
    print("engine == full recomputation without it:", list(first.outputs[0].token_ids) == reference)
    stats = llm.stats()
    print(f"compilations after warm-up: {stats.steps.num_compilations_after_warmup}; "
          f"model identity {llm.checkpoint_identity[:16]}")


if __name__ == "__main__":
    main()
