"""RouterServicer: the `jaxserve.v1.Generation` service of the router, forwarding to replicas.

Generate: the prompt's ids (token ids as sent; a text tokenized here once and forwarded as ids; a
chat rendered here for its key and forwarded as the chat), the policy picks a serving replica, the
request's whole chunks go into that replica's prefix index, and the replica's stream is passed
through message for message, its status codes unchanged. So a client cannot tell the router from
an engine, except by the trailing metadata `jaxserve-replica` (who served it) and
`jaxserve-prefix-match` (tokens the router expected that replica to have cached).

Failures: a replica that ends a call with UNAVAILABLE (dead, draining, warming up) or
RESOURCE_EXHAUSTED (its stream limit or waiting queue full) before any message was streamed gets
the request sent to another serving replica, each replica tried once; after a message has
streamed, the error reaches the client as it is (the tokens so far cannot be taken back).

Cancellation and deadlines: the replica call carries the client's remaining deadline, and leaving
the handler (client cancel, deadline, router shutdown) cancels the replica call, which aborts the
request on the replica and frees its blocks. Abort goes to the replica serving each id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Callable, Sequence

import grpc
from grpc import aio

from jaxserve.router import disagg
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policy import Policy
from jaxserve.router.prefill_deadline import PrefillHopConfig, PrefillRate
from jaxserve.router.replica import SUSPECT, UNREACHABLE, Replica
from jaxserve.router.tokenize import PromptTokenizer
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.router")

RETRY_BEFORE_FIRST_MESSAGE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
INFO_TIMEOUT_S = 5.0
_SUMMED = ("num_kv_blocks_total", "num_kv_blocks_free", "num_kv_blocks_cached", "num_requests_running",
           "num_requests_waiting", "num_preemptions", "num_compilations_after_warmup", "prompt_tokens_total",
           "generation_tokens_total", "num_requests_finished")



def cache_namespace(request: pb.GenerateRequest):
    """What keys a request's prefix in the replicas' caches, and so in the router's index: its cache
    salt, and its LoRA adapter when it names one (K/V under one adapter never serves another)."""
    salt = request.cache_salt if request.HasField("cache_salt") else None
    lora = request.lora_name if request.HasField("lora_name") and request.lora_name else None
    return salt if lora is None else (salt, lora)

class RouterState:
    """What the servicer, health and shutdown share."""

    def __init__(self, replicas: Sequence[Replica], prefill: Sequence[Replica] = ()):
        self.replicas = list(replicas)
        self.prefill = list(prefill)    # disaggregated serving: the prefill engines (router/disagg.py)
        self.draining = False
        self.active_streams = 0
        self.streams_changed = asyncio.Event()

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving]

    def all_replicas(self) -> list[Replica]:
        return self.replicas + self.prefill


class RouterServicer(pb_grpc.GenerationServicer):
    def __init__(self, state: RouterState, policy: Policy, tokenizer: PromptTokenizer | None, *,
                 max_concurrent_streams: int = 256, metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter, prefill_threshold_tokens: int = 0,
                 prefill_hop: PrefillHopConfig = PrefillHopConfig()):
        self.state = state
        self.policy = policy
        self.tokenizer = tokenizer
        self.max_concurrent_streams = max_concurrent_streams
        self.metrics = metrics
        self.clock = clock
        self.prefill_threshold_tokens = prefill_threshold_tokens
        self.prefill_hop = prefill_hop
        self.prefill_rates: dict[str, PrefillRate] = {}    # prefill engine target -> its learned rate
        self.live: dict[str, Replica] = {}     # request id -> the replica serving it now
        self._model_info: pb.ModelInfo | None = None

    # ---- routing ----
    def choose(self, salt: str | None, ids: list[int], exclude: set[int],
               pool: Sequence[Replica] | None = None) -> tuple[Replica | None, int]:
        """(the replica for this request, the prefix its index matched); None when none is left.
        `pool`: choose among these (the prefill engines) instead of the serving replicas."""
        pool = self.state.serving() if pool is None else [r for r in pool if r.serving]
        candidates = [r for r in pool if id(r) not in exclude]
        if not candidates:
            return None, 0
        views = [r.view(salt, ids) for r in candidates]
        chosen = candidates[self.policy.choose(views, len(ids))]
        matched = chosen.index.match(salt, ids) if ids else 0
        if ids:
            chosen.index.insert(salt, ids)
        return chosen, matched

    async def _prompt_ids(self, request: pb.GenerateRequest) -> tuple[pb.GenerateRequest, list[int]]:
        """(the request to forward, the ids to route by; empty when unknown)."""
        which = request.WhichOneof("input")
        if which == "token_ids":
            return request, list(request.token_ids.ids)
        if self.tokenizer is None or which is None:
            return request, []
        if which == "text":
            ids = await self.tokenizer.text_ids(request.text)
            if ids is None:
                return request, []
            fwd = pb.GenerateRequest()
            fwd.CopyFrom(request)
            fwd.token_ids.ids[:] = ids        # setting the oneof's other member clears text
            return fwd, ids
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return request, (await self.tokenizer.chat_ids(messages)) or []

    # ---- Generate ----
    async def Generate(self, request: pb.GenerateRequest, context):
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self.state.serving():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is serving; retry later")
        if self.state.active_streams >= self.max_concurrent_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.state.active_streams} streams are active, the limit is "
                                f"max_concurrent_streams={self.max_concurrent_streams}; retry later")
        self.state.active_streams += 1
        try:
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.state.active_streams -= 1
            self.state.streams_changed.set()

    async def _generate(self, request: pb.GenerateRequest, context):
        arrival = self.clock()
        fwd, ids = await self._prompt_ids(request)
        salt = cache_namespace(request)
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.live:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already in use")
        if fwd is request:
            fwd = pb.GenerateRequest()
            fwd.CopyFrom(request)
        fwd.request_id = request_id
        if self.state.prefill and disagg.wants_prefill_hop(fwd, ids, self.prefill_threshold_tokens):
            await self._prefill_hop(fwd, ids, salt, request_id, context)
        tried: set[int] = set()
        streamed = False
        last_error: grpc.RpcError | None = None
        try:
            while True:
                replica, matched = self.choose(salt, ids, tried)
                if replica is None:
                    if last_error is not None:
                        await context.abort(last_error.code(), last_error.details())
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is serving; retry later")
                tried.add(id(replica))
                if self.metrics is not None and ids:
                    self.metrics.prompt_tokens.inc(len(ids))
                    self.metrics.matched_tokens.inc(matched)
                context.set_trailing_metadata((("jaxserve-replica", replica.target),
                                               ("jaxserve-prefix-match", str(matched))))
                pending = max(0, len(ids) - matched)
                replica.in_flight += 1
                replica.pending_prefill_tokens += pending
                replica.routed_requests += 1
                self.live[request_id] = replica
                call = replica.stub.Generate(fwd, timeout=context.time_remaining(), metadata=replica.metadata)
                try:
                    async for response in call:
                        if not streamed:
                            streamed = True
                            replica.pending_prefill_tokens -= pending
                            pending = 0
                            if self.metrics is not None:
                                self.metrics.ttft.observe(self.clock() - arrival)
                        yield response
                    return
                except aio.AioRpcError as e:
                    if not streamed and e.code() in RETRY_BEFORE_FIRST_MESSAGE:
                        log.info("request %s: replica %s said %s before streaming; trying another",
                                 request_id, replica.target, e.code().name)
                        if self.metrics is not None:
                            self.metrics.retries.labels(e.code().name.lower()).inc()
                        last_error = e
                        continue
                    await context.abort(e.code(), e.details() or "")
                finally:
                    call.cancel()      # no-op when it ended; else the replica aborts the request
                    replica.in_flight -= 1
                    replica.pending_prefill_tokens -= pending
                    if self.live.get(request_id) is replica:
                        del self.live[request_id]
        finally:
            if self.metrics is not None:
                self.metrics.e2e.observe(self.clock() - arrival)

    async def _prefill_hop(self, fwd: pb.GenerateRequest, ids: list[int], salt: str | None, request_id: str,
                           context) -> None:
        """Disaggregated serving: the prompt's KV from a prefill engine, named in fwd.kv_transfer;
        when there is none, the decode engine prefills it, or by policy `fail` the client gets UNAVAILABLE."""
        replica, matched = self.choose(salt, ids, set(), pool=self.state.prefill)
        if replica is None:
            hop = disagg.PrefillHop(None, disagg.PREFILL_UNAVAILABLE, "no prefill engine is serving")
        else:
            rate = self.prefill_rates.setdefault(replica.target, PrefillRate(self.prefill_hop))
            self.live[request_id] = replica      # an Abort meanwhile reaches it
            try:
                hop = await disagg.run_prefill(replica, rate, fwd, len(ids), matched, context)
            finally:
                if self.live.get(request_id) is replica:
                    del self.live[request_id]
        if self.metrics is not None:
            self.metrics.prefill_hops.labels(hop.outcome).inc()
        if hop.remote is not None:
            fwd.kv_transfer.load.CopyFrom(hop.remote)
            return
        if self.prefill_hop.failure_policy == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"prefill hop failed ({hop.outcome}): {hop.detail}; --prefill-failure-policy is fail")
        log.info("request %s: %s; the decode engine prefills it", request_id, hop.detail)

    # ---- the unary calls ----
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        by_replica: dict[int, tuple[Replica, list[str]]] = {}
        for rid in request.request_ids:
            replica = self.live.get(rid)
            if replica is not None:     # unknown ids are ignored, as by an engine
                by_replica.setdefault(id(replica), (replica, []))[1].append(rid)
        for replica, ids in by_replica.values():
            try:
                await replica.stub.Abort(pb.AbortRequest(request_ids=ids), timeout=INFO_TIMEOUT_S,
                                         metadata=replica.metadata)
            except aio.AioRpcError as e:
                # a replica that is gone has aborted everything it held
                log.warning("abort on %s failed: %s %s", replica.target, e.code().name, e.details())
        return pb.AbortResponse()

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        if self._model_info is None:
            for replica in self.state.serving():
                try:
                    self._model_info = await replica.stub.GetModelInfo(
                        pb.GetModelInfoRequest(), timeout=INFO_TIMEOUT_S, metadata=replica.metadata)
                    break
                except aio.AioRpcError:
                    continue
        if self._model_info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is serving; retry later")
        return self._model_info

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        replicas = self.state.all_replicas()
        infos = await asyncio.gather(*(self._replica_info(r) for r in replicas))
        out = pb.ServerInfo(active_streams=self.state.active_streams, state=self.phase())
        weighted_hits = 0.0
        for r, info in zip(replicas, infos):
            out.replicas.append(pb.ReplicaInfo(target=r.target, health=r.health, info=info,
                                               routed_requests=r.routed_requests, in_flight=r.in_flight,
                                               indexed_tokens=r.index.num_tokens))
            for name in _SUMMED:
                setattr(out, name, getattr(out, name) + getattr(info, name))
            weighted_hits += info.prefix_hit_rate * info.prompt_tokens_total
            out.uptime_s = max(out.uptime_s, info.uptime_s)
        if out.num_kv_blocks_total:
            out.kv_usage = 1.0 - (out.num_kv_blocks_free + out.num_kv_blocks_cached) / out.num_kv_blocks_total
        if out.prompt_tokens_total:
            out.prefix_hit_rate = weighted_hits / out.prompt_tokens_total
        return out

    def phase(self) -> str:
        if self.state.draining:
            return "draining"
        return "serving" if self.state.serving() else "warming_up"

    async def _replica_info(self, replica: Replica) -> pb.ServerInfo:
        if replica.health in (UNREACHABLE, SUSPECT):     # nothing would answer: no wait for INFO_TIMEOUT_S
            return pb.ServerInfo()
        try:
            return await replica.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=INFO_TIMEOUT_S,
                                                    metadata=replica.metadata)
        except aio.AioRpcError:
            return pb.ServerInfo()
