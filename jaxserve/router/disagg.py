"""Disaggregated prefill and decode behind the router (`--prefill HOST:PORT ... --decode HOST:PORT`).

A request whose prompt has at least `--prefill-threshold-tokens` tokens goes first to a prefill
engine (chosen by the routing policy over the prefill engines' prefix indexes, so their prefix
caches pay), as the same request with max_tokens=1 and `kv_transfer.send`: the engine computes
the prompt's KV, samples one token (thrown away here) and holds the KV under a lease, which its
Complete names. The request then goes to a decode engine with `kv_transfer.load` naming that
lease: the decode engine pulls the blocks into its own, computes the prompt's last token (so the
first token, and every one after, is sampled there exactly as a colocated engine samples it) and
streams the answer, which is all the client sees.

Shorter prompts, n > 1, and prompts the router could not tokenize skip the prefill side: the
decode engine prefills them itself. So does a request whose prefill engine is unavailable (no
serving prefill engine, or UNAVAILABLE / RESOURCE_EXHAUSTED from it): a prefill engine down costs
latency, never an answer.
"""

from __future__ import annotations

import logging

import grpc
from grpc import aio

from jaxserve.server.proto import generation_pb2 as pb

log = logging.getLogger("jaxserve.router")
SKIP_PREFILL_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)


def wants_prefill_hop(fwd: pb.GenerateRequest, ids: list[int], threshold: int) -> bool:
    n = fwd.sampling_params.n if fwd.sampling_params.HasField("n") else 1
    # prompt logprobs come from the rows that compute the prompt: such a request stays on one engine
    if fwd.sampling_params.HasField("prompt_logprobs"):
        return False
    return bool(ids) and len(ids) >= max(1, threshold) and n == 1 and fwd.WhichOneof("input") == "token_ids"


def prefill_request(fwd: pb.GenerateRequest) -> pb.GenerateRequest:
    """The request as the prefill engine gets it: one output token, its KV held for a receiver."""
    req = pb.GenerateRequest()
    req.CopyFrom(fwd)
    sp = req.sampling_params
    sp.max_tokens = 1
    sp.ClearField("min_tokens")
    del sp.stop[:]
    sp.ClearField("structured_outputs")
    req.kv_transfer.send = True
    return req


async def run_prefill(servicer, replica, fwd: pb.GenerateRequest, context) -> pb.RemoteKV | None:
    """Send the prefill hop to `replica`; the lease as a RemoteKV, or None when the prefill side
    is unavailable (the decode engine prefills instead). Other errors reach the client."""
    call = replica.stub.Generate(prefill_request(fwd), timeout=context.time_remaining(), metadata=replica.metadata)
    lease = None
    replica.in_flight += 1
    replica.routed_requests += 1
    try:
        async for msg in call:
            if msg.HasField("complete") and msg.complete.HasField("kv_lease"):
                lease = msg.complete.kv_lease
    except aio.AioRpcError as e:
        if e.code() in SKIP_PREFILL_ON:
            log.info("request %s: prefill engine %s said %s; the decode engine prefills it",
                     fwd.request_id, replica.target, e.code().name)
            return None
        await context.abort(e.code(), e.details() or "")
    finally:
        call.cancel()
        replica.in_flight -= 1
    if lease is None:
        return None
    return pb.RemoteKV(peer=replica.target, transfer_id=lease.transfer_id, generation=lease.generation,
                       num_tokens=lease.num_tokens)
