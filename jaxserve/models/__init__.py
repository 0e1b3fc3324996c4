"""The models jaxserve serves: one registry row per architecture (registry.py), their forwards
(llama.py: Llama, SmolLM2, Mistral, Qwen2, Qwen3; gemma.py: Gemma 2, Gemma 3 text), and `Linear`,
the one place a projection's matmul is written (linear.py).

Exports are lazy (module `__getattr__`), so importing `jaxserve.models.config` alone, as the
host-side loaders do, does not import jax or flax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Params": "jaxserve.models.llama",
    "LlamaModel": "jaxserve.models.llama",
    "forward": "jaxserve.models.llama",
    "compute_logits": "jaxserve.models.llama",
    "dense_causal_attention": "jaxserve.models.attention",
    "abstract_params": "jaxserve.models.params",
    "params_from_hf": "jaxserve.models.params",
    "init_random_params": "jaxserve.models.params",
    "ModelConfig": "jaxserve.models.config",
    "LayerAttention": "jaxserve.models.config",
    "Linear": "jaxserve.models.linear",
    "RopeScaling": "jaxserve.models.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
