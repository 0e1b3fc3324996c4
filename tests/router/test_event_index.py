"""EventIndex: a replica's cache from its KV events, keyed by tokens as the router sees requests:
stores and removals in both tiers, namespaces (salt, adapter), blocks whose parent it never saw,
a clear; and the router's own record of what it sent, which counts only for a while."""

from jaxserve.kv_events import wire
from jaxserve.router.event_index import EventIndex, KVEventsSource

import pytest

BS = 4


def stored(hashes, parent, tokens, medium="GPU", salt=None, lora=None):
    extra = [(salt,)] + [None] * (len(hashes) - 1) if salt is not None else None
    return wire.BlockStored(hashes, parent, tokens, BS, medium=medium, lora_name=lora, extra_keys=extra)


def batch(*events):
    return wire.KVEventBatch(0.0, list(events))


PROMPT = list(range(10, 22))     # three blocks


def test_stored_blocks_match_until_removed_in_every_tier():
    ix = EventIndex(chunk_tokens=BS)
    assert ix.peek(None, PROMPT) == 0                      # nothing known, block size not learnt yet
    ix.apply_batch(batch(stored([1, 2, 3], None, PROMPT)))
    assert ix.cached_tokens(None, PROMPT) == 12 and ix.num_tokens == 12
    assert ix.cached_tokens(None, PROMPT[:8] + [0, 0, 0, 0]) == 8
    # the last block moves to the host tier: still cached
    ix.apply_batch(batch(wire.BlockRemoved([3], "GPU"), stored([3], 2, PROMPT[8:], medium="CPU")))
    assert ix.cached_tokens(None, PROMPT) == 12
    ix.apply_batch(batch(wire.BlockRemoved([3], "CPU")))
    assert ix.cached_tokens(None, PROMPT) == 8 and ix.num_tokens == 8
    ix.apply_batch(batch(wire.AllBlocksCleared()))
    assert ix.cached_tokens(None, PROMPT) == 0 and ix.num_tokens == 0


def test_namespaces_never_match_each_other():
    ix = EventIndex(chunk_tokens=BS)
    ix.apply_batch(batch(stored([1, 2], None, PROMPT[:8], salt="t"), stored([5, 6], None, PROMPT[:8], lora="math")))
    assert ix.cached_tokens(None, PROMPT) == 0
    assert ix.cached_tokens("t", PROMPT) == 8
    assert ix.cached_tokens((None, "math"), PROMPT) == 8 and ix.cached_tokens(("t", "math"), PROMPT) == 0


def test_an_adapter_registered_again_keeps_the_node_while_any_of_its_blocks_is_cached():
    ix = EventIndex(chunk_tokens=BS)
    ix.apply_batch(batch(stored([1], None, PROMPT[:4], lora="m"), stored([9], None, PROMPT[:4], lora="m")))
    ix.apply_batch(batch(wire.BlockRemoved([1], "GPU")))
    assert ix.cached_tokens((None, "m"), PROMPT) == 4
    ix.apply_batch(batch(wire.BlockRemoved([9], "GPU")))
    assert ix.cached_tokens((None, "m"), PROMPT) == 0


def test_a_block_whose_parent_was_never_seen_is_counted_not_placed():
    ix = EventIndex(chunk_tokens=BS)
    ix.apply_batch(batch(stored([7, 8], 99, PROMPT[4:12])))
    assert ix.num_orphans == 2 and ix.num_tokens == 0
    ix.apply_batch(batch(wire.BlockRemoved([7, 12345], "GPU")))    # unknown hashes: nothing happens
    assert ix.num_tokens == 0


def test_what_the_router_sent_counts_for_a_while_then_only_the_events_do():
    now = [0.0]
    ix = EventIndex(chunk_tokens=BS, routed_s=2.0, clock=lambda: now[0])
    ix.insert(None, PROMPT)
    assert ix.peek(None, PROMPT) == 12 and ix.cached_tokens(None, PROMPT) == 0
    now[0] = 3.0                     # one rotation: still the older generation
    assert ix.peek(None, PROMPT) == 12
    now[0] = 5.0                     # past twice routed_s: gone
    assert ix.peek(None, PROMPT) == 0
    ix.apply_batch(batch(stored([1, 2], None, PROMPT[:8])))
    assert ix.peek(None, PROMPT) == 8
    ix.clear()                       # the replica left SERVING
    assert ix.peek(None, PROMPT) == 0


def test_sources_parse_and_bad_ones_are_refused():
    assert KVEventsSource.parse("tcp://h:5557") == KVEventsSource("tcp://h:5557")
    assert KVEventsSource.parse("tcp://h:5557, tcp://h:5558").replay_endpoint == "tcp://h:5558"
    for bad in ("h:5557", "tcp://a,tcp://b,tcp://c"):
        with pytest.raises(ValueError, match="--replica-kv-events"):
            KVEventsSource.parse(bad)
    with pytest.raises(ValueError, match="routed_s"):
        EventIndex(routed_s=0)
