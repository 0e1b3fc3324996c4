"""Builders for tiny checkpoints written in the test: HF directories and GGUF files.

Everything tiny is built from numpy with a fixed seed: 2 layers, hidden 64, 4 query heads and 2 KV
heads of 16, an MLP of 256 (so ffn_down rows hold one 256-value K-quant super-block).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

TINY = {
    "vocab_size": 262,  # 3 specials + 256 byte tokens + 3 merges
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he")]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(model_type: str = "llama", *, tied: bool = True, **overrides) -> dict:
    archs = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    return {"model_type": model_type, "architectures": [archs.get(model_type, "X")],
            **TINY, "tie_word_embeddings": tied, **overrides}


def tiny_tensors(config: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random HF-named tensors in HF layout for `config` (biases for qwen2, q/k norms for qwen3)."""
    rng = np.random.default_rng(seed)
    d, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n, k, h = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(dtype)

    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": w(d)}
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t |= {p + "input_layernorm.weight": w(d), p + "post_attention_layernorm.weight": w(d),
              p + "self_attn.q_proj.weight": w(n * h, d), p + "self_attn.k_proj.weight": w(k * h, d),
              p + "self_attn.v_proj.weight": w(k * h, d), p + "self_attn.o_proj.weight": w(d, n * h),
              p + "mlp.gate_proj.weight": w(i, d), p + "mlp.up_proj.weight": w(i, d),
              p + "mlp.down_proj.weight": w(d, i)}
        if config["model_type"] == "qwen2" or config.get("attention_bias"):
            t |= {p + "self_attn.q_proj.bias": w(n * h), p + "self_attn.k_proj.bias": w(k * h),
                  p + "self_attn.v_proj.bias": w(k * h)}
        if config["model_type"] != "qwen2" and config.get("attention_bias"):
            t[p + "self_attn.o_proj.bias"] = w(d)
        if config["model_type"] == "qwen3":
            t |= {p + "self_attn.q_norm.weight": w(h), p + "self_attn.k_norm.weight": w(h)}
    return t


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]


def tiny_tokenizer():
    """A byte-level BPE tokenizer with the same vocabulary as the tiny GGUFs, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(byte_tokens())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                   unk_token=SPECIALS[0], additional_special_tokens=SPECIALS,
                                   chat_template=CHAT_TEMPLATE)


def write_hf_dir(path, config: dict, tensors: dict, *, shards: int = 1, tokenizer: bool = True) -> str:
    """An HF checkpoint directory: config.json + safetensors (split round-robin into `shards` files)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, os.path.join(path, file))
            weight_map |= {n: file for n in part}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return str(path)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation, written from its definition."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}"


def write_gguf(path, arch: str, config: dict, tensors: dict, *, types: Callable[[str], object] | None = None,
               tokenizer: bool | str = True, metadata: dict | None = None, raw: dict | None = None) -> str:
    """A GGUF file as llama.cpp would write `tensors` (HF names, float32): q/k permuted for llama,
    each tensor quantized to `types(hf_name)` (default F32). `raw` adds pre-encoded tensors:
    gguf name -> (array, GGMLQuantizationType). `tokenizer`: True or "gpt2" (byte-level BPE),
    "llama" (sentencepiece BPE with byte fallback), False (none)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(path), arch)
    heads, kv, layers = (config["num_attention_heads"], config["num_key_value_heads"],
                         config["num_hidden_layers"])
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        w.add_rope_dimension_count(config["head_dim"])
    if arch == "qwen3":
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if tokenizer:
        write_tokenizer_metadata(w, "gpt2" if tokenizer is True else tokenizer)
    for key, value in (metadata or {}).items():
        if isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    for name in sorted(tensors):
        values = tensors[name].astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = llamacpp_permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = llamacpp_permute(values, kv)
        kind = types(name) if types else Q.F32
        encoded = gguf.quants.quantize(values, kind)
        w.add_tensor(gguf_name(name), encoded, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    for name, (encoded, kind) in (raw or {}).items():
        w.add_tensor(name, encoded, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


SENTENCEPIECE_PIECES = ["\u2581", "t", "h", "e", "l", "o", "w", "r", "d", "\u2581t", "he", "\u2581the", "ll",
                        "\u2581h", "\u2581w", "or", "ld", "\u2581wor", "\u2581world", "lo", "\u2581hel"]


def write_tokenizer_metadata(w, kind: str) -> None:
    """llama.cpp's tokenizer keys for a tiny byte-level BPE ("gpt2") or sentencepiece ("llama") vocab."""
    if kind == "gpt2":
        tokens = byte_tokens()
        types = [3 if t in SPECIALS else 1 for t in tokens]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_merges([" ".join(m) for m in MERGES])
        w.add_add_bos_token(False)
        w.add_pad_token_id(2)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SENTENCEPIECE_PIECES
        types = [2, 3, 3] + [6] * 256 + [1] * len(SENTENCEPIECE_PIECES)
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SENTENCEPIECE_PIECES))])
        w.add_add_space_prefix(True)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
