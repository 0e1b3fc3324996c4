"""ModelConfig: the architecture of a Llama-family model, read from a Hugging Face config dict.

Checkpoint loaders (GGUF, HF directory, converted) all produce an HF-style `config.json` dict;
this is the one place that turns it into the fields the model and the runner use. No jax here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; jaxserve runs {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ValueError("config has no 'model_type'")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        scaling = _rope_scaling(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window") if model_type == "mistral" else None
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        return cls(
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
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
