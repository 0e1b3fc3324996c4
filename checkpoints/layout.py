"""The tensors a Llama-family config calls for, by HF name and HF shape, and the check against them.

Every loader (GGUF, HF directory, converted) ends here, so a checkpoint that reaches the model has
exactly the tensors the model will read, each with the shape the config implies. A mismatch is
caught with a message naming the tensor, instead of as a broadcasting error deep inside jit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import ConfigMismatchError, MissingTensorError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Buffers some older HF checkpoints saved alongside the weights; they are recomputed from the config.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def check_model_type(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type={model_type!r} is not supported; jaxserve runs {SUPPORTED_MODEL_TYPES}"
        )
    return model_type


def head_dim(config: Mapping[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def has_attention_bias(config: Mapping[str, Any]) -> bool:
    # Qwen2 always has q/k/v biases; the others only when the config says so (HF semantics).
    return bool(config.get("attention_bias", config["model_type"] == "qwen2"))


def has_o_proj_bias(config: Mapping[str, Any]) -> bool:
    # Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2's biases are on q/k/v only.
    return has_attention_bias(config) and config["model_type"] != "qwen2"


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape ([out, in] for linear weights) of every tensor the config calls for."""
    model_type = check_model_type(config)
    if config.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias=True (biases on the MLP projections) is not supported")
    try:
        d, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
        n, layers = config["num_attention_heads"], config["num_hidden_layers"]
    except KeyError as e:
        raise ConfigMismatchError(f"config has no {e.args[0]!r}") from None
    k = config.get("num_key_value_heads") or n
    h = head_dim(config)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n * h, d),
            p + "self_attn.k_proj.weight": (k * h, d),
            p + "self_attn.v_proj.weight": (k * h, d),
            p + "self_attn.o_proj.weight": (d, n * h),
            p + "mlp.gate_proj.weight": (i, d),
            p + "mlp.up_proj.weight": (i, d),
            p + "mlp.down_proj.weight": (d, i),
        }
        if has_attention_bias(config):
            shapes |= {
                p + "self_attn.q_proj.bias": (n * h,),
                p + "self_attn.k_proj.bias": (k * h,),
                p + "self_attn.v_proj.bias": (k * h,),
            }
        if has_o_proj_bias(config):
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if model_type == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)}
    return shapes


def check_tensors(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` without ignorable buffers, after checking names and shapes against `config`.

    A tied model may still carry an `lm_head.weight` (some exporters write it); it is dropped when
    its shape fits, since the model reads the embedding in its place.
    """
    want = expected_shapes(config)
    kept = {name: t for name, t in tensors.items() if not _IGNORED.match(name)}
    if config.get("tie_word_embeddings", False) and "lm_head.weight" in kept:
        lm_head = kept.pop("lm_head.weight")
        if tuple(lm_head.shape) != want["model.embed_tokens.weight"]:
            raise ConfigMismatchError(
                f"lm_head.weight has shape {tuple(lm_head.shape)}, the config implies "
                f"{want['model.embed_tokens.weight']}"
            )
    missing = sorted(set(want) - set(kept), key=_natural)
    if missing:
        raise MissingTensorError(
            f"{len(missing)} tensor(s) the config calls for are missing, e.g. {missing[:5]}"
        )
    unexpected = sorted(set(kept) - set(want), key=_natural)
    if unexpected:
        raise ConfigMismatchError(
            f"{len(unexpected)} tensor(s) have no place in the config "
            f"(model_type={config['model_type']!r}, num_hidden_layers={config['num_hidden_layers']}), "
            f"e.g. {unexpected[:5]}"
        )
    for name, shape in want.items():
        got = tuple(kept[name].shape)
        if got != shape:
            raise ConfigMismatchError(f"{name} has shape {got}, the config implies {shape}")
    return kept


def _natural(name: str) -> tuple:
    # layer 10 sorts after layer 9 in error messages
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
