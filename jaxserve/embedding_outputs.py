"""What an embedding request returns: EmbeddingRequestOutput, EmbeddingOutput (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.outputs import RequestMetrics


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]         # hidden_size floats (float32 values)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True          # an embedding is returned once, complete
    metrics: RequestMetrics | None = None
