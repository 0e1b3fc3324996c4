"""The handlers behind the OpenAI-compatible routes: check the server's state and the request,
start the engine streams, and answer in one JSON body or as server-sent events.

Shared with the gRPC servicer: the server's phase and stream count (ServerState), the request
caps (RequestCaps), the chat template rendering (chat_prompt), the per-sample deltas
(sample_deltas) and the Prometheus metrics; the engine's door validates everything else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.chat_output import ChatOutputParser, ChatOutputSpec, chat_finish_reason
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineStoppedError
from jaxserve.reasoning_parsers import reasoning_parser as reasoning_parser_named
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat_prompt import render_chat
from jaxserve.server import lora_adapters
from jaxserve.server.http import errors
from jaxserve.server.http.chat_tools import assistant_message, chat_tool_plan, delta_message, joined
from jaxserve.server.http.disconnect import ClientDisconnected, unless_disconnected
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_field
from jaxserve.server.http.sampling import (chat_messages, chat_params, completion_params, completion_prompts,
                                           echo_only)
from jaxserve.server.http.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                          ChatCompletionRequest, ChatCompletionResponse,
                                          CompletionChoice, CompletionChunk, CompletionRequest,
                                          CompletionResponse, DeltaMessage, ErrorBody, ErrorResponse, ModelCard,
                                          ModelList, new_id, now)
from jaxserve.server.input_tokens import check_input_tokens
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.state import Overloaded, Phase, ServerState

log = logging.getLogger(__name__)


def engine_error(e: BaseException) -> errors.APIError | None:
    """The HTTP error of an exception the engine or its door raises; None for anything else (a bug)."""
    if isinstance(e, errors.APIError):
        return e
    if isinstance(e, ValueError):
        return errors.refused(e)
    if isinstance(e, NotImplementedError):
        return errors.not_implemented(str(e))
    if isinstance(e, Overloaded):
        return errors.too_many_requests(str(e))
    if isinstance(e, EngineDeadError):
        return errors.internal(str(e))
    if isinstance(e, EngineStoppedError):
        return errors.unavailable(str(e))
    return None


class _Choice:
    """One choice's text, tokens and logprobs as they arrive (the non-streamed answer)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.chars = 0    # characters streamed so far: text_offset of the next token


@dataclass(frozen=True, slots=True)
class _Echo:
    text: str
    token_ids: list[int]
    entries: list


class OpenAIFront:
    def __init__(self, state: ServerState, *, limits: RequestCaps, metrics: ServerMetrics | None,
                 max_concurrent_streams: int, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        """tool_call_parser: the format of the model's calls (tool_parsers; None: the model's
        default); reasoning_parser: split the answers' reasoning out (reasoning_parsers; None: no)."""
        self.state = state
        self.limits = limits
        self.metrics = metrics
        self.max_concurrent_streams = max_concurrent_streams
        # --chat-content-special-tokens: special-token text in message contents maps to control
        # tokens (off: it is text, chat_content_tokens.py)
        self.content_special_tokens = False
        if tool_call_parser is not None:
            from jaxserve.tool_parsers import tool_parser
            tool_parser(tool_call_parser)      # an unknown name fails at start-up, not per request
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser_named(reasoning_parser) if reasoning_parser is not None else None

    # -- the server's state ------------------------------------------------------------------
    def engine(self) -> AsyncEngine:
        st = self.state
        if st.phase is Phase.WARMING_UP or st.aengine is None:
            raise errors.unavailable("the server is warming up (compiling); retry later")
        if st.phase is Phase.DRAINING:
            raise errors.unavailable("the server is shutting down")
        if st.phase is Phase.FAILED or not st.aengine.healthy:
            raise errors.unavailable(f"the engine failed and accepts no requests: {st.aengine.error!r}")
        return st.aengine

    def serving(self, model: str | None) -> tuple[AsyncEngine, str]:
        """The engine and the model a request names (503 while not serving, 404 for another model)."""
        aengine = self.engine()
        return aengine, self.check_model(model, aengine)

    def model_name(self, aengine: AsyncEngine) -> str:
        return aengine.engine.model_name

    def check_model(self, model: str | None, aengine: AsyncEngine, *, adapters: bool = True) -> str:
        """The model a request names: the base model (also when it names none) or, with
        `adapters`, a LoRA adapter the server has loaded; 404 for anything else."""
        served = self.model_name(aengine)
        if model is None or model == served:
            return served
        if adapters and lora_adapters.registered(aengine.engine, model) is not None:
            return model
        raise errors.model_not_found(model, served)

    def lora_request(self, model: str | None, aengine: AsyncEngine):
        """The LoRARequest a request's `model` runs under (None: the base model); 404 when the
        adapter was unloaded since the request's model was checked."""
        try:
            return lora_adapters.adapter_for(aengine.engine, model)
        except lora_adapters.AdapterNotFound:
            raise errors.model_not_found(model, self.model_name(aengine)) from None

    async def models(self) -> ModelList:
        """The base model, then each loaded LoRA adapter (its `parent` the base model, its `root`
        the directory it was loaded from), as vLLM lists them."""
        aengine = self.engine()
        e = aengine.engine
        base = self.model_name(aengine)
        cards = [ModelCard(id=base, created=now(), max_model_len=e.max_model_len, root=base)]
        if getattr(e, "lora", None) is not None:
            loras = await aengine.list_loras()   # read on the step thread: the registry changes there
            cards += [ModelCard(id=r.lora_name, created=now(), max_model_len=e.max_model_len, root=r.lora_path,
                                parent=base) for r in loras]
        return ModelList(data=cards)

    async def model_card(self, model_id: str) -> ModelCard:
        """GET /v1/models/{id}: the base model's or a loaded adapter's card, or 404 for any other id."""
        cards = (await self.models()).data
        for card in cards:
            if card.id == model_id:
                return card
        raise errors.model_not_found(model_id, cards[0].id)

    # -- the two generation endpoints --------------------------------------------------------
    async def completions(self, req: CompletionRequest, http: Request):
        arrival = time.perf_counter()
        aengine, model = self.serving(req.model)
        params = completion_params(req, self.limits)
        prompts = completion_prompts(req)
        if len(prompts) > self.limits.max_prompts:
            raise errors.bad_request(f"prompt holds {len(prompts)} prompts; this server's limit is "
                                     f"{self.limits.max_prompts} per request (--max-prompts)", "prompt")
        return await self._answer(http, aengine, req, model, params, arrival, lambda: prompts, chat=False,
                                  prompt_field="prompt")

    async def chat_completions(self, req: ChatCompletionRequest, http: Request):
        arrival = time.perf_counter()
        aengine, model = self.serving(req.model)
        tools = chat_tool_plan(req, aengine.engine, parser=self.tool_call_parser)
        params = chat_params(req, self.limits, tools)
        messages = chat_messages(req.messages)
        spec = ChatOutputSpec(tools.parser, self.reasoning_parser)
        opens_reasoning = [False]

        async def prompts():
            prompt = await render_chat(aengine, messages, field="messages", cache_salt=req.cache_salt,
                                       template_kwargs=tools.template_kwargs,
                                       content_special_tokens=self.content_special_tokens)
            # a thinking template's generation prompt opens the reasoning; a constrained call (the
            # grammar writes the calls from the first token) never starts inside it
            if tools.structured_outputs is None:
                opens_reasoning[0] = spec.prompt_opens_reasoning(aengine.engine.tokenizer, prompt["prompt_token_ids"])
            return [prompt]
        return await self._answer(http, aengine, req, model, params, arrival, prompts, chat=True,
                                  prompt_field="messages",
                                  chat_output=(lambda: spec.new(opens_reasoning[0])) if spec.active else None)

    async def _answer(self, http: Request, aengine: AsyncEngine, req, model: str, params: SamplingParams,
                      arrival: float, prompts: Callable[[], list | Awaitable[list]], *, chat: bool,
                      prompt_field: str, chat_output: Callable[[], ChatOutputParser] | None = None):
        def streamed(run: EngineRun, close) -> StreamingResponse:
            events = self._events(run, req, model, params, chat=chat, chat_output=chat_output, close=close)
            if req.stream_options is not None and req.stream_options.continuous_usage_stats:
                events = _with_usage_so_far(events, run)
            return StreamingResponse(events, media_type="text/event-stream")

        return await self.serve_run(http, lambda: self.start_run(aengine, req, params, arrival, prompts, prompt_field),
                                    stream=req.stream, streamed=streamed,
                                    whole=lambda run: self._collect(run, req, model, params, chat=chat,
                                                                    chat_output=chat_output))

    def take_slot(self) -> None:
        """A request's place among --max-concurrent-streams (both fronts count), taken before any
        await so the limit holds under a burst; the server's drain waits for every one's release."""
        st = self.state
        if st.active_streams >= self.max_concurrent_streams:
            raise errors.too_many_requests(
                f"{st.active_streams} requests are active, the limit is "
                f"max_concurrent_streams={self.max_concurrent_streams}; retry later")
        st.active_streams += 1

    def _release(self) -> None:
        self.state.active_streams -= 1
        self.state.streams_changed.set()

    async def serve_run(self, http: Request, start: Callable[[], Awaitable[EngineRun]], *, stream: bool,
                        streamed: Callable[[EngineRun, Callable[[], Awaitable[None]]], Any],
                        whole: Callable[[EngineRun], Awaitable[Any]]):
        """One request (chat, completions, and the Responses and Messages APIs): its stream slot,
        the engine run `start()` makes, then `streamed(run, close)` (an answer whose body calls
        `close()` when it ends: the run closed, the slot released) or `whole(run)` (the run
        closed after it); None when the client left first (nobody reads an answer)."""
        self.take_slot()
        released = False
        try:
            run = await unless_disconnected(http, start())
            if stream:
                released = True

                async def close() -> None:
                    await run.close()
                    self._release()
                return streamed(run, close)
            try:
                return await unless_disconnected(http, whole(run))
            finally:
                await run.close()
        except ClientDisconnected:
            return None
        finally:
            if not released:
                self._release()

    async def start_run(self, aengine, req, params, arrival, prompts, prompt_field: str) -> EngineRun:
        """The engine run of a chat-shaped request `req` (its request_id, priority, model and the
        fields its refusals are about), after its prompts pass --max-input-tokens; the door's
        refusals as HTTP errors, a prompt's about `prompt_field`."""
        try:
            got = prompts()
            if not isinstance(got, list):
                got = await got
            try:
                await check_input_tokens(aengine, got, self.limits, what=f"the {prompt_field}")
            except ValueError as e:
                raise errors.refused(e, prompt_field) from None
            return await EngineRun.start(aengine, got, params, request_id=req.request_id or new_id("req"),
                                         priority=req.priority, metrics=self.metrics, arrival=arrival,
                                         lora_request=self.lora_request(req.model, aengine))
        except Exception as e:
            err = engine_error(e)
            if err is None:
                raise
            if err.status == 400 and err.param is None:   # the door's refusals are about the prompt
                err.param = prompt_field
            elif err.param == "structured_outputs" and req.structured_outputs is None:
                # the grammar came from OpenAI's field, or from the tools (tool_choice required / named)
                rf = req.response_format
                err.param = "tools" if getattr(req, "tools", None) and (rf is None or rf.type == "text") \
                    else "response_format"
            raise err from e

    def _token_text(self, run: EngineRun) -> TokenText:
        return TokenText.of(run.aengine.engine.tokenizer)

    async def _collect(self, run: EngineRun, req, model: str, params: SamplingParams, *, chat: bool,
                       chat_output: Callable[[], ChatOutputParser] | None = None):
        choices = [_Choice() for _ in range(len(run.prompts) * params.n)]
        try:
            async for cd in run.deltas():
                c, d = choices[cd.choice], cd.delta
                c.text.append(d.text)
                c.token_ids += d.token_ids
                if d.logprobs is not None:
                    c.logprobs += d.logprobs
                if d.finish_reason is not None:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        except Exception as e:
            err = engine_error(e)
            if err is None:
                raise
            raise err from e
        usage = run.usage()
        text_of = self._token_text(run)
        k = params.logprobs
        if chat:
            out = []
            for i, c in enumerate(choices):
                message, finish = AssistantMessage(content="".join(c.text)), c.finish_reason
                if chat_output is not None:   # tools or reasoning: the text split into its parts
                    parsed = chat_output().parse("".join(c.text))
                    message = assistant_message(parsed, reasoning_parsed=self.reasoning_parser is not None)
                    finish = chat_finish_reason(finish, bool(parsed.tool_calls))
                out.append(ChatChoice(
                    index=i, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                    logprobs=(chat_logprobs(c.token_ids, c.logprobs, k, text_of) if k is not None else None)))
            return ChatCompletionResponse(id=new_id("chatcmpl"), created=now(), model=model, usage=usage,
                                          choices=out)
        if echo_only(req):   # the one token the engine ran is not part of the answer
            usage = usage.model_copy(update={"completion_tokens": 0, "total_tokens": usage.prompt_tokens})
        out = []
        for i, c in enumerate(choices):
            p = run.prompts[i // params.n]
            ids, entries, text = (([], [], "") if echo_only(req) else (c.token_ids, c.logprobs, "".join(c.text)))
            if req.echo:
                echo = self._echo(run, p)
                ids, entries, text = echo.token_ids + ids, echo.entries + entries, echo.text + text
            out.append(CompletionChoice(
                index=i, text=text,
                logprobs=completion_logprobs(ids, entries, k, text_of, 0) if k is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_logprobs=(prompt_logprobs_field(p.prompt_logprobs, text_of)
                                 if req.prompt_logprobs is not None and p.prompt_logprobs is not None else None)))
        return CompletionResponse(id=new_id("cmpl"), created=now(), model=model, usage=usage, choices=out)

    def _echo(self, run: EngineRun, p) -> "_Echo":
        """A prompt as echo puts it before a choice's completion: its text (decoded when it came as
        token ids), its ids, and its logprob entries (None for the first token, or for all of
        them when the prompt's logprobs never came: the request ended first)."""
        out = p.last
        ids = list(out.prompt_token_ids) if out is not None else []
        text = out.prompt if out is not None and out.prompt is not None else None
        if text is None:
            tok = run.aengine.engine.tokenizer
            text = tok.decode(ids, skip_special_tokens=False) if tok is not None else ""
        entries = list(p.prompt_logprobs) if p.prompt_logprobs is not None else [None] * len(ids)
        return _Echo(text, ids, entries)

    async def _events(self, run: EngineRun, req, model: str, params: SamplingParams, *, chat: bool,
                      close: Callable[[], Awaitable[None]],
                      chat_output: Callable[[], ChatOutputParser] | None = None) -> AsyncIterator[str]:
        """The SSE body: a chunk per choice delta, then (stream_options.include_usage) one chunk
        with the usage and no choices, then `data: [DONE]`. A client that disconnects cancels this
        generator at its current await; closing the run aborts the requests."""
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        text_of = self._token_text(run)
        k = params.logprobs
        chars = [0] * (len(run.prompts) * params.n)
        started: set[int] = set()
        echoed: set[int] = set()
        parsers: dict[int, ChatOutputParser] = {}   # per choice, with tools or reasoning
        try:
            async for cd in run.deltas():
                d = cd.delta
                if chat:
                    if cd.choice not in started:   # OpenAI's first chunk of a choice carries the role
                        started.add(cd.choice)
                        yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                            ChatChunkChoice(index=cd.choice, delta=DeltaMessage(role="assistant", content=""))]))
                    lp = chat_logprobs(d.token_ids, d.logprobs, k, text_of) if d.logprobs is not None else None
                    delta, finish = DeltaMessage(content=d.text), d.finish_reason
                    if chat_output is not None:   # the text as its reasoning, content and call pieces
                        if cd.choice not in parsers:
                            parsers[cd.choice] = chat_output()
                        p = parsers[cd.choice]
                        piece = p.feed(d.text)
                        if finish is not None:
                            piece = joined(piece, p.finish())
                            finish = chat_finish_reason(finish, p.called)
                        if not piece and lp is None and finish is None:
                            continue             # held back (a tag may be arriving): nothing to say yet
                        delta = delta_message(piece)
                    yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                        ChatChunkChoice(index=cd.choice, delta=delta, logprobs=lp, finish_reason=finish)]))
                else:
                    ids, entries, text = (([], [], "") if echo_only(req) else
                                          (d.token_ids, d.logprobs or [], d.text))
                    if req.echo and cd.choice not in echoed:   # the choice's first chunk leads with the prompt
                        echoed.add(cd.choice)
                        echo = self._echo(run, run.prompts[cd.choice // params.n])
                        ids, entries, text = echo.token_ids + ids, echo.entries + entries, echo.text + text
                    lp = (completion_logprobs(ids, entries, k, text_of, chars[cd.choice])
                          if k is not None and (ids or d.logprobs is not None) else None)
                    chars[cd.choice] += len(text)
                    if not text and not ids and d.finish_reason is None:
                        continue
                    yield _sse(CompletionChunk(id=rid, created=created, model=model, choices=[
                        CompletionChoice(index=cd.choice, text=text, logprobs=lp, finish_reason=d.finish_reason,
                                         stop_reason=d.stop_reason)]))
            if include_usage:
                cls = ChatCompletionChunk if chat else CompletionChunk
                usage = run.usage()
                if not chat and echo_only(req):
                    usage = usage.model_copy(update={"completion_tokens": 0, "total_tokens": usage.prompt_tokens})
                yield _sse(cls(id=rid, created=created, model=model, choices=[], usage=usage))
        except Exception as e:   # after the 200 went out: the error is an event of its own
            err = engine_error(e)
            if err is None:
                log.exception("streaming a completion failed")
                err = errors.internal(f"{type(e).__name__}: {e}")
            yield _sse(ErrorResponse(error=ErrorBody(message=err.message, type=err.type, param=err.param,
                                                     code=err.code)))
        finally:
            await close()     # the run closed (its requests aborted if still running), the slot released
        yield "data: [DONE]\n\n"


def as_response(answer, **dump) -> Response:
    """A handler's answer: a pydantic model as JSON (`dump`: model_dump's options; None fields kept:
    the clients expect them), a streaming response as it is, nothing (the client left) as a 499
    nobody reads."""
    if answer is None:
        return Response(status_code=499)
    if isinstance(answer, Response):
        return answer
    return JSONResponse(answer.model_dump(**dump))


async def _with_usage_so_far(events: AsyncIterator[str], run: EngineRun) -> AsyncIterator[str]:
    """stream_options.continuous_usage_stats (vLLM's): every chunk with choices carries the usage
    so far. A chunk's JSON has its top-level `"usage":null` first (the field precedes `choices`;
    a text's own quotes are escaped), so that is what gets the numbers."""
    async for event in events:
        if event.startswith("data: {") and '"usage":null' in event and '"choices":[]' not in event:
            event = event.replace('"usage":null', '"usage":' + run.usage().model_dump_json(), 1)
        yield event


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"

