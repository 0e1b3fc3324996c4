"""PoolingParams: how an embedding request pools its prompt's hidden states (vLLM's PoolingParams).

An embedding is the final-normed hidden states of the prompt's tokens (the model's last hidden
state, HF's `hidden_states[-1]`), pooled over the prompt: "last" takes the last token's (what a
causal model's last position has seen: the whole prompt), "mean" averages every token's. With
`normalize` (the default, as OpenAI's embeddings are) the vector is scaled to unit L2 norm.

The engine runs such a request as a generation request of one greedy token that no one sees
(`sampling_params`): the prompt is prefilled through the same scheduler and steps as generation,
chunked and batched beside it, and the request ends once the prompt is in.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.sampling_params import OutputKind, SamplingParams

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    pooling: str = "last"          # "last" | "mean"
    normalize: bool = True         # scale to unit L2 norm

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.pooling={self.pooling!r} must be one of {list(POOLING_TYPES)}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize={self.normalize!r} must be a bool")

    @property
    def output_kind(self) -> OutputKind:
        """One output, when the embedding is complete (AsyncEngine streams read this)."""
        return OutputKind.FINAL_ONLY

    def sampling_params(self) -> SamplingParams:
        """What the engine runs: the prompt, then one greedy token (every request samples one; it
        is dropped), never stopped early by EOS."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
