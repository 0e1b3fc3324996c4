"""The failure model's pieces without processes: the sender's leases (heartbeats extend, an
acknowledgement or the clock frees, generations never answer for each other), the receiver's own
deadline against a pull that never returns, the generation check on its late arrival, and the
handshake's refusal of a different block layout."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxserve.disagg.handshake import KVLayout, KVLayoutMismatch, check_compatible
from jaxserve.disagg.lease import LeaseTable
from jaxserve.disagg.receiver import KVReceiver
from jaxserve.disagg.sender import KVSender, LeaseGone
from jaxserve.disagg.transport import KVPullError
from jaxserve.runner.kv_transfer import BlockLayout, bucket_sizes
from jaxserve.sched.kv_connector import HeldBlocks, KVLoad, RemoteKV

LAYOUT = KVLayout(BlockLayout(2, 4, 1, 8, "float32"), "sha256:abc", "decode")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_leases_expire_unless_extended_and_answer_only_their_generation():
    clock = Clock()
    table = LeaseTable(10.0, clock)
    a, _ = table.grant("r1", HeldBlocks("r1", (3, 4)))
    b, _ = table.grant("r2", HeldBlocks("r2", (5,)))
    clock.t += 8
    assert table.extend("r1", a.generation)
    assert not table.extend("r1", a.generation + 1)          # another generation is not this lease
    clock.t += 3
    assert [l.transfer_id for l in table.expire()] == ["r2"]  # r1's heartbeat kept it
    assert table.get("r2", b.generation) is None and table.num_expired == 1
    assert table.num_blocks_held == 2
    # the same transfer id again (a client reused an id): a new generation replaces the old lease
    c, old = table.grant("r1", HeldBlocks("r1", (7,)))
    assert old is a and c.generation > a.generation
    assert table.release("r1", a.generation) is None        # the old generation cannot free the new blocks
    assert table.release("r1", c.generation) is c and len(table) == 0


def test_the_sender_frees_blocks_on_release_or_expiry_and_refuses_gone_leases():
    clock, freed = Clock(), []
    sender = KVSender(transfer=None, free_held=freed.append, lease_s=5.0, clock=clock)
    lease = sender.hold(HeldBlocks("r", (1, 2, 3)))
    assert sender.release("r", lease.generation) and freed == [lease.held]
    with pytest.raises(LeaseGone):
        sender.gather("r", lease.generation, 0, 3)
    second = sender.hold(HeldBlocks("s", (4,)))
    clock.t += 6
    assert sender.expire() == 1 and freed[-1] == second.held
    assert not sender.heartbeat("s", second.generation)


def test_the_sender_refuses_a_pull_for_the_kv_of_other_tokens():
    from jaxserve.disagg.sender import KVOfOtherTokens
    from jaxserve.sched.kv_connector import tokens_digest

    sender = KVSender(transfer=SimpleTransfer(), free_held=lambda h: None, lease_s=5.0, clock=Clock())
    held = HeldBlocks("r", (1, 2, 3), (), 10, tuple(range(10)))
    lease = sender.hold(held)
    assert lease.buffer is None and not lease.gathered.is_set()   # the scheduler side only grants
    sender.gather_held(held)                                       # the runner side, at the next dispatch
    assert lease.buffer.ids == (1, 2, 3) and lease.buffer.copying and lease.gathered.is_set()
    assert sender.pulled("r", lease.generation, 0, 3, 9, tokens_digest(range(9))) is lease.buffer
    assert sender.gather("r", lease.generation, 1, 2, 9, tokens_digest(range(9))).ids == (2, 3)
    with pytest.raises(KVOfOtherTokens):
        sender.pulled("r", lease.generation, 0, 3, 9, tokens_digest([0] * 9))
    with pytest.raises(KVOfOtherTokens):
        sender.pulled("r", lease.generation, 0, 3, 11, tokens_digest(range(11)))
    with pytest.raises(ValueError, match="of a lease of 3 blocks"):
        sender.pulled("r", lease.generation, 2, 2)
    sender.release("r", lease.generation)
    with pytest.raises(LeaseGone):
        sender.pulled("r", lease.generation, 0, 3)


class Gathered:
    def __init__(self, ids):
        self.ids, self.copying = tuple(ids), False

    def copy_to_host_async(self):
        self.copying = True


class SimpleTransfer:
    def gather(self, block_ids):
        return Gathered(block_ids)


def test_handshake_names_every_difference():
    other = KVLayout(BlockLayout(2, 8, 1, 8, "bfloat16"), "sha256:abc", "prefill")
    with pytest.raises(KVLayoutMismatch, match=r"block size 8 there, 4 here; KV dtype 'bfloat16' there"):
        check_compatible(LAYOUT, other, "10.0.0.1:5")
    check_compatible(LAYOUT, KVLayout(LAYOUT.block, "sha256:abc", "prefill"), "p")   # the role may differ
    with pytest.raises(KVLayoutMismatch, match="checkpoint"):
        check_compatible(LAYOUT, KVLayout(LAYOUT.block, "sha256:def", "prefill"), "p")


class FakeClient:
    """A peer whose pull hangs until `answer` is set (a stopped process), or has another layout."""

    def __init__(self, layout=LAYOUT):
        self._layout = layout
        self.answer = threading.Event()
        self.pulling = threading.Event()
        self.leases: list[tuple[str, bool]] = []

    def layout(self, peer, timeout):
        return self._layout

    def pull(self, remote, first_block, num_blocks, block, timeout, num_tokens=0, tokens_sha256=b""):
        self.pulling.set()
        if not self.answer.wait(30):
            raise KVPullError("timeout", "the test never answered")
        return np.ones((num_blocks,) + block.block_shape, block.np_dtype)

    def lease(self, remote, *, release, timeout):
        self.leases.append((remote.transfer_id, release))
        return True


def _load(gen=1):
    return KVLoad("a", gen, RemoteKV("peer:1", "a", 3, 9), 0, (5, 6), 8)


def _poll_until(receiver, pred, what):
    for _ in range(2000):
        got = receiver.poll()
        if pred(got):
            return got
        receiver.wait(0.01)
    raise AssertionError(f"gave up waiting for {what}")


def test_the_receiver_owns_its_deadline_and_drops_the_late_arrival():
    clock, client = Clock(), FakeClient()
    receiver = KVReceiver(None, LAYOUT, client, timeout_s=2.0, lease_s=600.0, clock=clock)
    try:
        receiver.start_load(_load())
        assert client.pulling.wait(30)
        assert receiver.poll() == []                     # in flight, within its deadline
        clock.t += 2.5                                   # the peer never answers: our clock decides
        (res,) = receiver.poll()
        assert not res.ok and res.reason == "timeout" and "peer:1" in res.detail
        client.answer.set()                              # the peer wakes up and answers, late
        _poll_until(receiver, lambda got: receiver.num_stale == 1, "the late arrival")
        assert receiver.bytes_received == 0              # nothing was written
        _poll_until(receiver, lambda got: ("a", True) in client.leases, "the lease released")
    finally:
        receiver.close()


class RecordingTransfer:
    def __init__(self):
        self.scattered = []

    def scatter(self, block_ids, data):
        self.scattered.append((tuple(block_ids), data.shape))


def test_the_receiver_writes_a_load_only_at_its_op_and_a_cancelled_one_never():
    """poll (the scheduler side) decides; apply_load (the runner side, at dispatch) writes; a load
    cancelled between the two is never written."""
    transfer, client = RecordingTransfer(), FakeClient()
    receiver = KVReceiver(transfer, LAYOUT, client, timeout_s=30.0, lease_s=600.0)
    try:
        client.answer.set()
        for gen in (1, 2):
            receiver.start_load(_load(gen))
            (res,) = _poll_until(receiver, bool, "the pull")
            assert res.ok and transfer.scattered == [((5, 6), (2,) + LAYOUT.block.block_shape)] * (gen - 1)
            if gen == 1:
                receiver.apply_load(_load(1))
                assert transfer.scattered == [((5, 6), (2,) + LAYOUT.block.block_shape)]
                assert receiver.bytes_received > 0
            else:
                receiver.cancel_load("a", 2)     # e.g. the scheduler found the load stale
        assert len(transfer.scattered) == 1 and not receiver._ready
    finally:
        receiver.close()


def test_a_pull_before_the_gather_waits_for_it():
    sender = KVSender(transfer=SimpleTransfer(), free_held=lambda h: None, lease_s=5.0, clock=Clock())
    held = HeldBlocks("r", (1, 2), (), 4, tuple(range(4)))
    sender.hold(held)
    waited = threading.Thread(target=sender.wait_gathered, args=("r", 30.0))
    waited.start()
    assert waited.is_alive()
    sender.gather_held(held)
    waited.join(30)
    assert not waited.is_alive()


def test_the_receiver_fails_a_load_from_an_engine_of_another_layout():
    other = KVLayout(BlockLayout(2, 16, 1, 8, "float32"), "sha256:abc", "prefill")
    receiver = KVReceiver(None, LAYOUT, FakeClient(other), timeout_s=30.0, lease_s=600.0)
    try:
        receiver.start_load(_load())
        (res,) = _poll_until(receiver, bool, "the handshake's verdict")
        assert not res.ok and res.reason == "layout" and "block size 16 there, 4 here" in res.detail
    finally:
        receiver.close()


def test_transfer_buckets_cover_every_request():
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert bucket_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert bucket_sizes(1) == (1,)


def test_an_idle_prefill_engine_still_expires_its_leases():
    """The server's reaper hops to the step thread (AsyncEngine.call) and expires what is due,
    whether or not the engine has work."""
    import asyncio
    from types import SimpleNamespace

    from jaxserve.disagg.service import reap_leases

    clock, freed = Clock(), []
    sender = KVSender(transfer=None, free_held=freed.append, lease_s=5.0, clock=clock)
    lease = sender.hold(HeldBlocks("r", (1, 2)))
    engine = SimpleNamespace(kv_connector=SimpleNamespace(sender=sender))

    class FakeAsyncEngine:
        async def call(self, fn):
            return fn(engine)

    async def main():
        task = asyncio.ensure_future(reap_leases(FakeAsyncEngine(), 0.001))
        clock.t += 6
        for _ in range(1000):
            if freed:
                break
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(main())
    assert freed == [lease.held] and sender.leases.num_expired == 1
