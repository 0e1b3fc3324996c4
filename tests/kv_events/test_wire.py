"""The wire: vLLM's layout (tagged arrays, as its subscribers, llm-d and Dynamo decode them), the
sequence numbers, replay of what a late subscriber missed, and a restart seen as numbers going back."""

import msgspec
import pytest

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.kv_events import wire
from jaxserve.kv_events.block_index import BlockIndex
from jaxserve.kv_events.publisher import KVEventPublisher
from jaxserve.kv_events.subscriber import KVEventSubscriber
from jaxserve.sched import kv_events as ev

WAIT_S = 60.0   # a bound for a hang, not a speed: the events cross a local socket


def endpoints(tmp_path, name="e"):
    return f"ipc://{tmp_path}/{name}.pub", f"ipc://{tmp_path}/{name}.replay"


def stored(h, parent, tokens, medium=ev.MEDIUM_DEVICE, **kw):
    return ev.BlockStored([h], parent, list(tokens), len(tokens), medium, **kw)


def test_a_batch_is_encoded_as_vllm_lays_it_out():
    events = [ev.BlockStored([7, 8], None, [1, 2, 3, 4], 2, ev.MEDIUM_DEVICE, "math", [("tenant",), None]),
              ev.BlockRemoved([7], ev.MEDIUM_HOST), ev.AllBlocksCleared()]
    raw = msgspec.msgpack.decode(wire.encode(wire.batch(events, 1.5, data_parallel_rank=0)))
    assert raw == [1.5, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU", "math", [["tenant"], None]],
                         ["BlockRemoved", [7], "CPU"], ["AllBlocksCleared"]], 0]
    # every field has its place, set or not (an array's positions are its field names)
    raw = msgspec.msgpack.decode(wire.encode(wire.batch([stored(9, 8, [5, 6])], 2.0, data_parallel_rank=1)))
    assert raw == [2.0, [["BlockStored", [9], 8, [5, 6], 2, None, "GPU", None, None]], 1]
    back = wire.decode(wire.encode(wire.batch(events, 1.5)))
    assert [type(e).__name__ for e in back.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert back.events[0].extra_keys == [("tenant",), None]


def test_a_subscriber_gets_every_batch_in_order_and_replays_what_it_joined_too_late_for(tmp_path):
    pub_ep, replay_ep = endpoints(tmp_path)
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep, replay_endpoint=replay_ep,
                                          topic="kv"))
    try:
        pub.publish([stored(1, None, [1, 2])])
        pub.publish([stored(2, 1, [3, 4])])
        pub.publish([])                      # a step that changed nothing sends nothing
        assert pub.last_seq == 1
        seen, index = [], BlockIndex()

        def on_batch(seq, batch):
            seen.append(seq)
            index.apply_batch(batch)

        sub = KVEventSubscriber(pub_ep, on_batch, replay_endpoint=replay_ep, topic="kv")
        try:
            # the first two were sent before it subscribed: the replay brings them (at once, or when
            # the next batch shows the gap)
            for h in range(3, 30):
                pub.publish([stored(h, h - 1, [h, h])])
            pub.publish([ev.BlockRemoved([29], ev.MEDIUM_DEVICE)])
            assert sub.wait_for(pub.last_seq, WAIT_S)
            assert seen == list(range(pub.last_seq + 1)) and sub.num_missed == 0
            assert set(index.blocks) == set(range(1, 29)) and index.blocks[2].parent == 1
        finally:
            sub.close()
    finally:
        pub.close()


def test_numbers_that_go_back_mean_the_engine_restarted(tmp_path):
    pub_ep, replay_ep = endpoints(tmp_path)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep, replay_endpoint=replay_ep)
    index, restarts = BlockIndex(), []
    pub = KVEventPublisher(cfg)
    sub = KVEventSubscriber(pub_ep, lambda seq, b: index.apply_batch(b), replay_endpoint=replay_ep,
                            on_restart=lambda: (restarts.append(1), index.blocks.clear()))
    try:
        for h in range(1, 6):
            pub.publish([stored(h, None, [h, h])])
        assert sub.wait_for(4, WAIT_S) and len(index.blocks) == 5
        pub.close()
        pub = KVEventPublisher(cfg)          # a new engine process on the same endpoint: numbers from 0
        pub.publish([stored(100, None, [9, 9])])
        pub.publish([stored(101, 100, [8, 8])])
        deadline_ok = False
        for _ in range(600):                 # until the new process's batches are in (a bounded wait)
            if set(index.blocks) == {100, 101}:
                deadline_ok = True
                break
            sub.wait_for(10**9, 0.1)
        assert deadline_ok and restarts and sub.num_restarts >= 1
    finally:
        sub.close()
        pub.close()


def test_a_bad_config_is_refused_with_its_key():
    with pytest.raises(ValueError, match="unknown key"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "nats"})
    assert KVEventsConfig.parse({"endpoint": "tcp://*:5557"}) is None     # not enabled: off


def test_an_endpoint_in_use_fails_at_start():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    first = KVEventPublisher(cfg)
    try:
        with pytest.raises(ValueError, match="cannot open"):
            KVEventPublisher(cfg)
    finally:
        first.close()
