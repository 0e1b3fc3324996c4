"""Qwen3-MoE and Mixtral (models/moe_decoder.py) against HF transformers on tiny random models built
from transformers' own config classes, and the expert layer (models/moe.py) against its dense
reference.

- fp32 logits within 1e-4 of HF's (observed ~1e-5) and free-running greedy decoding of 32 tokens
  token-identical for several prompts, every step's top-1/top-2 gap checked >= 1e-2 so a match is
  not luck. Qwen3-MoE's tiny model has a dense last layer (`mlp_only_layers`) and top-k weights
  not renormalized; Mixtral's every layer sparse, renormalized.
- The grouped matmul (both forms: tiled, ragged_dot) against a per-expert loop on routings with
  experts that get no row and one that gets every row; the whole layer against the
  dense-all-experts reference, and split over two expert halves (`expert_offset`) summed.
- A GGUF written by the `gguf` package (stacked `ffn_*_exps`, `ffn_gate_inp`) loads to the same
  tensors as the safetensors checkpoint.
- int8 / int4 experts: the model equals its dequantized float model (the bound of
  tests/quant/test_quantized_model.py); w8a8 and fp8 are refused for a MoE model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import ModelConfig, dense_causal_attention, params_from_hf, registry
from jaxserve.models import moe

PROMPT_LEN, NEW_TOKENS, NUM_PROMPTS = 12, 32, 3
SEQ_LEN = PROMPT_LEN + NEW_TOKENS
FP32_ATOL = 1e-4
MIN_GREEDY_GAP = 1e-2
FAST_COMPILE = {"xla_backend_optimization_level": 0}

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
               bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
# model_type -> (torch seed, config overrides): 8 experts, top 2; seeds chosen so every greedy step of
# every prompt has a top-1/top-2 gap above MIN_GREEDY_GAP
FAMILIES = {
    "qwen3_moe": (11, dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          mlp_only_layers=[1], norm_topk_prob=False)),
    "mixtral": (0, dict(num_local_experts=8, num_experts_per_tok=2)),
}


def _vocab_size() -> int:
    from tests.checkpoints.ckpt_testkit import byte_tokens

    return len(byte_tokens())          # the tiny GGUF tokenizer's, so the same model writes a GGUF


@dataclass
class MoeReference:
    model_type: str
    hf_config: dict
    tensors: dict              # HF-named float32 numpy
    tokens: np.ndarray         # [NUM_PROMPTS, SEQ_LEN]: prompts + HF greedy continuations
    logits: np.ndarray         # [NUM_PROMPTS, SEQ_LEN, V] HF fp32 logits over `tokens`


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_reference(request, tmp_path_factory) -> MoeReference:
    import torch
    from safetensors.numpy import load_file

    seed, overrides = FAMILIES[request.param]
    config_cls, model_cls = registry.transformers_classes(request.param)
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=_vocab_size(), **_COMMON, **overrides)).eval()
    prompts = torch.randint(0, model.config.vocab_size, (NUM_PROMPTS, PROMPT_LEN))
    with torch.no_grad():
        tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(tokens).logits.numpy()
    # the checkpoint as written (per-expert tensors; transformers holds them fused in memory)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    tensors = load_file(str(path / "model.safetensors"))
    return MoeReference(request.param, model.config.to_dict(), tensors, tokens.numpy(), logits)


@functools.lru_cache(maxsize=None)
def _logits_fn(config: ModelConfig):
    module = registry.for_config(config).model()
    attention = dense_causal_attention(config)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def logits(params, token_ids):
        positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        hidden, _ = module.forward(params, config, token_ids, positions, None, attention)
        return module.compute_logits(params, config, hidden)

    return logits


def _load(ref: MoeReference, tensors=None):
    config = ModelConfig.from_hf_config(ref.hf_config)
    return config, params_from_hf(config, ref.tensors if tensors is None else tensors, jnp.float32)


def test_config_marks_the_sparse_layers():
    base = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=6,
                num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8)
    assert ModelConfig.from_hf_config(base).moe_layers == (0, 1, 2, 3, 4, 5)
    assert ModelConfig.from_hf_config({**base, "decoder_sparse_step": 2}).moe_layers == (1, 3, 5)
    assert ModelConfig.from_hf_config({**base, "mlp_only_layers": [0, 3]}).moe_layers == (1, 2, 4, 5)
    assert not ModelConfig.from_hf_config({**base, "norm_topk_prob": False}).norm_topk_prob
    mixtral = ModelConfig.from_hf_config({**base, "model_type": "mixtral", "num_local_experts": 4,
                                          "num_experts": None})
    assert mixtral.moe_layers == tuple(range(6)) and mixtral.norm_topk_prob
    assert mixtral.moe_intermediate_size == 16
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config({**base, "num_experts_per_tok": 5})


def test_fp32_logits_match_hf(moe_reference):
    config, params = _load(moe_reference)
    fn = _logits_fn(config)
    for tokens, want in zip(moe_reference.tokens, moe_reference.logits):
        got = np.asarray(fn(params, jnp.asarray(tokens, jnp.int32)))
        np.testing.assert_allclose(got, want, rtol=0, atol=FP32_ATOL)


def test_greedy_generation_matches_hf_generate(moe_reference):
    config, params = _load(moe_reference)
    fn = _logits_fn(config)
    for ref_tokens, ref_logits in zip(moe_reference.tokens, moe_reference.logits):
        top2 = np.sort(ref_logits[PROMPT_LEN - 1:SEQ_LEN - 1], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > MIN_GREEDY_GAP, "near-tie: pick another seed"
        tokens = np.zeros(SEQ_LEN, np.int32)
        tokens[:PROMPT_LEN] = ref_tokens[:PROMPT_LEN]
        for t in range(PROMPT_LEN, SEQ_LEN):        # causal: the zero padding after t never reaches t
            tokens[t] = int(np.argmax(np.asarray(fn(params, jnp.asarray(tokens)))[t - 1]))
        assert tokens.tolist() == ref_tokens.tolist()


def test_routing_is_hfs_softmax_top_k():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.9]], jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    plain = moe.route(logits, top_k=2, norm_topk_prob=False)
    assert np.asarray(plain.expert_ids).tolist() == [[1, 2], [0, 3]]
    np.testing.assert_allclose(np.asarray(plain.weights), [probs[0, [1, 2]], probs[1, [0, 3]]], rtol=1e-6)
    normed = moe.route(logits, top_k=2, norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(normed.weights).sum(-1), 1.0, rtol=1e-6)
    counts = moe.expert_counts(plain, 4, valid=jnp.asarray([True, False]))
    assert np.asarray(counts).tolist() == [0, 1, 1, 0]


# -- the expert layer against its references --------------------------------------------------

E, D, F = 6, 16, 24


def _stacked(rng, shape):
    return {"kernel": jnp.asarray(rng.standard_normal(shape), jnp.float32)}


def _loop_reference(x, w, group_sizes):
    """Each group's rows times its expert's weight, one expert at a time (numpy)."""
    out, start = np.zeros((x.shape[0], w.shape[-1])), 0
    for e, n in enumerate(group_sizes):
        out[start:start + n] = np.asarray(x[start:start + n], np.float64) @ np.asarray(w[e], np.float64)
        start += n
    return out


@pytest.mark.parametrize("impl", [moe.TILED, moe.RAGGED_DOT])
@pytest.mark.parametrize("sizes", [[0, 3, 0, 7, 0, 0], [10, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 40],
                                   [5, 0, 13, 2, 20, 0], [0, 0, 1, 0, 0, 0], [30, 40, 0, 50, 60, 20],
                                   [3, 0, 2, 0, 0, 0]],
                         ids=["sparse", "all-first", "all-last", "mixed", "one-row", "prefill", "padded-rows"])
def test_grouped_matmul_equals_a_per_expert_loop(impl, sizes):
    rng = np.random.default_rng(sum(sizes))
    n = max(sum(sizes), 8 if sizes == [3, 0, 2, 0, 0, 0] else 0)      # rows past the groups come out zero
    x = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
    w = _stacked(rng, (E, D, F))
    got = np.asarray(moe.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl=impl))
    np.testing.assert_allclose(got, _loop_reference(x, w["kernel"], sizes), rtol=0, atol=1e-4)


def _experts(rng):
    return moe.ExpertWeights(gate_up=_stacked(rng, (E, D, 2 * F)), down=_stacked(rng, (E, F, D)))


@pytest.mark.parametrize("impl", [moe.TILED, moe.RAGGED_DOT])
@pytest.mark.parametrize("case", ["random", "one-expert-takes-all", "unused-experts"])
def test_moe_layer_equals_the_dense_all_experts_reference(impl, case):
    rng = np.random.default_rng(7)
    t, k = 11, 2
    x = jnp.asarray(rng.standard_normal((t, D)), jnp.float32)
    logits = rng.standard_normal((t, E)).astype(np.float32)
    if case == "one-expert-takes-all":
        logits[:, 4] += 50.0                          # every token's first choice
    if case == "unused-experts":
        logits[:, [0, 5]] -= 50.0                     # never chosen
    routing = moe.route(jnp.asarray(logits), top_k=k, norm_topk_prob=case != "random")
    experts = _experts(rng)
    got = moe.moe_mlp(x, routing, experts, activation=jax.nn.silu, impl=impl)
    want = moe.moe_mlp_dense_reference(x, routing, experts, activation=jax.nn.silu)
    scale = float(np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * scale)
    counts = np.asarray(moe.expert_counts(routing, E))
    assert counts.sum() == t * k
    if case == "one-expert-takes-all":
        assert counts[4] == t
    if case == "unused-experts":
        assert counts[0] == counts[5] == 0
    # two devices' halves of the experts (expert_offset), summed: what an expert-parallel layer does
    halves = [moe.ExpertWeights(jax.tree.map(lambda a: a[s:s + E // 2], experts.gate_up),
                                jax.tree.map(lambda a: a[s:s + E // 2], experts.down)) for s in (0, E // 2)]
    split = sum(moe.moe_mlp(x, routing, h, activation=jax.nn.silu, expert_offset=s, impl=impl)
                for h, s in zip(halves, (0, E // 2)))
    np.testing.assert_allclose(np.asarray(split), np.asarray(want), rtol=0, atol=1e-5 * scale)


# -- loading: GGUF, quantized ---------------------------------------------------------------------

def _write_gguf(path, ref: MoeReference) -> str:
    """The reference model as llama.cpp writes it: Qwen3-MoE as "qwen3moe", Mixtral as "llama"
    with an expert count; every MoE layer's experts stacked [E, out, in] (ffn_*_exps) and its
    router as ffn_gate_inp."""
    from tests.checkpoints.ckpt_testkit import write_gguf

    config = ModelConfig.from_hf_config(ref.hf_config)
    mixtral = config.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    block, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if mixtral else ("mlp", "gate_proj", "up_proj",
                                                                                   "down_proj")
    dense, raw = {}, {}
    for name, value in ref.tensors.items():
        if f".{block}." not in name or (not mixtral and int(name.split(".")[2]) not in config.moe_layers):
            dense[name] = value
    from gguf import GGMLQuantizationType as Q
    for i in config.moe_layers:
        m = f"model.layers.{i}.{block}."
        raw[f"blk.{i}.ffn_gate_inp.weight"] = (ref.tensors[m + "gate.weight"], Q.F32)
        for gguf_part, hf_part in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
            stacked = np.stack([ref.tensors[f"{m}experts.{e}.{hf_part}.weight"] for e in range(config.num_experts)])
            raw[f"blk.{i}.{gguf_part}.weight"] = (stacked.astype(np.float32), Q.F32)
    metadata = {f"{arch}.expert_count": config.num_experts, f"{arch}.expert_used_count": config.num_experts_per_tok}
    hf = dict(ref.hf_config, head_dim=config.head_dim, rope_theta=config.rope_theta)
    if not mixtral:
        metadata[f"{arch}.expert_feed_forward_length"] = config.moe_intermediate_size
        metadata[f"{arch}.expert_weights_norm"] = int(config.norm_topk_prob)
    return write_gguf(path, arch, hf, dense, raw=raw, metadata=metadata)


def test_gguf_load_equals_the_safetensors_load(moe_reference, tmp_path):
    from jaxserve.checkpoints.gguf_loader import load_gguf

    path = _write_gguf(tmp_path / "moe.gguf", moe_reference)
    ckpt = load_gguf(path)
    assert ckpt.config["model_type"] == moe_reference.model_type
    gguf_config = ModelConfig.from_hf_config(ckpt.config)
    config = ModelConfig.from_hf_config(moe_reference.hf_config)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_layers",
                  "head_dim", "qk_norm"):
        assert getattr(gguf_config, field) == getattr(config, field), field
    assert sorted(ckpt.tensors) == sorted(moe_reference.tensors)
    for name, value in moe_reference.tensors.items():
        np.testing.assert_array_equal(np.asarray(ckpt.tensors[name]), value, err_msg=name)


def _quantized_logits(config, tensors, spec):
    from jaxserve.checkpoints import Checkpoint
    from jaxserve.models.quantized_tensor import QuantizedTensor
    from jaxserve.quant.checkpoint import quantize_checkpoint
    from jaxserve.quant.dequantize import dequantize

    ckpt = Checkpoint(config=config, tensors=tensors, tokenizer=None, identity="sha256:" + "0" * 64,
                      source="t", format="hf")
    q = quantize_checkpoint(ckpt, spec)
    model_config = ModelConfig.from_hf_config(config)
    deq = {k: dequantize(v) if isinstance(v, QuantizedTensor) else v for k, v in q.tensors.items()}
    experts = [k for k in q.tensors if ".experts." in k]
    assert experts and all(isinstance(q.tensors[k], QuantizedTensor) for k in experts)
    assert not any(isinstance(v, QuantizedTensor) for k, v in q.tensors.items() if k.endswith(".gate.weight"))
    return model_config, q.tensors, deq


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_equal_their_dequantized_float_model(moe_reference, mode):
    from jaxserve.quant.spec import QuantSpec

    spec = QuantSpec(mode) if mode == "int8" else QuantSpec("int4", 32)
    config, quantized, deq = _quantized_logits(moe_reference.hf_config, moe_reference.tensors, spec)
    tokens = jnp.asarray(moe_reference.tokens[0], jnp.int32)
    fn = _logits_fn(config)
    got = np.asarray(fn(params_from_hf(config, quantized, jnp.float32), tokens))
    want = np.asarray(fn(params_from_hf(config, deq, jnp.float32), tokens))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    # quantization changed something: two different weight sets are compared
    assert np.abs(moe_reference.logits[0] - want).max() > 1e-4
    # and the grouped matmul's other form reads the same quantized leaves alike
    params = params_from_hf(config, quantized, jnp.float32)
    layer = config.moe_layers[0]
    experts = params[f"layers_{layer}"]["mlp"]["experts"]
    ew = moe.ExpertWeights(gate_up=experts["gate_up"], down=experts["down"])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((9, config.hidden_size)), jnp.float32)
    routing = moe.route(jnp.asarray(np.random.default_rng(1).standard_normal((9, config.num_experts)), jnp.float32),
                        top_k=config.num_experts_per_tok, norm_topk_prob=True)
    tiled = moe.moe_mlp(x, routing, ew, activation=jax.nn.silu, impl=moe.TILED)
    ragged = moe.moe_mlp(x, routing, ew, activation=jax.nn.silu, impl=moe.RAGGED_DOT)
    dense = moe.moe_mlp_dense_reference(x, routing, ew, activation=jax.nn.silu)
    scale = float(np.abs(np.asarray(dense)).max())
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(dense), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(dense), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("mode", ["w8a8", "fp8"])
def test_calibrated_quantization_is_refused_for_experts(moe_reference, mode):
    from jaxserve.checkpoints import Checkpoint
    from jaxserve.quant.checkpoint import quantize_checkpoint
    from jaxserve.quant.spec import QuantSpec

    ckpt = Checkpoint(config=moe_reference.hf_config, tensors=moe_reference.tensors, tokenizer=None,
                      identity="sha256:" + "0" * 64, source="t", format="hf")
    with pytest.raises(ValueError, match="mixture-of-experts.*int8 or int4"):
        quantize_checkpoint(ckpt, QuantSpec(mode), act_absmax={}, calibration_id="x")
