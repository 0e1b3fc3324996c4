"""Mixture-of-experts speed: a random MoE's forward against a dense model of the same ACTIVE
parameters and against the same MoE computed densely (every expert over every token: models/moe.py
`moe_mlp_dense_reference`), at decode sizes (a few token rows) and prefill sizes (hundreds).

    .venv/bin/python scripts/bench_moe.py                              # the small shape, our CPU
    .venv/bin/python scripts/bench_moe.py --shape qwen3-30b-a3b --dtype bfloat16   # a GPU (gpu_bench.sh)

What runs: the model's jitted forward (models/moe_decoder.py; models/llama.py for the dense model)
over T new token rows with the dense causal attention (models/attention.py) and no KV cache, random
weights drawn on the device. The three variants share the attention, embedding and norms exactly,
so the ratios are the expert layer's; tokens/s = T / the median of the repeats (variants
interleaved, so drift in the machine's speed falls on all three alike). The dense model's MLP has
intermediate size top_k x the experts' (the active parameters per token of the MoE's experts);
the MoE's router adds D x E more.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

SHAPES = {
    # a few ms per decode step on our 2-core CPU
    "small": dict(vocab_size=384, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=128),
    # Qwen3-30B-A3B's shape (30.5 B parameters, 3.3 B active): 48 layers, 128 experts, top 8
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768),
}


def configs(shape: str):
    """(the MoE's ModelConfig, the dense model of its active parameters' ModelConfig)."""
    from jaxserve.models.config import ModelConfig

    s = dict(SHAPES[shape])
    common = dict(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"],
                  num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                  head_dim=s["head_dim"], max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=False)
    moe = ModelConfig.from_hf_config(dict(common, model_type="qwen3_moe", num_experts=s["num_experts"],
                                          num_experts_per_tok=s["num_experts_per_tok"],
                                          moe_intermediate_size=s["moe_intermediate_size"], norm_topk_prob=True,
                                          intermediate_size=s["moe_intermediate_size"], decoder_sparse_step=1))
    dense = ModelConfig.from_hf_config(dict(common, model_type="qwen3",
                                            intermediate_size=s["num_experts_per_tok"] * s["moe_intermediate_size"]))
    return moe, dense


def random_params(config, dtype: str, seed: int = 0):
    """Random params of `config`, drawn on the device leaf by leaf (norm weights 1)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.params import abstract_params

    abstract = abstract_params(config, dtype)
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "norm" in name:
            out.append(jnp.ones(leaf.shape, leaf.dtype))
            continue
        out.append(_draw(tuple(leaf.shape), jnp.dtype(leaf.dtype))(jax.random.fold_in(key, i)))
    return jax.tree_util.tree_unflatten(tree, out)


@functools.cache
def _draw(shape: tuple[int, ...], dtype):
    """One compiled draw per leaf shape (a 48-layer model has a dozen, not 500)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype))


def forward_fn(config, expert_layer=None):
    import jax

    from jaxserve.models import registry
    from jaxserve.models.attention import dense_causal_attention

    model = registry.for_config(config).model()
    attention = dense_causal_attention(config)
    kwargs = {} if expert_layer is None else {"expert_layer": expert_layer}

    def run(params, ids):
        positions = jax.numpy.arange(ids.shape[0], dtype=jax.numpy.int32)
        hidden, _ = model.forward(params, config, ids, positions, None, attention, **kwargs)
        return hidden

    return jax.jit(run)


def measure(shape: str, dtype: str, sizes: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.moe import moe_mlp_dense_reference

    moe_config, dense_config = configs(shape)
    moe_params = random_params(moe_config, dtype)
    dense_params = random_params(dense_config, dtype, seed=1)
    variants = {"moe_grouped": (forward_fn(moe_config), moe_params),
                "moe_dense_all_experts": (forward_fn(moe_config, moe_mlp_dense_reference), moe_params),
                "dense_same_active": (forward_fn(dense_config), dense_params)}
    rows = []
    rng = np.random.default_rng(0)
    for t in sizes:
        ids = jnp.asarray(rng.integers(3, moe_config.vocab_size, t), jnp.int32)
        for fn, params in variants.values():
            jax.block_until_ready(fn(params, ids))                  # compile and first run
        times = {name: [] for name in variants}
        for _ in range(repeats):
            for name, (fn, params) in variants.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(params, ids))
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(v) for name, v in times.items()}
        rows.append({"tokens": t, **{f"{name}_tok_s": t / s for name, s in medians.items()},
                     **{f"{name}_ms": s * 1e3 for name, s in medians.items()}})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| rows T | MoE grouped tok/s | MoE dense-all-experts tok/s | dense same-active tok/s | "
           "grouped / dense-all | grouped / dense same-active |", "|---|---|---|---|---|---|"]
    for r in rows:
        g, a, d = r["moe_grouped_tok_s"], r["moe_dense_all_experts_tok_s"], r["dense_same_active_tok_s"]
        out.append(f"| {r['tokens']} | {g:,.0f} | {a:,.0f} | {d:,.0f} | {g / a:.2f}x | {g / d:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench_moe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="small")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--sizes", default="1,8,32,512", help="token rows per forward: decode sizes, then prefill")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    import jax

    moe, dense = configs(args.shape)
    print(f"{args.shape} {args.dtype} on {jax.devices()[0].device_kind}: {moe.num_experts} experts, top "
          f"{moe.num_experts_per_tok}, expert F {moe.moe_intermediate_size}; dense F {dense.intermediate_size}; "
          f"medians of {args.repeats}", flush=True)
    print(table(measure(args.shape, args.dtype, [int(s) for s in args.sizes.split(",")], args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
