"""OpenAI's Responses API on the HTTP front:

    POST   /v1/responses                  create (stream=true: typed server-sent events)
    GET    /v1/responses/{id}             a stored response
    DELETE /v1/responses/{id}             forget a stored one
    POST   /v1/responses/{id}/cancel      refused: only background responses can be cancelled, and
                                          background=true is refused (nothing runs detached here)

A response is a chat turn: `instructions` and the input items become chat messages
(responses_input), rendered by the model's chat template (chat_prompt); the sampling fields map
onto chat's (`max_output_tokens` is max_completion_tokens, `text.format` is response_format), so
the same checks, caps and structured outputs apply. `store` (OpenAI's default: true) keeps the
finished response in the bounded in-memory ResponseStore, which `previous_response_id` continues.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat_prompt import render_chat
from jaxserve.server.chat_roles import chat_roles
from jaxserve.server.http import errors
from jaxserve.server.http.disconnect import ClientDisconnected, unless_disconnected
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.logprobs import TokenText
from jaxserve.server.http.openai_front import OpenAIFront, engine_error
from jaxserve.server.http.responses_events import response_events
from jaxserve.server.http.responses_input import (LOGPROBS_INCLUDE, as_template_roles, input_messages,
                                                  refuse_unsupported, with_instructions)
from jaxserve.server.http.responses_output import AnswerText, ResponseBuilder, item_status
from jaxserve.server.http.responses_schemas import DeletedResponse, ResponseObject, ResponsesRequest
from jaxserve.server.http.responses_store import ResponseStore, StoredResponse
from jaxserve.server.http.sampling import chat_params
from jaxserve.server.http.schemas import ChatCompletionRequest

# chat's field names in a sampling error -> the Responses request's
_CHAT_TO_RESPONSES_PARAM = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                            "response_format": "text.format", "structured_outputs": "text.format"}

TOOLS_SUPPORTED = False   # function tools wait for the chat tool-calling pieces (see docs/server.md)


def not_found(message: str, param: str | None = None) -> errors.APIError:
    return errors.APIError(404, message, type="invalid_request_error", param=param, code="not_found")


class ResponsesAPI:
    def __init__(self, front: OpenAIFront, store: ResponseStore):
        self.front = front
        self.store = store

    # -- create ------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, http: Request):
        arrival = time.perf_counter()
        front = self.front
        aengine = front.engine()
        model = front.check_model(req.model, aengine)
        refuse_unsupported(req, tools_supported=TOOLS_SUPPORTED)
        earlier: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(f"no stored response has id {req.previous_response_id!r} (responses are kept in "
                                f"memory, the last {self.store.max_entries}, and only with store=true)",
                                "previous_response_id")
            earlier = prev.conversation
        conversation = earlier + input_messages(req, tools_supported=TOOLS_SUPPORTED)
        params = sampling_params(req, front)
        builder = ResponseBuilder(req, model)
        answer = AnswerText(params.logprobs, TokenText(aengine.engine.tokenizer))

        def finish(a: AnswerText, run: EngineRun) -> ResponseObject:
            message = builder.message(a, status=item_status(a))
            final = builder.finished([message], a, run.usage())
            if req.store is not False:
                self.store.put(StoredResponse(final, conversation + [{"role": "assistant", "content": a.text}]))
            return final

        self._take_slot()
        released = False
        try:
            run = await unless_disconnected(http, self._start(aengine, req, conversation, params, builder.id, arrival))
            if req.stream:
                released = True   # the event stream's close releases it

                async def close():
                    await run.close()
                    self._release()
                return StreamingResponse(response_events(run, builder, answer, finish=lambda a: finish(a, run),
                                                         error_of=engine_error, close=close),
                                         media_type="text/event-stream")
            try:
                await unless_disconnected(http, self._collect(run, answer))
            finally:
                await run.close()
            return finish(answer, run)
        except ClientDisconnected:
            return None
        finally:
            if not released:
                self._release()

    async def _start(self, aengine: AsyncEngine, req: ResponsesRequest, conversation: list[dict[str, Any]],
                     params: SamplingParams, response_id: str, arrival: float) -> EngineRun:
        try:
            tok = aengine.engine.tokenizer
            roles = chat_roles(getattr(tok, "chat_template", None)) if tok is not None else frozenset()
            messages = as_template_roles(with_instructions(req.instructions, conversation), roles)
            prompt = await render_chat(aengine, messages, field="input", cache_salt=req.cache_salt)
            return await EngineRun.start(aengine, [prompt], params, request_id=req.request_id or response_id,
                                         priority=req.priority, metrics=self.front.metrics, arrival=arrival)
        except Exception as e:
            err = engine_error(e)
            if err is None:
                raise
            if err.status == 400 and err.param is None:   # the door's refusals are about the prompt
                err.param = "input"
            elif err.param in _CHAT_TO_RESPONSES_PARAM:
                err.param = _CHAT_TO_RESPONSES_PARAM[err.param]
            raise err from e

    async def _collect(self, run: EngineRun, answer: AnswerText) -> None:
        try:
            async for cd in run.deltas():
                answer.add(cd.delta)
        except Exception as e:
            err = engine_error(e)
            if err is None:
                raise
            raise err from e

    # the front's stream count, as its completions take it: before any await, so a burst cannot
    # overshoot the limit; the server's drain waits for it to reach zero
    def _take_slot(self) -> None:
        st, limit = self.front.state, self.front.max_concurrent_streams
        if st.active_streams >= limit:
            raise errors.too_many_requests(f"{st.active_streams} requests are active, the limit is "
                                           f"max_concurrent_streams={limit}; retry later")
        st.active_streams += 1

    def _release(self) -> None:
        self.front.state.active_streams -= 1
        self.front.state.streams_changed.set()

    # -- stored responses --------------------------------------------------------------------
    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(f"no stored response has id {response_id!r}", "response_id")
        return entry.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise not_found(f"no stored response has id {response_id!r}", "response_id")
        return DeletedResponse(id=response_id)

    def cancel(self, response_id: str) -> ResponseObject:
        self.retrieve(response_id)   # 404 for an unknown one, as OpenAI answers
        raise errors.bad_request("only background responses can be cancelled, and this server runs none "
                                 "(background=true is refused); a response streaming or in flight ends when its "
                                 "client disconnects", "response_id")


def sampling_params(req: ResponsesRequest, front: OpenAIFront) -> SamplingParams:
    """The Responses sampling fields as the chat request they mean, through chat's checks and caps."""
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise errors.bad_request("text.format.schema is required for type json_schema", "text.format.schema")
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            response_format["json_schema"] = {"name": fmt.name, "description": fmt.description,
                                              "schema": fmt.schema_, "strict": fmt.strict}
    elif fmt is not None and any(v is not None for v in (fmt.name, fmt.schema_, fmt.strict, fmt.description)):
        raise errors.bad_request("text.format of type text takes no name, schema, strict or description",
                                 "text.format")
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    chat = ChatCompletionRequest.model_validate(dict(
        messages=[], max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
        ignore_eos=req.ignore_eos, response_format=response_format, logprobs=logprobs,
        top_logprobs=req.top_logprobs))
    try:
        return chat_params(chat, front.limits)
    except errors.APIError as e:
        e.param = _CHAT_TO_RESPONSES_PARAM.get(e.param, e.param)
        raise


def add_responses_routes(app: FastAPI, front: OpenAIFront, authorized, store: ResponseStore) -> ResponsesAPI:
    api = ResponsesAPI(front, store)

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create_response(req: ResponsesRequest, request: Request):
        answer = await api.create(req, request)
        if answer is None:
            return Response(status_code=499)   # the client left; nobody reads this
        if isinstance(answer, Response):
            return answer
        return JSONResponse(answer.model_dump(mode="json", by_alias=True))

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def retrieve_response(response_id: str, stream: bool = False):
        if stream:
            raise errors.bad_request("replaying a stored response's events (stream=true) is not supported; "
                                     "GET it without stream", "stream")
        return JSONResponse(api.retrieve(response_id).model_dump(mode="json", by_alias=True))

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str):
        return JSONResponse(api.delete(response_id).model_dump(mode="json"))

    @app.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(authorized)])
    async def cancel_response(response_id: str):
        return JSONResponse(api.cancel(response_id).model_dump(mode="json"))

    return api
