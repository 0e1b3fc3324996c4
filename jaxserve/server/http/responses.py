"""OpenAI's Responses API on the HTTP front:

    POST   /v1/responses                  create (stream=true: typed server-sent events)
    GET    /v1/responses/{id}             a stored response
    GET    /v1/responses/{id}/input_items its input items (paged: after, limit, order)
    DELETE /v1/responses/{id}             forget a stored one
    POST   /v1/responses/{id}/cancel      refused: only background responses can be cancelled, and
                                          background=true is refused (nothing runs detached here)

A response is a chat turn: `instructions` and the input items become chat messages
(responses_input), rendered by the model's chat template (chat_prompt); the sampling fields map
onto chat's (`max_output_tokens` is max_completion_tokens, `text.format` is response_format), so
the same checks, caps and structured outputs apply; function tools take chat's tool plan
(http/chat_tools.py) and the answer goes through chat's tool and reasoning parsers
(chat_output.py) into reasoning, message and function_call items. `store` (OpenAI's default:
true) keeps the finished response in the bounded in-memory ResponseStore, which
`previous_response_id` continues.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.responses import StreamingResponse

from jaxserve.chat_output import ChatMessageOut, ChatOutputParser, ChatOutputSpec
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat_prompt import render_chat
from jaxserve.server.chat_roles import chat_roles
from jaxserve.server.http import errors
from jaxserve.server.http.chat_tools import chat_tool_plan
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.logprobs import TokenText
from jaxserve.server.http.openai_front import OpenAIFront, as_response, engine_error
from jaxserve.server.http.responses_events import response_events
from jaxserve.server.http.responses_input import (LOGPROBS_INCLUDE, as_template_roles, chat_tool_choice, chat_tools,
                                                  input_messages, listed_input_items, refuse_logprobs_of_parsed_output,
                                                  refuse_unsupported, with_instructions)
from jaxserve.server.http.responses_output import AnswerText, ResponseBuilder, as_chat_message, collect_answer
from jaxserve.server.http.responses_schemas import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from jaxserve.server.http.responses_store import ResponseStore, StoredResponse
from jaxserve.server.http.sampling import chat_messages, chat_params
from jaxserve.server.http.schemas import ChatCompletionRequest, ChatMessage
from jaxserve.tool_parsers import ToolPlan

# chat's field names in a sampling error -> the Responses request's
_CHAT_TO_RESPONSES_PARAM = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                            "response_format": "text.format", "structured_outputs": "text.format"}


def not_found(message: str, param: str | None = None) -> errors.APIError:
    return errors.APIError(404, message, type="invalid_request_error", param=param, code="not_found")


@dataclass(frozen=True, slots=True)
class _Sampling:
    params: SamplingParams
    tools: ToolPlan          # template kwargs, the constraint of required / named calls, the parser
    output: ChatOutputSpec   # the tool and reasoning parsers the answer goes through


class ResponsesAPI:
    def __init__(self, front: OpenAIFront, store: ResponseStore):
        self.front = front
        self.store = store

    # -- create ------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, http: Request):
        arrival = time.perf_counter()
        front = self.front
        aengine, model = front.serving(req.model)
        refuse_unsupported(req)
        earlier: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(f"no stored response has id {req.previous_response_id!r} (responses are kept in "
                                f"memory, the last {self.store.max_entries}, and only with store=true)",
                                "previous_response_id")
            earlier = prev.conversation
        conversation = earlier + input_messages(req)
        listed = listed_input_items(req)
        sampling = sampling_of(req, front, aengine)
        builder = ResponseBuilder(req, model)
        answer = AnswerText(sampling.params.logprobs, TokenText.of(aengine.engine.tokenizer))
        opens_reasoning = [False]

        def parser() -> ChatOutputParser | None:
            return sampling.output.new(opens_reasoning[0]) if sampling.output.active else None

        def finish(items: list, a: AnswerText, run: EngineRun) -> ResponseObject:
            final = builder.finished(items, a, run.usage())
            if req.store is not False:
                self.store.put(StoredResponse(final, conversation + [as_chat_message(items)], listed))
            return final

        async def whole(run: EngineRun) -> ResponseObject:
            await collect_answer(run, answer)
            p = parser()
            return finish(builder.items(p.parse(answer.text) if p is not None else ChatMessageOut(answer.text),
                                        answer), answer, run)

        def streamed(run: EngineRun, close) -> StreamingResponse:
            return StreamingResponse(response_events(run, builder, answer, parser=parser(),
                                                     finish=lambda items, a: finish(items, a, run),
                                                     error_of=engine_error, close=close),
                                     media_type="text/event-stream")

        return await front.serve_run(http, lambda: self._start(aengine, req, conversation, sampling, builder.id,
                                                               arrival, opens_reasoning),
                                     stream=req.stream, streamed=streamed, whole=whole)

    async def _start(self, aengine: AsyncEngine, req: ResponsesRequest, conversation: list[dict[str, Any]],
                     sampling: _Sampling, response_id: str, arrival: float, opens_reasoning: list[bool]) -> EngineRun:
        try:
            tok = aengine.engine.tokenizer
            roles = chat_roles(getattr(tok, "chat_template", None)) if tok is not None else frozenset()
            messages = chat_messages([ChatMessage.model_validate(m)
                                      for m in with_instructions(req.instructions, conversation)])
            prompt = await render_chat(aengine, as_template_roles(messages, roles), field="input",
                                       cache_salt=req.cache_salt, template_kwargs=sampling.tools.template_kwargs)
            # as chat: a thinking template's generation prompt opens the reasoning; a constrained call
            # (the grammar writes the calls from the first token) never starts inside it
            reasoning = sampling.output.reasoning_parser
            if reasoning is not None and sampling.tools.structured_outputs is None:   # a tag and its newlines
                opens_reasoning[0] = reasoning.prompt_opens_reasoning(tok.decode(prompt["prompt_token_ids"][-8:]))
            return await EngineRun.start(aengine, [prompt], sampling.params, request_id=req.request_id or response_id,
                                         priority=req.priority, metrics=self.front.metrics, arrival=arrival,
                                         lora_request=self.front.lora_request(req.model, aengine))
        except Exception as e:
            err = engine_error(e)
            if err is None:
                raise
            if err.status == 400 and err.param is None:   # the door's refusals are about the prompt
                err.param = "input"
            elif err.param in _CHAT_TO_RESPONSES_PARAM:
                err.param = _CHAT_TO_RESPONSES_PARAM[err.param]
            raise err from e

    # -- stored responses --------------------------------------------------------------------
    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(f"no stored response has id {response_id!r}", "response_id")
        return entry.response

    def input_items(self, response_id: str, *, after: str | None, limit: int, order: str) -> InputItemList:
        """A stored response's own input items (not those of the responses it continues), newest
        first by default, as OpenAI pages them."""
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(f"no stored response has id {response_id!r}", "response_id")
        if not 1 <= limit <= 100:
            raise errors.bad_request(f"limit={limit} must be in [1, 100]", "limit")
        if order not in ("asc", "desc"):
            raise errors.bad_request(f"order={order!r} must be 'asc' or 'desc'", "order")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise not_found(f"after={after!r} is not an input item of {response_id!r}", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise not_found(f"no stored response has id {response_id!r}", "response_id")
        return DeletedResponse(id=response_id)

    def cancel(self, response_id: str) -> ResponseObject:
        self.retrieve(response_id)   # 404 for an unknown one, as OpenAI answers
        # 409: the request is well formed; the response's state is what refuses it
        raise errors.APIError(409, "only background responses can be cancelled, and this server runs none "
                                   "(background=true is refused); a response streaming or in flight ends when its "
                                   "client disconnects", type="invalid_request_error", param="response_id",
                              code="not_cancellable")


def sampling_of(req: ResponsesRequest, front: OpenAIFront, aengine: AsyncEngine) -> _Sampling:
    """The Responses sampling and tool fields as the chat request they mean, through chat's
    checks, caps and tool plan (the same template kwargs, constraint and parser as chat's)."""
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
    fields = dict(
        messages=[], max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
        ignore_eos=req.ignore_eos, response_format=response_format, logprobs=logprobs,
        top_logprobs=req.top_logprobs, tools=chat_tools(req), tool_choice=chat_tool_choice(req.tool_choice))
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:   # what only chat's model checks (the fields' own types are checked)
        first = e.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())[:1]) or None
        raise errors.bad_request(f"{param}: {first['msg']}", _CHAT_TO_RESPONSES_PARAM.get(param, param)) from None
    try:
        tools = chat_tool_plan(chat, aengine.engine, parser=front.tool_call_parser)
        output = ChatOutputSpec(tools.parser, front.reasoning_parser)
        if output.active:
            refuse_logprobs_of_parsed_output(req)
        return _Sampling(chat_params(chat, front.limits, tools), tools, output)
    except errors.APIError as e:
        e.param = _CHAT_TO_RESPONSES_PARAM.get(e.param, e.param)
        raise


def add_responses_routes(app: FastAPI, front: OpenAIFront, authorized, store: ResponseStore) -> ResponsesAPI:
    api = ResponsesAPI(front, store)

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create_response(req: ResponsesRequest, request: Request):
        return as_response(await api.create(req, request), mode="json", by_alias=True)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def retrieve_response(response_id: str, stream: bool = False):
        if stream:
            raise errors.bad_request("replaying a stored response's events (stream=true) is not supported; "
                                     "GET it without stream", "stream")
        return JSONResponse(api.retrieve(response_id).model_dump(mode="json", by_alias=True))

    @app.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(authorized)])
    async def list_input_items(response_id: str, after: str | None = None, limit: int = 20, order: str = "desc",
                               include: list[str] | None = Query(default=None)):
        if include:
            raise errors.bad_request(f"include={include!r} is not supported on input_items (input items have "
                                     "nothing more to include)", "include")
        return JSONResponse(api.input_items(response_id, after=after, limit=limit, order=order).model_dump(mode="json"))

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str):
        return JSONResponse(api.delete(response_id).model_dump(mode="json"))

    @app.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(authorized)])
    async def cancel_response(response_id: str):
        return JSONResponse(api.cancel(response_id).model_dump(mode="json"))

    return api
