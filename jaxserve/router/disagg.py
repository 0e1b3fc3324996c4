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
decode engine prefills them itself. So does a request whose prefill hop fails (no serving prefill
engine, UNAVAILABLE / RESOURCE_EXHAUSTED from it, or no answer within the hop's deadline): a
prefill engine down or stopped costs latency, never an answer, unless --prefill-failure-policy is
`fail` (as a decode engine's --kv-load-failure-policy), when the client gets UNAVAILABLE instead.

The hop's deadline (prefill_deadline.py) comes from the prompt's length and the engine's measured
prefill rate, or --prefill-timeout-s, never past the client's own. An engine that misses it is
SUSPECT (replica.py): later requests skip it at once, until it answers a health check again. The
abandoned hop is cancelled on the wire; when the engine resumes it aborts the request, and a lease
it granted before it read the cancel expires after its --kv-lease-s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc import aio

from jaxserve.proto import generation_pb2 as pb
from jaxserve.router.prefill_deadline import PrefillRate

log = logging.getLogger("jaxserve.router")
FALL_BACK_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
KV_HANDED_OVER, PREFILL_UNAVAILABLE, PREFILL_TIMEOUT = "kv_handed_over", "prefill_unavailable", "prefill_timeout"


@dataclass(frozen=True, slots=True)
class PrefillHop:
    """How a prefill hop ended: the lease (outcome kv_handed_over), or why there is none."""

    remote: pb.RemoteKV | None
    outcome: str      # KV_HANDED_OVER, PREFILL_UNAVAILABLE or PREFILL_TIMEOUT: the metric's label
    detail: str = ""


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


async def run_prefill(replica, rate: PrefillRate, fwd: pb.GenerateRequest, num_tokens: int, matched: int,
                      context, *, clock: Callable[[], float] = time.monotonic) -> PrefillHop:
    """Send the prefill hop to `replica` under its deadline. UNAVAILABLE, RESOURCE_EXHAUSTED and the
    hop's own deadline give a PrefillHop without a lease; the client's deadline and other errors
    reach the client."""
    uncached = max(0, num_tokens - matched)
    ahead = replica.pending_prefill_tokens
    remaining = context.time_remaining()
    deadline = rate.deadline_s(num_tokens, ahead, remaining)
    ours = remaining is None or deadline < remaining      # else the client's deadline bounds it
    call = replica.stub.Generate(prefill_request(fwd), timeout=deadline, metadata=replica.metadata)
    lease = None
    replica.in_flight += 1
    replica.pending_prefill_tokens += uncached
    replica.routed_requests += 1
    started = clock()
    try:
        async for msg in call:
            if msg.HasField("complete") and msg.complete.HasField("kv_lease"):
                lease = msg.complete.kv_lease
    except aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and ours:
            why = f"no answer to a prefill hop of {num_tokens} tokens within its {deadline:.3g} s deadline"
            if replica.mark_suspect(why, rate.config.suspect_s):
                rate.timed_out()     # once an episode: the other hops in flight there time out too
            return PrefillHop(None, PREFILL_TIMEOUT, f"prefill engine {replica.target}: {why}")
        if e.code() in FALL_BACK_ON:
            log.info("request %s: prefill engine %s said %s", fwd.request_id, replica.target, e.code().name)
            return PrefillHop(None, PREFILL_UNAVAILABLE, f"prefill engine {replica.target}: {e.code().name} "
                                                         f"{e.details() or ''}".rstrip())
        await context.abort(e.code(), e.details() or "")
    finally:
        call.cancel()    # an abandoned hop: the engine aborts the request when it reads this
        replica.in_flight -= 1
        replica.pending_prefill_tokens -= uncached
    if lease is None:
        return PrefillHop(None, PREFILL_UNAVAILABLE, f"prefill engine {replica.target} ended the hop without a lease")
    rate.observe(uncached + ahead, clock() - started)
    # the lease names the adapter the K/V was computed under; the decode engine checks it
    return PrefillHop(pb.RemoteKV(peer=replica.target, transfer_id=lease.transfer_id, generation=lease.generation,
                                  num_tokens=lease.num_tokens, lora_name=lease.lora_name), KV_HANDED_OVER)
