"""jaxserve: an LLM inference server in JAX.

The public names are exported lazily (module __getattr__), so that `import jaxserve.sched` or
`import jaxserve.checkpoints` never pulls in jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "CustomModel": "jaxserve.models.custom",
    "EngineConfig": "jaxserve.config",
    "SamplingParams": "jaxserve.sampling_params",
    "PoolingParams": "jaxserve.pooling_params",
    "EmbeddingRequestOutput": "jaxserve.embedding_outputs",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "RequestMetrics": "jaxserve.outputs",
    "EngineStats": "jaxserve.engine.stats",
    "BeamSearchParams": "jaxserve.beam_search",
    "OutputKind": "jaxserve.sampling_params",
    "Overloaded": "jaxserve.sched.errors",
    "reference_logprobs": "jaxserve.replay",
    "LoRARequest": "jaxserve.lora.request",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
