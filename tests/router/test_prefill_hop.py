"""The prefill hop's deadline and the suspicion of a silent prefill engine, in process against fake
stubs (milliseconds): the derived deadline and what it learns; a hop past its deadline is prefilled
by the decode engine (or UNAVAILABLE by policy `fail`) and its engine skipped until it answers a
health check; the client's own deadline stays the client's. The same with real processes and
SIGSTOP: tests/disagg/test_disagg_processes.py."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from jaxserve.proto import generation_pb2 as pb
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policy import RoundRobin
from jaxserve.router.prefill_deadline import MIN_SAMPLE_TOKENS, PrefillHopConfig, PrefillRate
from jaxserve.router.prefix_index import PrefixIndex
from jaxserve.router.replica import SERVING, SUSPECT, Replica, ReplicaAddress, ReplicaClientConfig
from jaxserve.router.servicer import RouterServicer, RouterState
from tests.router.test_servicer_fakes import Aborted, FakeCall, FakeContext, FakeStub, chunk, done, rpc_error

IDS = list(range(40))


def test_the_derived_deadline_grows_with_the_prompt_and_the_work_ahead_and_is_capped_by_the_client():
    c = PrefillHopConfig(floor_s=2.0, slack=4.0, default_tokens_per_s=1000.0)
    rate = PrefillRate(c)
    assert rate.deadline_s(1000, 0, None) == pytest.approx(2.0 + 4.0)
    assert rate.deadline_s(1000, 1000, None) == pytest.approx(2.0 + 8.0)
    assert rate.deadline_s(1000, 0, 3.5) == 3.5                     # never past the client's deadline
    assert PrefillRate(PrefillHopConfig(timeout_s=7.0)).deadline_s(10 ** 6, 0, None) == 7.0   # the flag
    rate.observe(MIN_SAMPLE_TOKENS - 1, 1.0)                        # a hop's fixed cost, not a rate
    assert rate.tokens_per_s == 1000.0
    rate.observe(500, 1.0)                                          # the first measurement replaces the default
    assert rate.tokens_per_s == 500.0
    rate.observe(1000, 1.0)
    assert 500.0 < rate.tokens_per_s < 1000.0                       # then a moving mean
    before = rate.tokens_per_s
    rate.timed_out()                                                # slower than believed: twice the time
    assert rate.tokens_per_s == before / 2


@pytest.mark.parametrize("flags", [dict(timeout_s=-1), dict(failure_policy="retry"), dict(suspect_s=-1),
                                   dict(slack=0.5)])
def test_bad_prefill_hop_settings_are_refused(flags):
    with pytest.raises(ValueError):
        PrefillHopConfig(**flags)


class Silent:
    """A stopped engine's Generate: nothing comes; gRPC's deadline ends the call."""

    def __init__(self, timeout):
        self.timeout, self.cancelled = timeout, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        await asyncio.sleep(self.timeout)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        yield   # noqa: unreachable - makes this an async generator

    def cancel(self):
        self.cancelled = True


class PrefillStub:
    """Each Generate answers with the next of `calls`: a list of messages, or "silent"."""

    def __init__(self, *calls):
        self.calls, self.requests, self.timeouts = list(calls), [], []

    def Generate(self, request, timeout=None, metadata=()):
        self.requests.append(request)
        self.timeouts.append(timeout)
        what = self.calls.pop(0)
        return Silent(timeout) if what == "silent" else FakeCall(what)


class Deadline(FakeContext):
    def __init__(self, remaining_s):
        super().__init__()
        self.remaining_s = remaining_s

    def time_remaining(self):
        return self.remaining_s


def leased(rid, generation=3):
    return pb.GenerateResponse(request_id=rid, complete=pb.Complete(
        finish_reason="length", kv_lease=pb.KVLease(transfer_id=rid, generation=generation, num_tokens=len(IDS))))


def make(prefill_stub, decode_calls, **hop):
    def replica(port, stub):
        r = Replica(ReplicaAddress("127.0.0.1", port), ReplicaClientConfig(), PrefixIndex(chunk_tokens=2))
        r.stub, r.health = stub, SERVING
        return r

    p, d = replica(1, prefill_stub), replica(2, FakeStub(decode_calls))
    metrics = RouterMetrics(lambda: [d])
    s = RouterServicer(RouterState([d], [p]), RoundRobin(), None, metrics=metrics,
                       prefill_hop=PrefillHopConfig(**{"floor_s": 0.05, "suspect_s": 60.0, **hop}))
    return s, p, d, metrics


def hops(metrics, outcome):
    return metrics.prefill_hops.labels(outcome)._value.get()


async def generate(s, rid, ctx=None):
    return [m async for m in s.Generate(pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=IDS)),
                                        ctx or FakeContext())]


def test_a_handed_over_lease_goes_to_the_decode_engine_and_the_hop_teaches_the_rate():
    async def main():
        s, p, d, metrics = make(PrefillStub([chunk("a", [1]), leased("a")]), [FakeCall([chunk("a", [7]), done("a")])])
        out = await generate(s, "a")
        assert [m.WhichOneof("response") for m in out] == ["chunk", "complete"]
        assert d.stub.requests[0].kv_transfer.load.generation == 3
        assert hops(metrics, "kv_handed_over") == 1
        assert s.prefill_rates[p.target].num_samples == 1           # a 40-token hop in milliseconds
        assert p.in_flight == p.pending_prefill_tokens == 0

    asyncio.run(main())


def test_a_silent_prefill_engine_costs_one_deadline_then_is_skipped_until_it_answers():
    async def main():
        s, p, d, metrics = make(PrefillStub("silent"), [FakeCall([chunk(r, [7]), done(r)]) for r in "ab"])
        out = await generate(s, "a", Deadline(60.0))
        assert out[-1].WhichOneof("response") == "complete"
        assert p.stub.timeouts[0] < 1.0                     # the hop's own deadline, not the client's 60 s
        assert not d.stub.requests[0].kv_transfer.HasField("load")     # the decode engine prefilled it
        assert p.health == SUSPECT and hops(metrics, "prefill_timeout") == 1
        await generate(s, "b", Deadline(60.0))              # skipped at once: no second hop
        assert len(p.stub.requests) == 1 and hops(metrics, "prefill_unavailable") == 1
        assert p.in_flight == p.pending_prefill_tokens == 0
        await p.close()

    asyncio.run(main())


def test_hops_in_flight_on_an_engine_that_stops_all_time_out_and_halve_its_rate_once():
    async def main():
        s, p, d, metrics = make(PrefillStub("silent", "silent"), [FakeCall([chunk(r, [7]), done(r)]) for r in "ab"])
        await asyncio.gather(generate(s, "a", Deadline(60.0)), generate(s, "b", Deadline(60.0)))
        assert hops(metrics, "prefill_timeout") == 2 and len(p.stub.requests) == 2
        assert s.prefill_rates[p.target].tokens_per_s == PrefillHopConfig().default_tokens_per_s / 2
        assert p.in_flight == p.pending_prefill_tokens == 0
        await p.close()

    asyncio.run(main())


def test_with_policy_fail_a_missed_prefill_deadline_is_unavailable_to_the_client():
    async def main():
        s, p, d, _ = make(PrefillStub("silent"), [], failure_policy="fail")
        with pytest.raises(Aborted) as e:
            await generate(s, "a", Deadline(60.0))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "prefill_timeout" in e.value.details
        assert d.stub.requests == []
        with pytest.raises(Aborted) as e:                   # and with the engine suspect: no prefill engine
            await generate(s, "b", Deadline(60.0))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no prefill engine is serving" in e.value.details
        await p.close()

    asyncio.run(main())


def test_the_clients_own_deadline_during_the_hop_is_the_clients_and_suspects_nobody():
    async def main():
        s, p, d, _ = make(PrefillStub("silent"), [], floor_s=30.0)
        with pytest.raises(Aborted) as e:
            await generate(s, "a", Deadline(0.05))
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and p.stub.timeouts == [0.05]
        assert p.health == SERVING and d.stub.requests == []

    asyncio.run(main())


def test_a_suspect_replica_is_probed_and_back_on_its_first_answer():
    class Health:
        def __init__(self):
            self.checks = 0

        async def Check(self, request, timeout=None):
            self.checks += 1
            if self.checks < 3:          # still stopped: the Check times out
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def main():
        r = Replica(ReplicaAddress("127.0.0.1", 1), ReplicaClientConfig(retry_s=0.01), PrefixIndex(chunk_tokens=2))
        r.health = SERVING
        r.index.insert(None, [1, 2, 3, 4])
        r._health_stub = Health()
        r.mark_suspect("testing", suspect_s=0.0)
        assert r.health == SUSPECT and not r.serving
        for _ in range(200):
            if r.health == SERVING:
                break
            await asyncio.sleep(0.01)
        assert r.health == SERVING and r._health_stub.checks == 3
        assert r.index.num_tokens == 4          # a stopped process resumes with its prefix cache
        await r.close()

    asyncio.run(main())
