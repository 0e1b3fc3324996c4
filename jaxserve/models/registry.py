"""The model registry: one row per architecture, the only place that knows what a model is.

A row (`Architecture`) names the HF `model_type`s it serves and declares, once:
- its tensors (`layout(config) -> TensorLayout`, models/tensor_layout.py): HF names and shapes,
  the params tree, each parameter's tensor-parallel split, which projections quantize; the
  checkpoint check, conversion, random weights, sharding and quantization all derive from it;
- its forward: a module path (imported only when a model runs, so the host-side loaders that
  read the rest never import jax) whose `forward(params, config, input_ids, positions, kv_caches,
  attention, *, shards)` and `compute_logits(params, config, hidden)` the runner, the
  quantization passes and the bench call through `Architecture.model()`;
- where its checkpoints come from: GGUF `general.architecture` names it reads, the HF classes
  (`architectures` in config.json) and the transformers config/model classes that build a tiny
  random model of it for tests (testing/tiny_models.py) and benchmarks (bench/random_model.py).

How the config dict becomes a ModelConfig (per model type) is models/config.py.

Adding an architecture: one model file (its forward), one row here (its layout function and
names), and its tests: docs/design.md's "Adding an architecture" says what each needs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from jaxserve.models.tensor_layout import (
    COLUMN, ROW, VOCAB_COLUMNS, VOCAB_ROWS, ExpertProjection, Projection, TensorLayout, Weight,
)

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]                 # HF config.json `model_type` values it serves
    layout: Callable[["ModelConfig"], TensorLayout]
    forward_module: str                          # has forward() and compute_logits()
    hf_classes: dict[str, str] = field(default_factory=dict)          # model_type -> HF class name
    gguf_architectures: dict[str, str] = field(default_factory=dict)  # GGUF arch -> model_type
    # model_type -> (transformers config class, model class), for tiny random models
    transformers_classes: dict[str, tuple[str, str]] = field(default_factory=dict)

    def model(self) -> ModuleType:
        """The module with this architecture's forward and compute_logits (imports jax)."""
        if not self.forward_module:
            raise ValueError(f"the {self.name} architecture's forward is handed to the engine, not registered")
        return importlib.import_module(self.forward_module)


# -- the Llama family: Llama (Llama 2/3, SmolLM2), Mistral, Qwen2, Qwen3 --------------------------

def has_o_proj_bias(config: "ModelConfig") -> bool:
    # Llama, Qwen3 and Gemma put `attention_bias` on o_proj too; Qwen2's bias is on q/k/v only.
    return config.attention_bias and config.model_type != "qwen2"


def decoder_layout(config: "ModelConfig", *, extra_norms: tuple[str, ...] = (), norm_fill: float = 1.0) -> TensorLayout:
    """A pre-norm decoder with fused q|k|v and gate|up projections: the Llama family's tensors,
    which the Gemma models extend with `extra_norms` (per layer, [D] each). `norm_fill`: a
    random model's norm weights (1 for `w * x`, 0 for Gemma's `(1 + w) * x`)."""
    c = config

    def norm(name: str, size: int) -> Weight:
        return Weight(name, (size,), fill=norm_fill)

    d, f, h, v = c.hidden_size, c.intermediate_size, c.head_dim, c.vocab_size
    n, k = c.num_attention_heads, c.num_key_value_heads
    modules: dict = {("embed_tokens",): Weight("model.embed_tokens.weight", (v, d), leaf="embedding",
                                                split=VOCAB_ROWS, float_only=True)}
    for i in range(c.num_hidden_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layer = f"layers_{i}"
        modules[(layer, "input_layernorm")] = norm(p + "input_layernorm.weight", d)
        modules[(layer, "self_attn", "qkv_proj")] = Projection(
            ((a + "q_proj", n * h), (a + "k_proj", k * h), (a + "v_proj", k * h)), d, COLUMN,
            bias=c.attention_bias, shard_major="qkv")
        modules[(layer, "self_attn", "o_proj")] = Projection(((a + "o_proj", d),), n * h, ROW,
                                                             bias=has_o_proj_bias(c))
        if c.qk_norm:
            modules[(layer, "self_attn", "q_norm")] = norm(a + "q_norm.weight", h)
            modules[(layer, "self_attn", "k_norm")] = norm(a + "k_norm.weight", h)
        modules[(layer, "post_attention_layernorm")] = norm(p + "post_attention_layernorm.weight", d)
        for extra in extra_norms:
            modules[(layer, extra)] = norm(p + extra + ".weight", d)
        modules[(layer, "mlp", "gate_up_proj")] = Projection(((m + "gate_proj", f), (m + "up_proj", f)), d, COLUMN,
                                                             shard_major="split")
        modules[(layer, "mlp", "down_proj")] = Projection(((m + "down_proj", d),), f, ROW)
    modules[("norm",)] = norm("model.norm.weight", d)
    if not c.tie_word_embeddings:
        modules[("lm_head",)] = Weight("lm_head.weight", (v, d), leaf="kernel", transpose=True,
                                       split=VOCAB_COLUMNS, float_only=True)
    return TensorLayout(modules, ignored_suffixes=("rotary_emb.inv_freq",),
                        tied_lm_head="lm_head.weight" if c.tie_word_embeddings else None)


LLAMA = Architecture(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    layout=decoder_layout,
    forward_module="jaxserve.models.llama",
    hf_classes={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"},
    gguf_architectures={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},   # Mistral GGUFs say "llama"
    transformers_classes={"llama": ("LlamaConfig", "LlamaForCausalLM"),
                          "mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")},
)

# -- Gemma 2 and Gemma 3 (text) ------------------------------------------------------------------

def gemma_layout(config: "ModelConfig") -> TensorLayout:
    """The Llama family's tensors plus a norm before and after each MLP; `(1 + w)` norms."""
    return decoder_layout(config, extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
                          norm_fill=0.0)


GEMMA = Architecture(
    name="gemma",
    model_types=("gemma2", "gemma3_text"),
    layout=gemma_layout,
    forward_module="jaxserve.models.gemma",
    hf_classes={"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"},
    transformers_classes={"gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                          "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")},
)

# -- mixtures of experts: Qwen3-MoE, Mixtral ------------------------------------------------------

# HF names of a MoE block's router and experts, relative to its layer: (block, gate, up, down)
_MOE_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def moe_layout(config: "ModelConfig") -> TensorLayout:
    """The Llama family's tensors (Qwen3's q/k norms for Qwen3-MoE), with each MoE layer's MLP
    replaced by its router (`gate`, [E, D], float: it decides which weights run) and its
    experts stacked: gate | up [E, D, 2F'] and down [E, F', D] (models/moe.py)."""
    base = decoder_layout(config)
    c = config
    block, gate, up, down = _MOE_NAMES[c.model_type]
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    modules = dict(base.modules)
    for i in c.moe_layers:
        layer, m = f"layers_{i}", f"model.layers.{i}.{block}."
        del modules[(layer, "mlp", "gate_up_proj")], modules[(layer, "mlp", "down_proj")]
        modules[(layer, "mlp", "gate")] = Weight(m + "gate.weight", (e, d), leaf="kernel", transpose=True,
                                                 float_only=True)
        modules[(layer, "mlp", "experts", "gate_up")] = ExpertProjection(
            ((m + "experts.{e}." + gate, f), (m + "experts.{e}." + up, f)), d, e)
        modules[(layer, "mlp", "experts", "down")] = ExpertProjection(((m + "experts.{e}." + down, d),), f, e)
    return TensorLayout(modules, ignored_suffixes=base.ignored_suffixes, tied_lm_head=base.tied_lm_head)


MOE = Architecture(
    name="moe",
    model_types=("qwen3_moe", "mixtral"),
    layout=moe_layout,
    forward_module="jaxserve.models.moe_decoder",
    hf_classes={"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"},
    # Mixtral GGUFs say "llama" (with an expert count: checkpoints/gguf_loader.py tells them apart)
    gguf_architectures={"qwen3moe": "qwen3_moe"},
    transformers_classes={"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                          "mixtral": ("MixtralConfig", "MixtralForCausalLM")},
)

# A model defined outside jaxserve (models/custom.py): its forward is handed to the engine, not
# looked up here, and it declares no checkpoint tensors (no loading, no quantization)
CUSTOM_MODEL_TYPE = "custom"


def _no_layout(config: "ModelConfig") -> TensorLayout:
    raise ValueError("a custom model (LLM(model=<module>, params=...)) declares no checkpoint tensors: "
                     "loading a checkpoint, quantization and jaxserve's tensor-parallel rules do not apply to it")


CUSTOM = Architecture(name="custom", model_types=(CUSTOM_MODEL_TYPE,), layout=_no_layout, forward_module="")

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, GEMMA, MOE, CUSTOM)


# -- lookups ----------------------------------------------------------------------------------

def model_types() -> tuple[str, ...]:
    """Every HF model_type jaxserve serves from a checkpoint (the one supported-model list)."""
    return tuple(t for arch in ARCHITECTURES if arch.forward_module for t in arch.model_types)


def for_model_type(model_type: str | None) -> Architecture:
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    raise ValueError(f"model_type={model_type!r} is not supported; jaxserve runs {model_types()}")


def for_config(config: "ModelConfig") -> Architecture:
    return for_model_type(config.model_type)


def transformers_classes(model_type: str) -> tuple[type, type]:
    """transformers' (config class, model class) of a model type: what builds a tiny random model
    of it (imports transformers)."""
    import transformers

    arch = for_model_type(model_type)
    if model_type not in arch.transformers_classes:
        raise ValueError(f"no transformers classes are declared for model_type={model_type!r}")
    config_cls, model_cls = arch.transformers_classes[model_type]
    return getattr(transformers, config_cls), getattr(transformers, model_cls)


def for_gguf(gguf_architecture: str | None) -> tuple[Architecture, str]:
    """(the row, the HF model_type) of a GGUF `general.architecture`."""
    for arch in ARCHITECTURES:
        if gguf_architecture in arch.gguf_architectures:
            return arch, arch.gguf_architectures[gguf_architecture]
    known = tuple(g for arch in ARCHITECTURES for g in arch.gguf_architectures)
    raise ValueError(f"GGUF architecture {gguf_architecture!r} is not supported; jaxserve reads {known}")
