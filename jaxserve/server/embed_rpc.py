"""The Embed RPC of `jaxserve.v1.Generation`: each input's embedding (AsyncEngine.embed), every
input queued at once so they batch in the engine's steps.

INVALID_ARGUMENT for an empty or too long input, ids outside the vocabulary, an unknown pooling or
a server without --enable-embeddings; RESOURCE_EXHAUSTED when the stream limit or the waiting
queue is full; UNAVAILABLE while warming up or draining (or when the request is aborted);
INTERNAL when the engine fails. A cancelled call cancels (and so aborts) every input.
"""

from __future__ import annotations

import grpc

from jaxserve.engine.async_engine import EmbeddingAborted, EngineDeadError, EngineStoppedError
from jaxserve.pooling_params import PoolingParams
from jaxserve.proto import generation_pb2 as pb
from jaxserve.server.embedding_batches import check_input_count, embed_windowed
from jaxserve.server.input_tokens import check_input_tokens
from jaxserve.server.state import Overloaded


def embed_prompts(request: pb.EmbedRequest) -> list[dict]:
    """The inputs as engine prompts; ValueError for none, or an empty one."""
    if not request.inputs:
        raise ValueError("inputs is empty: send at least one text or token ids")
    prompts = []
    for i, item in enumerate(request.inputs):
        which = item.WhichOneof("input")
        if which == "text" and item.text:
            prompts.append({"prompt": item.text})
        elif which == "token_ids" and item.token_ids.ids:
            prompts.append({"prompt_token_ids": list(item.token_ids.ids)})
        else:
            raise ValueError(f"inputs[{i}] is empty")
    return prompts


def pooling_params(request: pb.EmbedRequest) -> PoolingParams:
    return PoolingParams(pooling=request.pooling or "last",
                         normalize=request.normalize if request.HasField("normalize") else True)


async def embed(servicer, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
    """The servicer's Embed (servicer: its state, stream limit and engine checks)."""
    aengine = await servicer.serving_engine(context)
    state = servicer.state
    try:
        prompts = embed_prompts(request)
        params = pooling_params(request)
        check_input_count(len(prompts), servicer.limits.max_embedding_inputs)
        await check_input_tokens(aengine, prompts, servicer.limits, what="the inputs")
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if state.active_streams >= servicer.max_concurrent_streams:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{state.active_streams} streams are active, the limit is "
                            f"max_concurrent_streams={servicer.max_concurrent_streams}; retry later")
    state.active_streams += 1
    try:
        outs = await embed_windowed(aengine, prompts, params, window=servicer.limits.embedding_window,
                                    request_id=request.request_id or None, priority=request.priority)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except Overloaded as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except EngineDeadError as e:
        await context.abort(grpc.StatusCode.INTERNAL, str(e))
    except (EngineStoppedError, EmbeddingAborted) as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    finally:
        state.active_streams -= 1
        state.streams_changed.set()
    embeddings = [pb.Embedding(values=o.outputs.embedding, prompt_tokens=len(o.prompt_token_ids)) for o in outs]
    return pb.EmbedResponse(embeddings=embeddings, prompt_tokens=sum(e.prompt_tokens for e in embeddings))
