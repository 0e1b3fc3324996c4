"""The check of a checkpoint's tensors against what its config calls for, by HF name and shape.

Every loader (GGUF, HF directory, converted) ends here, so a checkpoint that reaches the model has
exactly the tensors the model will read, each with the shape the config implies. What a config
calls for is its architecture's declaration in the model registry (jaxserve/models/registry.py).
A mismatch is caught with a message naming the tensor, instead of as a broadcasting error deep
inside jit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.tensor_layout import TensorLayout

from .errors import ConfigMismatchError, MissingTensorError, UnsupportedArchitectureError


def check_model_type(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type not in registry.model_types():
        raise UnsupportedArchitectureError(
            f"model_type={model_type!r} is not supported; jaxserve runs {registry.model_types()}")
    return model_type


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape ([out, in] for linear weights) of every tensor the config calls for."""
    return tensor_layout(config).hf_shapes()


def tensor_layout(config: Mapping[str, Any]) -> TensorLayout:
    """The registry's declaration of the tensors an HF config dict calls for."""
    check_model_type(config)
    if config.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias=True (biases on the MLP projections) is not supported")
    try:
        model_config = ModelConfig.from_hf_config(dict(config))
    except KeyError as e:
        raise ConfigMismatchError(f"config has no {e.args[0]!r}") from None
    except ValueError as e:
        raise ConfigMismatchError(str(e)) from None
    return registry.for_config(model_config).layout(model_config)


def check_tensors(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` without ignorable buffers, after checking names and shapes against `config`.

    A tied model may still carry an `lm_head.weight` (some exporters write it); it is dropped when
    its shape fits, since the model reads the embedding in its place.
    """
    layout = tensor_layout(config)
    want = layout.hf_shapes()
    # buffers some older HF checkpoints saved alongside the weights are recomputed from the config
    kept = {name: t for name, t in tensors.items() if not name.endswith(layout.ignored_suffixes)}
    if layout.tied_lm_head is not None and layout.tied_lm_head in kept:
        lm_head = kept.pop(layout.tied_lm_head)
        if tuple(lm_head.shape) != want["model.embed_tokens.weight"]:
            raise ConfigMismatchError(
                f"{layout.tied_lm_head} has shape {tuple(lm_head.shape)}, the config implies "
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
