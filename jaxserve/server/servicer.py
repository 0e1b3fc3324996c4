"""The `jaxserve.v1.Generation` service on top of an AsyncEngine. (A prefill or decode engine's
KV transfers are another service, jaxserve/disagg/service.py, registered beside it by grpc_front.py.)

Status codes: INVALID_ARGUMENT for a bad request (the message names the field), RESOURCE_EXHAUSTED
when the concurrent-stream limit or the engine's waiting queue is full, UNAVAILABLE while warming up
or draining, INTERNAL when the engine fails. A client cancel or a passed deadline reaches the
handler as asyncio.CancelledError at its current await; leaving the engine's stream then aborts the
request, so its blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import grpc
from grpc import aio

from jaxserve.chat_output import ChatOutputSpec
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineStoppedError
from jaxserve.reasoning_parsers import reasoning_parser as reasoning_parser_named
from jaxserve.server import convert, lora_adapters
from jaxserve.server.chat_prompt import render_chat
from jaxserve.server.chat_tools_proto import CompleteSplitter, tool_plan_from_proto
from jaxserve.server.metrics import ServerMetrics
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.sample_deltas import SampleDeltas
from jaxserve.server.state import Overloaded, Phase, ServerState
from jaxserve.sched.kv_connector import KVLoadFailed, RemoteKV

log = logging.getLogger(__name__)


class GenerationServicer(pb_grpc.GenerationServicer):
    # --chat-content-special-tokens: special-token text in a chat's contents maps to control
    # tokens (off: it is text, server/chat_content_tokens.py), as on the HTTP front
    content_special_tokens: bool = False

    def __init__(self, state: ServerState, *, max_concurrent_streams: int, limits: RequestCaps,
                 metrics: ServerMetrics | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        """tool_call_parser / reasoning_parser: as the HTTP front's (a chat's tools, the split of
        its answers on their Complete messages)."""
        self.state = state
        self.max_concurrent_streams = max_concurrent_streams
        self.limits = limits
        self.metrics = metrics
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser_named(reasoning_parser) if reasoning_parser is not None else None

    async def serving_engine(self, context) -> AsyncEngine:
        """The AsyncEngine, or the call aborted with UNAVAILABLE (warming up, draining, failed): the
        gate of every call that needs the engine running, KVTransfer's too (grpc_front.py)."""
        st = self.state
        if st.phase is Phase.WARMING_UP or st.aengine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up (compiling); retry later")
        if st.phase is Phase.DRAINING:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if st.phase is Phase.FAILED or not st.aengine.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the engine failed and accepts no requests: {st.aengine.error!r}")
        return st.aengine

    async def Generate(self, request: pb.GenerateRequest, context):
        aengine = await self.serving_engine(context)
        if self.state.active_streams >= self.max_concurrent_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.state.active_streams} streams are active, the limit is "
                                f"max_concurrent_streams={self.max_concurrent_streams}; retry later")
        self.state.active_streams += 1   # before any await, so the limit holds under a burst
        try:
            # aclosing: a cancel at our yield closes the inner stream now, not at garbage collection
            async with contextlib.aclosing(self._generate(aengine, request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.state.active_streams -= 1
            self.state.streams_changed.set()

    async def _generate(self, aengine: AsyncEngine, request: pb.GenerateRequest, context):
        arrival = time.perf_counter()
        splitter = None        # a chat with tools or reasoning: its Complete messages carry the split
        try:
            params = convert.sampling_params_from_proto(request.sampling_params, self.limits)
            if request.WhichOneof("input") == "chat":
                plan = tool_plan_from_proto(request.chat, aengine.engine, parser=self.tool_call_parser)
                params = _with_tools(params, plan)
                prompt = await self._render_chat(aengine, request, plan.template_kwargs)
                spec = ChatOutputSpec(plan.parser, self.reasoning_parser)
                if spec.active:
                    opens = (plan.structured_outputs is None
                             and spec.prompt_opens_reasoning(aengine.engine.tokenizer, prompt["prompt_token_ids"]))
                    splitter = CompleteSplitter(spec, opens, params.n)
            else:
                prompt = convert.prompt_from_proto(request)
            lora_request = _lora_request(aengine, request)
        except lora_adapters.AdapterNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name {e.args[0]!r}: no LoRA adapter is loaded "
                                                           f"under that name (LoadLoRAAdapter, --lora-modules)")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except EngineStoppedError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

        last = None
        refused = False       # never ran: its latency is not a request's latency
        sent = _SentPerSample(params.n, params.prompt_logprobs, splitter)
        kv_transfer = _kv_transfer(request)
        try:
            stream = aengine.generate(prompt, params, request_id=request.request_id or None,
                                      priority=request.priority, arrival_time=arrival, lora_request=lora_request,
                                      **({"kv_transfer": kv_transfer} if kv_transfer is not None else {}))
            try:
                async for out in stream:
                    last = out
                    for response in sent.responses(out):
                        if kv_transfer == "send" and response.HasField("complete"):
                            await self._attach_lease(aengine, out.request_id, response, request.lora_name)
                        yield response
            finally:
                await stream.aclose()   # on cancel: aborts the request before the next step
        except (ValueError, NotImplementedError) as e:
            refused = True
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError) else grpc.StatusCode.UNIMPLEMENTED
            await context.abort(code, str(e))
        except Overloaded as e:
            refused = True
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except KVLoadFailed as e:   # the prompt's KV never came and the policy is "fail"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except EngineStoppedError as e:
            refused = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except (asyncio.CancelledError, aio.AbortError):
            raise
        except Exception as e:   # a bug, not the client's fault: say so, with the cause
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            if self.metrics is not None and not refused:
                # finished, aborted or cancelled: every request that ran has an end-to-end latency
                self.metrics.observe(last.metrics if last is not None else None, arrival_time=arrival,
                                     ended_at=time.perf_counter())

    async def _attach_lease(self, aengine: AsyncEngine, request_id: str, response: pb.GenerateResponse,
                            lora_name: str) -> None:
        from jaxserve.disagg.service import lease_of

        lease = await aengine.call(lambda e: lease_of(e, request_id))
        if lease is not None:     # none when the request was aborted: nothing was held
            # the adapter goes with the lease: the decode engine refuses K/V computed under another
            response.complete.kv_lease.CopyFrom(pb.KVLease(transfer_id=lease.transfer_id, generation=lease.generation,
                                                           num_tokens=lease.num_tokens, lease_s=lease.lease_s,
                                                           lora_name=lora_name))

    async def _render_chat(self, aengine: AsyncEngine, request: pb.GenerateRequest,
                           template_kwargs: dict | None = None) -> dict:
        salt = request.cache_salt if request.HasField("cache_salt") else None
        return await render_chat(aengine, convert.chat_messages(request.chat), field="chat.messages",
                                 cache_salt=salt, template_kwargs=template_kwargs,
                                 content_special_tokens=self.content_special_tokens)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        aengine = await self.serving_engine(context)
        await aengine.abort(list(request.request_ids))
        return pb.AbortResponse()

    # -- a trainer's control calls (docs/rl.md) ----------------------------------------------
    async def Pause(self, request: pb.PauseRequest, context) -> pb.PauseReply:
        aengine = await self.serving_engine(context)
        aborted = await _control(aengine.pause(request.mode or "abort"), context)
        return pb.PauseReply(aborted=aborted)

    async def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeReply:
        await _control((await self.serving_engine(context)).resume(), context)
        return pb.ResumeReply()

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsReply:
        aengine = await self.serving_engine(context)
        version = request.version if request.HasField("version") else None
        done = await _control(aengine.update_weights_from_disk(request.model_path, version=version), context)
        return pb.UpdateWeightsReply(version="" if done.version is None else str(done.version), seconds=done.seconds,
                                     num_requests_recomputed=done.num_requests_recomputed,
                                     num_prefix_blocks_flushed=done.num_prefix_blocks_flushed)

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        from jaxserve.server.embed_rpc import embed    # server/embed_rpc.py

        return await embed(self, request, context)

    # -- LoRA adapters (server/lora_adapters.py; the HTTP front's /v1/load_lora_adapter) -------
    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context) -> pb.LoadLoRAAdapterReply:
        aengine = await self.serving_engine(context)
        await _control(lora_adapters.load_adapter(aengine, request.lora_name, request.lora_path), context)
        return pb.LoadLoRAAdapterReply()

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context) -> pb.UnloadLoRAAdapterReply:
        aengine = await self.serving_engine(context)
        try:
            await _control(lora_adapters.unload_adapter(aengine, request.lora_name), context)
        except lora_adapters.AdapterNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.UnloadLoRAAdapterReply()

    async def ListLoRAAdapters(self, request: pb.ListLoRAAdaptersRequest, context) -> pb.ListLoRAAdaptersReply:
        aengine = await self.serving_engine(context)
        loras = await aengine.list_loras()
        return pb.ListLoRAAdaptersReply(adapters=[pb.LoRAAdapter(lora_name=r.lora_name, lora_path=r.lora_path,
                                                                 lora_int_id=r.lora_int_id) for r in loras])

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        aengine = self.state.aengine
        if aengine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up (loading the model)")
        e = aengine.engine   # immutable attributes: safe to read from here
        return pb.ModelInfo(model_name=e.model_name, checkpoint_identity=e.checkpoint_identity,
                            max_model_len=e.max_model_len, vocab_size=e.vocab_size,
                            eos_token_ids=sorted(e.eos_token_ids))

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        aengine = self.state.aengine
        if aengine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up (loading the model)")
        try:
            stats = await aengine.stats()
        except (EngineDeadError, EngineStoppedError):
            stats = aengine.snapshot.stats
        return convert.server_info(stats, active_streams=self.state.active_streams, state=self.state.phase.value)


async def _control(call, context):
    """Await a control call; a bad argument (ValueError, a path that does not exist) is
    INVALID_ARGUMENT, anything else propagates."""
    try:
        return await call
    except (ValueError, FileNotFoundError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def _with_tools(params, plan):
    """The params with a tool plan's constraint (required / a named function) and special-token
    setting; a constraint beside the request's own structured_outputs is refused."""
    changes = {}
    if plan.structured_outputs is not None:
        if params.structured_outputs is not None:
            raise ValueError("chat.tool_choice 'required' or a function constrains the answer to tool calls; it "
                             "cannot be combined with SamplingParams.structured_outputs")
        changes["structured_outputs"] = plan.structured_outputs
    if plan.skip_special_tokens is not None:
        changes["skip_special_tokens"] = plan.skip_special_tokens
    return dataclasses.replace(params, **changes) if changes else params


def _lora_request(aengine: AsyncEngine, request: pb.GenerateRequest):
    """The adapter a request runs under (None: the base model). A KV load must come from a prefill
    under the same adapter: K/V computed under one adapter is never served to another."""
    name = request.lora_name if request.HasField("lora_name") else None
    lora = lora_adapters.adapter_for(aengine.engine, name)
    if request.HasField("kv_transfer") and request.kv_transfer.WhichOneof("direction") == "load":
        mine = "" if lora is None else lora.lora_name
        theirs = request.kv_transfer.load.lora_name
        if theirs != mine:
            raise ValueError(f"kv_transfer.load: the prompt's K/V was computed under "
                             f"{'LoRA adapter ' + repr(theirs) if theirs else 'the base model'}, this request runs "
                             f"under {'LoRA adapter ' + repr(mine) if mine else 'the base model'}")
    return lora


def _kv_transfer(request: pb.GenerateRequest):
    """"send", a RemoteKV to load, or None (a colocated request)."""
    if not request.HasField("kv_transfer"):
        return None
    which = request.kv_transfer.WhichOneof("direction")
    if which == "send":
        return "send" if request.kv_transfer.send else None
    if which == "load":
        m = request.kv_transfer.load
        return RemoteKV(m.peer, m.transfer_id, m.generation, m.num_tokens)
    return None


class _SentPerSample:
    """Turns engine outputs into Chunk and Complete messages, one Complete per sample; the prompt
    logprobs (when asked) ride on the first chunk that follows their arrival."""

    def __init__(self, n: int, prompt_logprobs: int | None = None, splitter: CompleteSplitter | None = None):
        self._deltas = SampleDeltas(n)
        self._k = prompt_logprobs
        self._prompt: list | None = None     # prompt logprob entries not sent yet
        self._splitter = splitter

    def responses(self, out):
        if self._k is not None and out.prompt_logprobs is not None:
            self._prompt = convert.prompt_logprobs_to_proto(out, self._k)
        for d in self._deltas.deltas(out):
            if self._splitter is not None:
                self._splitter.add(d.index, d.text)
            if d.token_ids or d.text or (self._prompt is not None and d.finish_reason is not None):
                chunk = pb.Chunk(token_ids=d.token_ids, text=d.text, index=d.index)
                if self._prompt is not None:
                    chunk.prompt_logprobs.extend(self._prompt)
                    self._prompt = None
                yield pb.GenerateResponse(request_id=out.request_id, chunk=chunk)
            if d.finish_reason is not None:
                response = convert.complete_response(out, d)
                if self._splitter is not None:
                    self._splitter.fill(response.complete)
                yield response
