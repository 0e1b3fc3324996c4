"""GGUF files written in the test with gguf.GGUFWriter, loaded back into HF names and layouts."""

import numpy as np
import pytest
from ckpt_testkit import llamacpp_permute, tiny_config, tiny_tensors, write_gguf
from gguf import GGMLQuantizationType as Q
from gguf import quants

from jaxserve.checkpoints import load_checkpoint
from jaxserve.checkpoints.gguf_loader import unpermute_rows

# Worst-case error of each block type relative to its block (32 values): its amax, or its range.
BLOCK = 32
ERROR_BOUNDS = {
    Q.Q8_0: lambda b: np.abs(b).max(axis=-1, keepdims=True) / 127,
    Q.Q4_0: lambda b: np.abs(b).max(axis=-1, keepdims=True) / 8,
    Q.Q5_0: lambda b: np.abs(b).max(axis=-1, keepdims=True) / 16,
    Q.Q4_1: lambda b: np.ptp(b, axis=-1, keepdims=True) / 15,
    Q.Q5_1: lambda b: np.ptp(b, axis=-1, keepdims=True) / 31,
    Q.F16: lambda b: np.abs(b) / 1024,
    Q.BF16: lambda b: np.abs(b) / 128,
}


def _matrices(name: str) -> bool:
    return name.endswith(".weight") and "norm" not in name


@pytest.mark.parametrize("kind", list(ERROR_BOUNDS), ids=lambda k: k.name)
def test_every_block_type_dequantizes_within_its_error(tmp_path, kind):
    config = tiny_config("llama")
    tensors = tiny_tensors(config)
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tensors,
                      types=lambda n: kind if _matrices(n) else Q.F32)
    ckpt = load_checkpoint(path)
    for name, want in tensors.items():
        got = ckpt.tensors[name]
        assert got.shape == want.shape, name
        if not _matrices(name):
            np.testing.assert_array_equal(got, want)
            continue
        # float types keep their stored dtype; block types come back as float32
        assert got.dtype.name == {Q.F16: "float16", Q.BF16: "bfloat16"}.get(kind, "float32")
        blocks = want.reshape(*want.shape[:-1], -1, BLOCK)
        err = np.abs(got.astype(np.float32).reshape(blocks.shape) - blocks)
        bound = ERROR_BOUNDS[kind](blocks)
        assert (err <= bound * 1.01 + 1e-7).all(), f"{name}: error {err.max()} beyond the {kind.name} bound"
        assert err.max() > 0 or kind in (Q.F16,), "a lossy type that lost nothing: the test wrote floats"


def test_block_types_equal_the_gguf_reference_dequantization(tmp_path):
    config = tiny_config("qwen2", tied=False)  # no q/k permutation in qwen2, so values compare directly
    tensors = tiny_tensors(config)
    kinds = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
    types = {n: kinds[i % len(kinds)] for i, n in enumerate(sorted(n for n in tensors if _matrices(n)))}
    path = write_gguf(tmp_path / "m.gguf", "qwen2", config, tensors, types=lambda n: types.get(n, Q.F32))
    ckpt = load_checkpoint(path)
    for name, kind in types.items():
        want = quants.dequantize(quants.quantize(tensors[name], kind), kind)
        np.testing.assert_array_equal(ckpt.tensors[name], want, err_msg=name)


def _k_quant_blocks(kind, rows: int, rng) -> np.ndarray:
    """Random K-quant super-blocks (the gguf package cannot quantize these) with sane fp16 scales."""
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[kind]
    raw = rng.integers(0, 256, size=(rows, size), dtype=np.uint8)
    scale = np.full((rows, 1), 0.01, np.float16).view(np.uint8)
    if kind == Q.Q4_K:  # d, dmin lead the block
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    else:  # d ends the block
        raw[:, 208:210] = scale
    return raw


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K], ids=lambda k: k.name)
def test_k_quants_load_as_the_gguf_package_dequantizes_them(tmp_path, kind):
    config = tiny_config("qwen2")
    tensors = tiny_tensors(config)
    blocks = _k_quant_blocks(kind, config["hidden_size"], np.random.default_rng(1))  # one row per output
    down = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}
    path = write_gguf(tmp_path / "m.gguf", "qwen2", config, down,
                      raw={"blk.1.ffn_down.weight": (blocks, kind)})
    got = load_checkpoint(path).tensors["model.layers.1.mlp.down_proj.weight"]
    assert got.shape == (config["hidden_size"], config["intermediate_size"]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, quants.dequantize(blocks, kind))
    assert np.isfinite(got).all() and got.std() > 0


def test_llama_q_and_k_come_back_in_hf_layout(tmp_path):
    # The writer permutes q/k as llama.cpp's converter does; loading must give the HF rows back exactly.
    config = tiny_config("llama")
    tensors = tiny_tensors(config)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", config, tensors))
    for layer in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            np.testing.assert_array_equal(ckpt.tensors[name], tensors[name])


def test_unpermute_inverts_llamacpp_permute_and_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    q = rng.standard_normal((4 * 16, 8)).astype(np.float32)  # 4 heads of 16
    k = rng.standard_normal((2 * 16, 8)).astype(np.float32)  # 2 kv heads
    stored_q, stored_k = llamacpp_permute(q, 4), llamacpp_permute(k, 2)
    assert not np.array_equal(stored_q, q)  # the permutation really moves rows
    np.testing.assert_array_equal(unpermute_rows(stored_q, 4), q)
    np.testing.assert_array_equal(unpermute_rows(stored_k, 2), k)
    reference = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    np.testing.assert_array_equal(reference.process(stored_q, "blk.0.attn_q.weight").weights, q)
    np.testing.assert_array_equal(reference.process(stored_k, "blk.0.attn_k.weight").weights, k)


def test_config_is_built_from_the_metadata(tmp_path):
    config = tiny_config("llama", tied=False, rope_theta=50000.0, max_position_embeddings=512)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config)))
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert ckpt.config[key] == config[key], key
    assert ckpt.config["rms_norm_eps"] == pytest.approx(1e-5)
    assert ckpt.config["tie_word_embeddings"] is False and "lm_head.weight" in ckpt.tensors
    assert ckpt.format == "gguf"


def test_tied_embeddings_when_there_is_no_output_tensor(tmp_path):
    config = tiny_config("llama", tied=True)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config)))
    assert ckpt.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.tensors


def test_qwen2_biases_and_no_permutation(tmp_path):
    config = tiny_config("qwen2", tied=False)
    tensors = tiny_tensors(config)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "qwen2", config, tensors))
    assert ckpt.config["model_type"] == "qwen2"
    assert set(ckpt.tensors) == set(tensors)
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(ckpt.tensors[name], tensors[name])


def test_qwen3_head_dim_comes_from_the_key_length_and_qk_norms_load(tmp_path):
    # head_dim 32 with hidden 64 and 4 heads: not hidden // heads, as in real Qwen3 models
    config = tiny_config("qwen3", head_dim=32)
    tensors = tiny_tensors(config)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "qwen3", config, tensors))
    assert ckpt.config["head_dim"] == 32
    assert ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        np.testing.assert_array_equal(ckpt.tensors[name], tensors[name])


def test_config_is_accepted_by_model_config(tmp_path):
    from jaxserve.models.config import ModelConfig

    for arch in ("llama", "qwen2", "qwen3"):
        config = tiny_config(arch)
        ckpt = load_checkpoint(write_gguf(tmp_path / f"{arch}.gguf", arch, config, tiny_tensors(config)))
        mc = ModelConfig.from_hf_config(ckpt.config)
        assert (mc.model_type, mc.head_dim, mc.num_key_value_heads) == (arch, 16, 2)
        assert mc.attention_bias == (arch == "qwen2") and mc.qk_norm == (arch == "qwen3")


TOKENIZER_TEXTS = ["the hello world", "  the  world  ", "tabs\tand\nnew lines", "héllo wörld 😀 日本",
                   "<s>the</s> <|im_end|>", ""]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_gguf_tokenizers_encode_like_transformers(tmp_path, kind):
    from transformers import AutoTokenizer

    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config), tokenizer=kind)
    ours = load_checkpoint(path).tokenizer
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TOKENIZER_TEXTS:
        assert ours(text).input_ids == reference(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == reference.decode(reference(text).input_ids), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == (reference.bos_token, reference.eos_token,
                                                                reference.unk_token)
    assert ours.chat_template == reference.chat_template
    if kind == "llama":  # sentencepiece files add BOS unless they say otherwise, as llama.cpp does
        assert ours("the").input_ids[0] == 1


def test_a_gguf_without_a_vocabulary_has_no_tokenizer(tmp_path):
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config), tokenizer=False)
    assert load_checkpoint(path).tokenizer is None
