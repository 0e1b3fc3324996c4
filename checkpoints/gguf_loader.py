"""Loading a GGUF file (llama.cpp's format) into HF names, HF layouts and an HF-style config.

llama.cpp's converter renames tensors (`blk.N.attn_q.weight`), stores the config as metadata
(`llama.block_count`, ...), may quantize weights in blocks, and for the Llama architecture permutes
the rows of q/k so that its RoPE can rotate adjacent pairs. We undo each of these exactly as
transformers does when it loads a GGUF, so the result is the checkpoint HF transformers would run.
One addition: Llama 3.1-style rope scaling, which llama.cpp keeps as a `rope_freqs` tensor and
transformers ignores, is turned back into the config's "llama3" rope_scaling (see rope_freqs.py).
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .checkpoint import Checkpoint
from .gguf_blocks import block_tensor, native_kind
from jaxserve.models import registry
from jaxserve.models.quantized_tensor import QuantizedTensor
from .errors import CheckpointNotFoundError, UnsupportedArchitectureError, UnsupportedTensorTypeError
from .identity import file_identity
from .layout import check_tensors
from .rope_freqs import fit_llama3_scaling
from .tokenizer import gguf_tokenizer

# llama.cpp's per-block tensor names -> HF's, as in gguf's tensor name map for these architectures.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# a MoE layer's router and stacked experts, per model type ("{e}": the expert, split at load)
_MOE_BLOCK_NAMES = {
    model_type: {"ffn_gate_inp": f"{block}.gate", "ffn_gate_exps": f"{block}.experts.{{e}}.{gate}",
                 "ffn_up_exps": f"{block}.experts.{{e}}.{up}", "ffn_down_exps": f"{block}.experts.{{e}}.{down}"}
    for model_type, (block, gate, up, down) in {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                                                 "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}.items()}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FREQS = "rope_freqs.weight"
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"^(\w+)\.(weight|bias)$")


def load_gguf(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
              identity: str | None = None, native_quantization: str | None = None) -> Checkpoint:
    """A GGUF file as a Checkpoint: HF names and layouts, block types dequantized to float32.
    `identity`, when the caller has it, saves hashing the file; `cache_dir` keeps the hash.

    native_quantization "int8" / "int4": the decoder's linear weights stored as Q8_0 (int8) or
    Q4_0 / Q4_1 (int4) become QuantizedTensors holding their own blocks (gguf_blocks.py); the
    identity then covers that form, so it never passes for the float load of the same file."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"GGUF file {path!r} does not exist")
    t0 = time.perf_counter()
    if identity is None:
        identity = file_identity([path], cache_dir)
    t1 = time.perf_counter()
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    tensor_names = [t.name for t in reader.tensors]
    rope_freqs = next((_dequantize(t) for t in reader.tensors if t.name == _ROPE_FREQS), None)
    config = gguf_config(metadata, tensor_names, rope_freqs)
    names = {}
    weights = [t for t in reader.tensors if t.name != _ROPE_FREQS]  # folded into the config above
    for t in weights:
        if (name := hf_name(t.name, config["model_type"])) is None:
            raise UnsupportedArchitectureError(
                f"GGUF tensor {t.name!r} has no counterpart in a {config['model_type']} model"
            )
        names[t.name] = name

    def load(t) -> list[tuple[str, np.ndarray]]:
        name = names[t.name]
        values = _native(t, name, native_quantization) if native_quantization else None
        if values is None:
            values = _dequantize(t)
        if config["model_type"] in ("llama", "mixtral") and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            values = _unpermute(values, heads)
        if "{e}" in name:     # a MoE layer's experts stacked [E, out, in]: HF names one tensor per expert
            return [(name.format(e=e), np.ascontiguousarray(values[e])) for e in range(values.shape[0])]
        return [(name, values)]

    # numpy releases the GIL in the dequantization arithmetic, so tensors decode in parallel
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        tensors = dict(pair for pairs in pool.map(load, weights) for pair in pairs)
    t2 = time.perf_counter()
    if native_quantization and any(isinstance(v, QuantizedTensor) for v in tensors.values()):
        identity = native_identity(identity, native_quantization)
    tokenizer = gguf_tokenizer(metadata)
    return Checkpoint(
        config=config,
        tensors=check_tensors(config, tensors),
        tokenizer=tokenizer,
        identity=identity,
        source=path,
        format="gguf",
        load_seconds={"identity": t1 - t0, "weights": t2 - t1, "tokenizer": time.perf_counter() - t2},
    )


def gguf_config(metadata: dict[str, Any], tensor_names: list[str],
                rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """The HF config.json dict for a GGUF's metadata (`<arch>.*` keys), tensor list and, when the
    file has one, its `rope_freqs` tensor (Llama 3.1-style rope scaling)."""
    arch = metadata.get("general.architecture")
    try:
        family, model_type = registry.for_gguf(arch)      # Mistral GGUFs say "llama"
    except ValueError as e:
        raise UnsupportedArchitectureError(str(e)) from None
    if model_type == "llama" and metadata.get(f"{arch}.expert_count"):
        family, model_type = registry.MOE, "mixtral"       # and so do Mixtral's, with experts
    hf_class = family.hf_classes[model_type]

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    if missing := [f"{arch}.{name}" for name in required if key(name) is None]:
        raise UnsupportedArchitectureError(f"GGUF metadata lacks what the config needs: {missing}")
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    # Qwen3's head_dim is not hidden/heads; llama.cpp states it as the key length (and the rope width).
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    vocab = key("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length", 2048),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "rope_scaling": _rope_scaling(key),
    }
    if rope_freqs is not None:
        try:
            config["rope_scaling"] = fit_llama3_scaling(
                rope_freqs, config["rope_theta"], head_dim, key("rope.scaling.original_context_length"))
        except ValueError as e:
            raise UnsupportedArchitectureError(f"unsupported rope scaling: {e}") from None
    if model_type != "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if key("expert_count"):
        config.update(_moe_config(model_type, key, tensor_names))
    return config


def _moe_config(model_type: str, key, tensor_names: list[str]) -> dict[str, Any]:
    """The HF MoE keys of a GGUF's `<arch>.expert_*` metadata. A layer without a router
    (`ffn_gate_inp`) has a dense MLP: Qwen3-MoE's mlp_only_layers. llama.cpp renormalizes
    Qwen3-MoE's top-k unless `expert_weights_norm` says otherwise (every released Qwen3-MoE sets
    norm_topk_prob); Mixtral always renormalizes."""
    moe: dict[str, Any] = {"num_experts_per_tok": key("expert_used_count")}
    if model_type == "mixtral":
        return moe | {"num_local_experts": key("expert_count")}
    dense = [i for i in range(key("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    return moe | {"num_experts": key("expert_count"), "mlp_only_layers": dense, "decoder_sparse_step": 1,
                  "moe_intermediate_size": key("expert_feed_forward_length"),
                  "norm_topk_prob": bool(key("expert_weights_norm", True))}


def _rope_scaling(key) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(key("rope.scaling.factor", 1.0))}
    if (original := key("rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def hf_name(gguf_name: str, model_type: str | None = None) -> str | None:
    """HF name of a llama.cpp tensor name, or None if it is not one of a Llama-family model's. A
    MoE layer's stacked experts (`ffn_*_exps`) name every expert's tensor, "{e}" in the name."""
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        if model_type in _MOE_BLOCK_NAMES and part in _MOE_BLOCK_NAMES[model_type]:
            return f"model.layers.{layer}.{_MOE_BLOCK_NAMES[model_type][part]}.{kind}"
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
        return None
    if (m := _TOP.match(gguf_name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF's rotate-half layout back from interleaved pairs).

    llama.cpp stores each head's rows as (pair, half) and we want (half, pair):
    w: [num_heads * head_dim, ...] -> the same shape, rows reordered within each head.
    """
    half = w.shape[0] // num_heads // 2
    return np.ascontiguousarray(
        w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def _native(tensor, hf: str, want: str) -> QuantizedTensor | None:
    """The tensor's own blocks when it is a linear weight in a block type of the wanted width."""
    if not _LINEAR.match(hf) or native_kind(tensor.tensor_type.name) != want:
        return None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return block_tensor(tensor.tensor_type.name, tensor.data, shape)


def _unpermute(values, heads: int):
    if not isinstance(values, QuantizedTensor):
        return unpermute_rows(values, heads)
    # rows are output channels in every part of a quantized tensor
    offset = None if values.offset is None else unpermute_rows(values.offset, heads)
    return QuantizedTensor(values.kind, unpermute_rows(values.qweight, heads), unpermute_rows(values.scale, heads),
                           offset)


def native_identity(identity: str, kind: str) -> str:
    """A natively quantized load's identity: the file's, and the form it was loaded in."""
    import hashlib

    return "sha256:" + hashlib.sha256(f"{identity}|gguf-native-{kind}".encode()).hexdigest()


def _dequantize(tensor) -> np.ndarray:
    """Values of one GGUF tensor in numpy (HF) axis order: float types kept, block types to float32."""
    import gguf
    import ml_dtypes

    kind = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest axis first
    data = tensor.data
    if kind == gguf.GGMLQuantizationType.F32:
        values = np.array(data, dtype=np.float32)
    elif kind == gguf.GGMLQuantizationType.F16:
        values = np.array(data, dtype=np.float16)
    elif kind == gguf.GGMLQuantizationType.BF16:
        values = np.array(data).view(ml_dtypes.bfloat16)
    else:
        try:
            values = gguf.quants.dequantize(data, kind)
        except NotImplementedError:
            raise UnsupportedTensorTypeError(
                f"GGUF tensor {tensor.name!r} is stored as {kind.name}, which the gguf package "
                f"cannot dequantize"
            ) from None
        values = np.asarray(values, dtype=np.float32)
    return values.reshape(shape)
