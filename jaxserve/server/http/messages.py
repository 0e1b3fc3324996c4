"""Anthropic's Messages API on the HTTP front:

    POST /v1/messages               create (stream=true: Anthropic's typed server-sent events)
    POST /v1/messages/count_tokens  the input tokens a create with these turns would run

A message is a chat turn: `system` and the turns become chat messages (messages_input), rendered
by the model's chat template (chat_prompt) with the tools; the request is then the chat request it
means (max_tokens, stop_sequences as stop, temperature, top_p, top_k, the tools and tool_choice),
so chat's checks, caps, tool plan (tool_choice any / tool constrain the call to the tool's
input_schema), reasoning parser (thinking blocks), stop-string hold-back, admission and departure
apply unchanged. `x-api-key` is taken beside `Authorization: Bearer`; `anthropic-version` and
`anthropic-beta` are accepted (the answer does not depend on them). Errors are Anthropic's
(messages_errors).
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.responses import StreamingResponse

from jaxserve.chat_output import ChatMessageOut, ChatOutputSpec
from jaxserve.refusals import TemplateRefused
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat_prompt import render_chat
from jaxserve.server.http import errors
from jaxserve.server.http.chat_tools import chat_tool_plan
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.messages_errors import AnthropicErrors
from jaxserve.server.http.messages_events import aborted, message_events
from jaxserve.server.http.messages_input import (chat_conversation, chat_tool_choice, chat_tools, refuse_unsupported,
                                                 thinking_template_kwargs)
from jaxserve.server.http.messages_output import content_blocks, message, stop_of
from jaxserve.server.http.messages_schemas import (CountTokensRequest, MessageObject, MessagesRequest,
                                                   MessageTokensCount, _Conversation, new_message_id)
from jaxserve.server.http.openai_front import OpenAIFront, as_response, engine_error
from jaxserve.server.http.responses_output import AnswerText, collect_answer
from jaxserve.server.http.sampling import chat_messages, chat_params
from jaxserve.server.http.schemas import ChatCompletionRequest, ChatMessage
from jaxserve.tool_parsers import ToolPlan


@dataclass(frozen=True, slots=True)
class _Chat:
    """A Messages request as the chat path takes it."""
    request: ChatCompletionRequest     # the sampling and tool fields, for chat's checks and start_run
    messages: list[dict[str, Any]]     # the template's messages
    tools: ToolPlan
    template_kwargs: dict[str, Any]    # the tools' and thinking's
    output: ChatOutputSpec             # the tool and reasoning parsers the answer goes through


class MessagesAPI:
    def __init__(self, front: OpenAIFront):
        self.front = front

    async def create(self, req: MessagesRequest, http: Request):
        arrival = time.perf_counter()
        front = self.front
        aengine, model = front.serving(req.model)
        message_id = new_message_id()
        chat = self._chat(req, aengine, request_id=message_id)
        params = _sampling(chat, front)
        opens_reasoning = [False]

        async def prompts() -> list[dict]:
            prompt = await self._render(aengine, chat)
            # as chat: a thinking template's generation prompt opens the reasoning; a constrained
            # call (the grammar writes the calls from the first token) never starts inside it
            if chat.tools.structured_outputs is None:
                opens_reasoning[0] = chat.output.prompt_opens_reasoning(aengine.engine.tokenizer,
                                                                        prompt["prompt_token_ids"])
            return [prompt]

        def parser():
            return chat.output.new(opens_reasoning[0]) if chat.output.active else None

        async def whole(run: EngineRun) -> MessageObject:
            answer = await collect_answer(run, AnswerText(None, None))
            if answer.finish_reason == "abort":
                raise aborted()
            p = parser()
            out = p.parse(answer.text) if p is not None else ChatMessageOut(answer.text)
            return message(message_id, model, content_blocks(out), run.usage(),
                           stop_of(answer.finish_reason, answer.stop_reason, bool(out.tool_calls), req.stop_sequences))

        def streamed(run: EngineRun, close) -> StreamingResponse:
            return StreamingResponse(message_events(run, message_id, model, parser=parser(),
                                                    stop_sequences=req.stop_sequences, error_of=engine_error,
                                                    close=close),
                                     media_type="text/event-stream")

        return await front.serve_run(http, lambda: front.start_run(aengine, chat.request, params, arrival, prompts,
                                                                   "messages"),
                                     stream=req.stream, streamed=streamed, whole=whole)

    async def count_tokens(self, req: CountTokensRequest) -> MessageTokensCount:
        """The prompt /v1/messages would run for these turns, tools and thinking (the same
        rendering), counted; its refusals are create's."""
        front = self.front
        aengine, _ = front.serving(req.model)
        chat = self._chat(req, aengine)
        try:
            prompt = await self._render(aengine, chat)
        except ValueError as e:
            raise errors.refused(e, "messages") from e
        return MessageTokensCount(input_tokens=len(prompt["prompt_token_ids"]))

    def _chat(self, req: _Conversation, aengine, request_id: str | None = None) -> _Chat:
        refuse_unsupported(req)
        choice, parallel = chat_tool_choice(req)
        fields: dict[str, Any] = dict(model=req.model, messages=[], tools=chat_tools(req), tool_choice=choice,
                                      parallel_tool_calls=parallel, request_id=request_id)
        if isinstance(req, MessagesRequest):
            fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream)
            fields.update({k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None})
        try:
            request = ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:   # what only chat's model checks (the fields' own types are checked)
            first = e.errors()[0]
            raise errors.bad_request(f"{'.'.join(str(x) for x in first.get('loc', ()))}: {first['msg']}") from None
        tools = chat_tool_plan(request, aengine.engine, parser=self.front.tool_call_parser)
        kwargs = dict(tools.template_kwargs, **thinking_template_kwargs(req, self.front.reasoning_parser))
        messages = chat_messages([ChatMessage.model_validate(m) for m in chat_conversation(req)])
        return _Chat(request, messages, tools, kwargs, ChatOutputSpec(tools.parser, self.front.reasoning_parser))

    async def _render(self, aengine, chat: _Chat) -> dict:
        """The chat template's prompt; what the template (or its absence) refuses carries the code
        template_refused, the others their own (a conversation too long: context_length_exceeded)."""
        try:
            return await render_chat(aengine, chat.messages, field="messages", template_kwargs=chat.template_kwargs,
                                     content_special_tokens=self.front.content_special_tokens)
        except ValueError as e:
            if getattr(e, "code", None):
                raise
            raise TemplateRefused(str(e)) from e


def _sampling(chat: _Chat, front: OpenAIFront) -> SamplingParams:
    """chat's SamplingParams; its refusals about `stop` name stop_sequences, the field sent."""
    try:
        return chat_params(chat.request, front.limits, chat.tools)
    except errors.APIError as e:
        if e.param == "stop":
            e.param = "stop_sequences"
            e.message = "stop_sequences" + e.message.removeprefix("SamplingParams.stop").removeprefix("stop")
        raise


def api_key_or_bearer(authorized, key: bytes | None):
    """Anthropic's `x-api-key: KEY` or the server's own `Authorization: Bearer KEY` (`authorized`):
    either one holding the key lets the request in."""
    def check(request: Request) -> None:
        given = request.headers.get("x-api-key")
        if key is None or given is None:
            return authorized(request)
        if hmac.compare_digest(given.encode(), key):
            return None
        if "authorization" in request.headers:
            return authorized(request)
        raise errors.unauthorized("wrong x-api-key")
    return check


def add_messages_routes(app: FastAPI, front: OpenAIFront, authorized, *, api_key: bytes | None) -> MessagesAPI:
    api = MessagesAPI(front)
    app.add_middleware(AnthropicErrors)     # outside the body limits and handlers: every error of these paths
    auth = [Depends(api_key_or_bearer(authorized, api_key))]

    @app.post("/v1/messages", dependencies=auth)
    async def create_message(req: MessagesRequest, request: Request):
        return as_response(await api.create(req, request), mode="json")

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_message_tokens(req: CountTokensRequest):
        return JSONResponse((await api.count_tokens(req)).model_dump(mode="json"))

    return api
