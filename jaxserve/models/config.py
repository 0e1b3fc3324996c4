"""ModelConfig: the architecture of a model (the Llama family, Gemma 2, Gemma 3 text), read from
a Hugging Face config dict; per-layer attention (window, scale, soft cap) through `layer_attention`.

Checkpoint loaders (GGUF, HF directory, converted) all produce an HF-style `config.json` dict;
this is the one place that turns it into the fields the model and the runner use. No jax here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from jaxserve.models import registry


# values of HF's per-layer `layer_types`
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# MLP gate activations (HF `hidden_act` / `hidden_activation` names) the models implement
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention computes beyond q, k, v: softmax(soft_cap(scale * q k^T)) over
    the causal keys, the last `sliding_window` of them (the query's own included) when set.
    soft_cap: s -> soft_cap * tanh(s / soft_cap), applied before masking; None: no cap."""

    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False          # Qwen2: bias on q, k, v projections
    qk_norm: bool = False                 # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None     # Mistral
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # --- Gemma 2 / Gemma 3 (the defaults are the Llama family's) ---
    # per layer, "sliding_attention" (sees the last `sliding_window` keys) or "full_attention";
    # None: every layer is alike and uses `sliding_window` as it is (None there: all global).
    # Read per layer through `layer_attention(i)`, never `sliding_window` alone.
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None   # attention scale is this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None      # Gemma 2: cap * tanh(s / cap) on attention scores
    final_logit_softcap: float | None = None     # Gemma 2: the same on the final logits
    rope_local_theta: float | None = None        # Gemma 3: RoPE base of the sliding layers
    # HF "linear" RoPE scaling (frequencies / factor) of the layers on `rope_theta` (Gemma 3:
    # the full-attention layers; the sliding layers' RoPE is never scaled)
    rope_linear_factor: float | None = None
    hidden_activation: str = "silu"              # the MLP's gate activation (HF name)
    # --- mixture of experts (Qwen3-MoE, Mixtral; 0 / () elsewhere) ---
    num_experts: int = 0                         # experts per MoE layer
    num_experts_per_tok: int = 0                 # top-k
    moe_intermediate_size: int = 0               # each expert's F (Mixtral: intermediate_size)
    norm_topk_prob: bool = False                 # the k routing weights renormalized to sum 1
    moe_layers: tuple[int, ...] = ()             # the layers whose MLP is the MoE block

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def __post_init__(self) -> None:
        registry.for_model_type(self.model_type)     # refuses a model type no architecture serves
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            unknown = sorted(set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION})
            if unknown:
                raise ValueError(f"layer_types {unknown} are not {SLIDING_ATTENTION!r} or {FULL_ATTENTION!r}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")
        if self.moe_layers:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"a MoE model needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                                 f"num_experts ({self.num_experts}) and moe_intermediate_size > 0 "
                                 f"({self.moe_intermediate_size})")
            if not all(0 <= i < self.num_hidden_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {self.moe_layers} are not all in [0, {self.num_hidden_layers})")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation={self.hidden_activation!r} is not one of {ACTIVATIONS}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
                     "rope_local_theta", "rope_linear_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be positive (or None)")

    def layer_type(self, layer: int) -> str:
        """"sliding_attention" or "full_attention" (HF's names) for layer `layer`."""
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer {layer} is not in [0, {self.num_hidden_layers})")
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s attention scale, window and score soft cap. The Llama family:
        (head_dim ** -0.5, sliding_window, None) for every layer."""
        sliding = self.layer_type(layer) == SLIDING_ATTENTION
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return LayerAttention(sm_scale=scalar ** -0.5,
                              sliding_window=self.sliding_window if sliding else None,
                              soft_cap=self.attn_logit_softcap)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ValueError("config has no 'model_type'")
        if model_type == "gemma3":
            raise ValueError("model_type='gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); "
                             "jaxserve runs text-only Gemma 3 checkpoints (model_type 'gemma3_text')")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        gemma = registry.for_model_type(model_type) is registry.GEMMA
        scaling = None if gemma else _rope_scaling(cfg)     # Gemma's RoPE: _gemma_fields
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if gemma:
            fields.update(_gemma_fields(model_type, cfg))
        if model_type in ("qwen3_moe", "mixtral"):
            fields.update(_moe_fields(model_type, cfg))
        return cls(**fields)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields as HF's configs define them. Mixtral: every layer sparse, experts of
    intermediate_size, top-k always renormalized. Qwen3-MoE: layer i sparse unless listed in
    mlp_only_layers, and only when (i + 1) % decoder_sparse_step == 0 (the others a dense MLP of
    intermediate_size); experts of moe_intermediate_size; norm_topk_prob as configured."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    layers = cfg["num_hidden_layers"]
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"{model_type}: shared experts are not supported")
    if model_type == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    moe_layers=tuple(range(layers)) if experts else ())
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
                moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=sparse)


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def _gemma_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 2 / Gemma 3 text config dict (HF's defaults where a key
    is absent, as Gemma2Config / Gemma3TextConfig fill them in)."""
    gemma3 = model_type == "gemma3_text"
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention (an embedding model) is not supported")
    layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:      # older configs: Gemma 2 alternates, Gemma 3 has 5 local : 1 global
        pattern = cfg.get("sliding_window_pattern", 6) if gemma3 else 2
        layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    theta, local_theta, linear_factor = _gemma_rope(model_type, cfg)
    return dict(
        sliding_window=cfg.get("sliding_window", 4096),
        layer_types=tuple(layer_types),
        qk_norm=gemma3,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072 if gemma3 else 8192),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        # HF's Gemma 3 attention never passes its attn_logit_softcapping on: no cap there
        attn_logit_softcap=None if gemma3 else _optional_float(cfg.get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping", None if gemma3 else 30.0)),
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_linear_factor=linear_factor,
        hidden_activation=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma_rope(model_type: str, cfg: dict[str, Any]) -> tuple[float, float | None, float | None]:
    """(rope_theta, rope_local_theta, rope_linear_factor) from either config form: transformers 5's
    `rope_parameters` (Gemma 3: one dict per layer type) or the older rope_theta /
    rope_local_base_freq / rope_scaling keys."""
    params = cfg.get("rope_parameters") or {}
    if model_type == "gemma2":
        rope = params or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta") or 10000.0}
        return float(rope.get("rope_theta", 10000.0)), None, _linear_factor(model_type, rope)
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full, local = params.get(FULL_ATTENTION) or {}, params.get(SLIDING_ATTENTION) or {}
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta") or 1_000_000.0}
        local = {"rope_theta": cfg.get("rope_local_base_freq") or 10000.0}
    if _linear_factor(model_type, local) is not None:
        raise ValueError(f"{model_type}: RoPE scaling of the sliding layers is not supported")
    return (float(full.get("rope_theta", 1_000_000.0)), float(local.get("rope_theta", 10000.0)),
            _linear_factor(model_type, full))


def _linear_factor(model_type: str, rope: dict[str, Any]) -> float | None:
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if kind != "linear":
        raise ValueError(f"{model_type}: rope scaling type {kind!r} is not supported (only 'linear')")
    return float(rope["factor"])
