"""POST /v1/embeddings: OpenAI's embeddings route on the engine's pooling requests.

Each input (a string, or a list of token ids) is one engine request (AsyncEngine.embed), all of a
body's inputs queued at once, so they batch in the engine's steps beside whatever else runs. The
embedding is the prompt's last token's final hidden state (PoolingParams' "last", what a causal
model's last position has seen; the extra `pooling: "mean"` averages every token's), unit-normalized unless `normalize` is false; `encoding_format`
base64 sends each vector as its little-endian float32 bytes in base64 (what OpenAI's client asks
for by default and decodes). `dimensions` is refused unless it is the model's hidden size: a
vector cut shorter is only meaningful for models trained for it. A refusal of any input (empty,
too long, ids outside the vocabulary, embeddings not enabled) refuses the body with a 400 and
aborts the inputs already queued.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Depends
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from jaxserve.engine.async_engine import EmbeddingAborted
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.embedding_batches import check_input_count, embed_windowed
from jaxserve.server.input_tokens import check_input_tokens
from jaxserve.server.http import errors
from jaxserve.server.http.disconnect import ClientDisconnected, unless_disconnected
from jaxserve.server.http.embedding_schemas import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                                    EmbeddingUsage)
from jaxserve.server.http.openai_front import engine_error
from jaxserve.server.http.schemas import new_id


def prompts_of(req: EmbeddingRequest) -> list[dict]:
    """The body's inputs as engine prompts; an empty input is refused here (400, param input)."""
    inputs = req.input
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise errors.bad_request("input is empty: send a string, a list of strings or token ids", "input")
    prompts = []
    for i, item in enumerate(inputs):
        if not item:
            raise errors.bad_request(f"input[{i}] is empty", "input")
        prompts.append({"prompt": item} if isinstance(item, str) else {"prompt_token_ids": list(item)})
    return prompts


def check_dimensions(req: EmbeddingRequest, hidden_size: int) -> None:
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise errors.bad_request(f"dimensions={req.dimensions}: this model's embeddings have {hidden_size} "
                                 f"dimensions, and shorter ones are not built", "dimensions")


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def embeddings(front, req: EmbeddingRequest, http: Request):
    """The route's handler (front: the OpenAIFront, whose engine, state and model check it shares)."""
    arrival = time.perf_counter()
    aengine = front.engine()
    model = front.check_model(req.model, aengine, adapters=False)   # embeddings come from the base model
    if not aengine.engine.input_processor.embeddings:
        raise errors.bad_request("this server does not serve embeddings: start it with --enable-embeddings "
                                 "(--enable-embeddings)")
    check_dimensions(req, aengine.engine.runner.model_config.hidden_size)
    prompts = prompts_of(req)
    try:
        check_input_count(len(prompts), front.limits.max_embedding_inputs)
        await check_input_tokens(aengine, prompts, front.limits, what="the inputs")
    except ValueError as e:
        raise errors.refused(e, "input") from None
    params = PoolingParams(req.pooling, normalize=req.normalize)
    st = front.state
    if st.active_streams >= front.max_concurrent_streams:
        raise errors.too_many_requests(f"{st.active_streams} requests are active, the limit is "
                                       f"max_concurrent_streams={front.max_concurrent_streams}; retry later")
    st.active_streams += 1     # the server's drain waits for it, as for a completion
    try:
        rid = new_id("embd")
        outs = await unless_disconnected(http, _embed_all(aengine, prompts, params, rid, arrival,
                                                          front.limits.embedding_window))
    except ClientDisconnected:
        return None
    finally:
        st.active_streams -= 1
        st.streams_changed.set()
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return EmbeddingResponse(
        model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        data=[EmbeddingData(index=i, embedding=encode(o.outputs.embedding, req.encoding_format))
              for i, o in enumerate(outs)])


async def _embed_all(aengine, prompts: list[dict], params: PoolingParams, rid: str, arrival: float,
                     window: int) -> list:
    """Every input's embedding, in order, a window at a time (server/embedding_batches.py); the
    first failure cancels the others (aborting them)."""
    try:
        return await embed_windowed(aengine, prompts, params, window=window, request_id=rid, arrival_time=arrival)
    except EmbeddingAborted as e:
        raise errors.unavailable(str(e)) from e
    except Exception as e:
        err = engine_error(e)
        if err is None:
            raise
        if err.status == 400 and err.param is None:   # the door's refusals are about the input
            err.param = "input"
        raise err from e


def add_embeddings_route(app, front, authorized) -> None:
    """POST /v1/embeddings on the app, behind the API key as generation is."""
    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    async def create_embeddings(req: EmbeddingRequest, request: Request):
        answer = await embeddings(front, req, request)
        if answer is None:     # the client left
            return Response(status_code=499)
        return JSONResponse(answer.model_dump())
