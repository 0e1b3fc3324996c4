"""The bodies of POST /v1/embeddings (OpenAI's shapes), as pydantic models.

The request has OpenAI's fields (input, model, encoding_format, dimensions, user) plus two extras,
the gRPC Embed call's: `pooling` (last | mean, default last) and `normalize` (default true:
OpenAI's embeddings have unit length). Unknown fields are refused, as
on every route (schemas.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from jaxserve.server.http.schemas import _Request


class EmbeddingRequest(_Request):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None          # only the model's hidden size (no truncation is built)
    user: str | None = None                # accepted, unused (OpenAI's abuse-monitoring tag)
    pooling: Literal["last", "mean"] = "last"   # an extra: the last token's hidden state, or all tokens' mean
    normalize: bool = True                 # an extra: false returns the pooled vector as it is


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # the floats, or (encoding_format base64) their little-endian float32 bytes in base64
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData] = Field(default_factory=list)
    model: str
    usage: EmbeddingUsage
