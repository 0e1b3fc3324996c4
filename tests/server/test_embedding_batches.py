"""server/embedding_batches.py on a fake engine: an embeddings body's inputs enter the engine at
most `window` at a time and come back in input order; the first failure cancels those in flight
and queues none after it; the input cap is refused by name."""

import asyncio

import pytest

from jaxserve.server.embedding_batches import check_input_count, embed_windowed
from jaxserve.server.request_caps import RequestCaps


class FakeAsyncEngine:
    """embed() waits for the test to release its input; records how many run at once."""

    def __init__(self, fail_at=None):
        self.running = 0
        self.most = 0
        self.started = []
        self.cancelled = []
        self.fail_at = fail_at

    async def embed(self, prompt, params, *, request_id=None, priority=0, arrival_time=None):
        i = prompt["i"]
        self.started.append(i)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            for _ in range(1 + (7 * i) % 5):      # inputs finish out of order
                await asyncio.sleep(0)
            if i == self.fail_at:
                raise ValueError(f"input {i} refused")
            return f"out-{i}"
        except asyncio.CancelledError:
            self.cancelled.append(i)
            raise
        finally:
            self.running -= 1


def run(engine, n, window):
    return asyncio.run(embed_windowed(engine, [{"i": i} for i in range(n)], None, window=window, request_id="r"))


@pytest.mark.parametrize("n, window", [(1, 4), (10, 1), (37, 4), (64, 16)])
def test_at_most_a_window_runs_and_outputs_keep_input_order(n, window):
    engine = FakeAsyncEngine()
    assert run(engine, n, window) == [f"out-{i}" for i in range(n)]
    assert engine.most == min(n, window) and sorted(engine.started) == list(range(n))


def test_the_first_failure_cancels_the_window_and_starts_nothing_after():
    engine = FakeAsyncEngine(fail_at=5)
    with pytest.raises(ValueError, match="input 5 refused"):
        run(engine, 40, 4)
    assert max(engine.started) < 5 + 4 + 1          # nothing far past the failure was queued
    assert engine.running == 0 and engine.cancelled  # the ones in flight were cancelled


def test_the_cap_and_the_window_settings():
    check_input_count(4096, 4096)
    with pytest.raises(ValueError, match=r"4097 inputs; this server's limit is 4096 .*--max-embedding-inputs"):
        check_input_count(4097, 4096)
    assert RequestCaps().embedding_window == 2 and RequestCaps().max_embedding_inputs == 4096
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="embedding_window"):
            RequestCaps(embedding_window=bad)
