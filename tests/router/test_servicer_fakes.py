"""RouterServicer against fake replica stubs, in process and in milliseconds: RESOURCE_EXHAUSTED
and UNAVAILABLE before the first message go to another replica; after a message they reach the
client; a client that leaves cancels the replica call; Abort goes to the replica serving the id;
the load counters return to zero however a call ends."""

import asyncio

import grpc
import pytest
from grpc import aio

from jaxserve.router.policy import RoundRobin
from jaxserve.router.prefix_index import PrefixIndex
from jaxserve.router.replica import SERVING, Replica, ReplicaAddress, ReplicaClientConfig
from jaxserve.router.servicer import RouterServicer, RouterState
from jaxserve.proto import generation_pb2 as pb


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(code, details)
        self.code, self.details = code, details


class FakeContext:
    def __init__(self):
        self.trailers = ()

    async def abort(self, code, details=""):
        raise Aborted(code, details)

    def set_trailing_metadata(self, md):
        self.trailers = md

    def time_remaining(self):
        return None


def rpc_error(code, details="x"):
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


class FakeCall:
    """An async iterator of messages, then optionally an error; records cancel()."""

    def __init__(self, messages, error=None, hang=False):
        self.messages, self.error, self.hang, self.cancelled = list(messages), error, hang, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for m in self.messages:
            yield m
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeStub:
    def __init__(self, calls):
        self.calls, self.requests, self.aborted = list(calls), [], []

    def Generate(self, request, timeout=None, metadata=()):
        self.requests.append(request)
        return self.calls.pop(0)

    async def Abort(self, request, timeout=None, metadata=()):
        self.aborted.extend(request.request_ids)
        return pb.AbortResponse()


def chunk(rid, ids):
    return pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(token_ids=ids))


def done(rid):
    return pb.GenerateResponse(request_id=rid, complete=pb.Complete(finish_reason="length"))


def make(*call_lists):
    replicas = []
    for i, calls in enumerate(call_lists):
        r = Replica(ReplicaAddress("127.0.0.1", 1 + i), ReplicaClientConfig(), PrefixIndex(chunk_tokens=2))
        r.stub = FakeStub(calls)
        r.health = SERVING
        replicas.append(r)
    return RouterServicer(RouterState(replicas), RoundRobin(), None), replicas


async def collect(servicer, request, ctx=None):
    ctx = ctx or FakeContext()
    out = []
    async for m in servicer.Generate(request, ctx):
        out.append(m)
    return out, ctx


def req(rid="r", ids=(1, 2, 3, 4)):
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=list(ids)))


def assert_counters_zero(servicer, replicas):
    assert all(r.in_flight == 0 and r.pending_prefill_tokens == 0 for r in replicas)
    assert servicer.live == {} and servicer.state.active_streams == 0


def test_a_full_replica_sends_the_request_to_another_before_the_client_sees_an_error():
    async def main():
        s, (a, b) = make([FakeCall([], rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED))],
                         [FakeCall([chunk("r", [5]), done("r")])])
        out, ctx = await collect(s, req())
        assert [m.WhichOneof("response") for m in out] == ["chunk", "complete"]
        assert dict(ctx.trailers)["jaxserve-replica"] == b.target
        assert a.routed_requests == b.routed_requests == 1
        assert a.stub.requests[0].request_id == b.stub.requests[0].request_id == "r"
        assert_counters_zero(s, [a, b])

    asyncio.run(main())


def test_when_every_replica_refuses_the_client_gets_the_last_refusal():
    async def main():
        s, reps = make([FakeCall([], rpc_error(grpc.StatusCode.UNAVAILABLE, "draining"))],
                       [FakeCall([], rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))])
        with pytest.raises(Aborted) as e:
            await collect(s, req())
        assert (e.value.code, e.value.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        assert_counters_zero(s, reps)

    asyncio.run(main())


def test_an_error_after_a_streamed_message_is_not_retried():
    async def main():
        s, (a, b) = make([FakeCall([chunk("r", [5])], rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"))], [])
        ctx = FakeContext()
        got = []
        with pytest.raises(Aborted) as e:
            async for m in s.Generate(req(), ctx):
                got.append(m)
        assert len(got) == 1 and e.value.code == grpc.StatusCode.UNAVAILABLE and b.routed_requests == 0
        assert_counters_zero(s, [a, b])

    asyncio.run(main())


def test_other_errors_pass_through_unchanged_without_retry():
    async def main():
        s, (a, b) = make([FakeCall([], rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "top_p=1.5 ..."))], [])
        with pytest.raises(Aborted) as e:
            await collect(s, req())
        assert (e.value.code, e.value.details) == (grpc.StatusCode.INVALID_ARGUMENT, "top_p=1.5 ...")
        assert b.routed_requests == 0

    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_replica_call_and_abort_finds_the_replica():
    async def main():
        call = FakeCall([chunk("r", [5])], hang=True)
        s, (a,) = make([call])
        gen = s.Generate(req("r"), FakeContext())
        first = await gen.__anext__()
        assert first.chunk.token_ids == [5] and a.in_flight == 1 and s.live == {"r": a}
        await s.Abort(pb.AbortRequest(request_ids=["r", "unknown"]), FakeContext())
        assert a.stub.aborted == ["r"]
        await gen.aclose()                      # the client cancelled
        assert call.cancelled
        assert_counters_zero(s, [a])

    asyncio.run(main())


def test_no_serving_replica_is_unavailable_and_a_live_id_is_refused():
    async def main():
        s, (a,) = make([FakeCall([chunk("r", [5])], hang=True)])
        gen = s.Generate(req("r"), FakeContext())
        await gen.__anext__()
        with pytest.raises(Aborted) as e:
            await collect(s, req("r"))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in e.value.details
        await gen.aclose()
        a.health = "NOT_SERVING"
        with pytest.raises(Aborted) as e:
            await collect(s, req("r2"))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_pending_prefill_counts_the_uncached_part_until_the_first_message():
    async def main():
        silent = FakeCall([], hang=True)
        s, (a,) = make([silent])
        a.index.insert(None, [1, 2, 3, 4])     # the index believes 4 tokens are cached there
        gen = s.Generate(req("r", ids=[1, 2, 3, 4, 9, 9, 9, 9]), FakeContext())
        task = asyncio.ensure_future(gen.__anext__())
        for _ in range(10):
            await asyncio.sleep(0)
        assert (a.pending_prefill_tokens, a.in_flight) == (4, 1)      # 8 tokens, 4 matched
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()
        assert silent.cancelled
        assert_counters_zero(s, [a])

    asyncio.run(main())
