"""The step features an engine's runner carries (runner/step_feature.py): the one place that
registers them. A new feature is its own module under runner/ plus a line here."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.runner.expert_counts import ExpertCounts
from jaxserve.runner.pooling import Pooling
from jaxserve.runner.prompt_logprobs import PromptLogprobs
from jaxserve.runner.step_feature import StepFeature


def step_features(config: EngineConfig, model_config: ModelConfig) -> list[StepFeature]:
    """In the order they run on a step. The KV connector's ops join when a connector is attached
    (disagg/attach.py: ModelRunner.attach_kv_connector)."""
    features: list[StepFeature] = []
    if config.model.enable_prompt_logprobs:
        features.append(PromptLogprobs())
    if config.model.enable_embeddings:
        features.append(Pooling())
    if getattr(model_config, "moe_layers", ()):
        features.append(ExpertCounts())      # every MoE step returns its routed tokens per expert
    return features
