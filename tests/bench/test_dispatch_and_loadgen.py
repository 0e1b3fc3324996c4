"""Release rules shared by every timed driver, and the asyncio load generator for `bench serve`."""

import asyncio
import time

import pytest

from jaxserve.bench.dispatch import Dispatcher
from jaxserve.bench.loadgen import run_load
from jaxserve.bench.workloads import BenchRequest


def req(rid, offset=0.0, group="", after=None, n_out=3):
    return BenchRequest(rid, (5, 6, 7), n_out, arrival_offset=offset, group=group, after_group=after)


def test_requests_fall_due_at_their_offsets_and_arrive_then():
    d = Dispatcher([req("a"), req("b", 2.0)], start=100.0)
    assert [r.request_id for r in d.pop_due(100.5)] == ["a"]
    assert d.next_due() == 102.0
    assert d.pop_due(101.0) == []
    assert [r.request_id for r in d.pop_due(103.0)] == ["b"]
    assert d.sent_at == {"a": 100.0, "b": 102.0}   # due times, even though b was popped late


def test_a_concurrency_cap_holds_requests_until_a_seat_frees():
    d = Dispatcher([req("a"), req("b"), req("c")], start=0.0, max_concurrency=2)
    assert [r.request_id for r in d.pop_due(0.0)] == ["a", "b"]
    assert d.pop_due(5.0) == []
    d.finished("a", 3.0)
    assert [r.request_id for r in d.pop_due(5.0)] == ["c"]
    assert d.sent_at["c"] == 3.0   # it arrived when a's seat freed


def test_after_group_requests_wait_for_every_first_token_of_the_group():
    d = Dispatcher([req("c1", group="chat"), req("c2", group="chat"), req("L", 1.0, "long", "chat")], start=0.0)
    assert len(d.pop_due(0.0)) == 2
    assert d.next_due() is None
    d.first_token("c1", "chat", 2.0)
    assert d.next_due() is None
    d.first_token("c2", "chat", 4.0)
    assert d.next_due() == 5.0
    assert [r.request_id for r in d.pop_due(6.0)] == ["L"] and d.sent_at["L"] == 5.0


def test_an_unknown_after_group_is_an_error():
    with pytest.raises(ValueError, match="names no group"):
        Dispatcher([req("L", after="nope")], start=0.0).pop_due(1.0)


class FakeServer:
    """Streams output_len tokens, two per chunk, 1 ms apart; counts streams in flight."""

    def __init__(self):
        self.in_flight = 0
        self.peak = 0

    async def stream(self, prompt, params):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            n = params["max_tokens"]
            assert params["ignore_eos"] and params["temperature"] == 0.0
            i = 0
            while i < n:
                await asyncio.sleep(0.001)
                k = min(2, n - i)
                yield [sum(prompt) + i + j for j in range(k)], time.perf_counter()
                i += k
        finally:
            self.in_flight -= 1


def test_load_generator_records_every_token_and_respects_the_cap():
    server = FakeServer()
    reqs = [req(f"r{i}", offset=0.002 * i, n_out=5) for i in range(6)]
    records, outputs, duration = asyncio.run(run_load(server.stream, reqs, max_concurrency=2, progress=False))
    assert server.peak == 2
    assert [r.request_id for r in records] == [f"r{i}" for i in range(6)]
    assert all(r.output_len == 5 and len(r.token_times) == 5 for r in records)
    assert outputs["r0"] == [18, 19, 20, 21, 22]
    assert all(r.arrival_time <= r.first_token_time <= r.finished_time for r in records)
    assert duration > 0


def test_a_request_waiting_for_a_seat_does_not_spin_the_load_generator(monkeypatch):
    # the loop wakes on events (a first token, a finished request, a due time ahead), so its
    # iterations count events, not elapsed time: a zero-timeout wait while every seat is taken
    # made it loop once per event-loop turn for as long as the streams ran
    passes = []
    pop_due = Dispatcher.pop_due
    monkeypatch.setattr(Dispatcher, "pop_due", lambda self, now: passes.append(now) or pop_due(self, now))

    async def slow(prompt, params):
        for i in range(params["max_tokens"]):
            await asyncio.sleep(0.02)
            yield [i], time.perf_counter()

    reqs = [req(f"r{i}", n_out=5) for i in range(4)]
    records, _, _ = asyncio.run(run_load(slow, reqs, max_concurrency=1, progress=False))
    assert len(records) == 4
    assert len(passes) <= 4 * 4, f"{len(passes)} passes of the dispatch loop for 4 requests"


def test_load_generator_releases_after_group_requests():
    server = FakeServer()
    reqs = [req("c1", group="chat"), req("c2", group="chat"), req("L", 0.0, "long", "chat", n_out=1)]
    records, _, _ = asyncio.run(run_load(server.stream, reqs, progress=False))
    by = {r.request_id: r for r in records}
    assert by["L"].arrival_time >= max(by["c1"].first_token_time, by["c2"].first_token_time)


def test_a_stream_that_yields_nothing_fails_loudly():
    async def empty(prompt, params):
        return
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="streamed no tokens"):
        asyncio.run(run_load(empty, [req("a")], progress=False))
