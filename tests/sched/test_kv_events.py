"""KV events from the prefix cache: a consumer that applies them in order holds exactly the cache's
tree, in both tiers, after random workloads with evictions, host-tier moves, aborts, tenants,
adapters and resets; hashes are cumulative and namespaced; a prefill's blocks are one event."""

import random

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.kv_events.block_index import BlockIndex
from tests.kv_events.cache_snapshot import cache_snapshot
from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.kv_events import (MEDIUM_DEVICE, MEDIUM_HOST, AllBlocksCleared, BlockRemoved, BlockStored,
                                      block_hash)

BS = 4


def engine_snapshot(sched: Scheduler) -> dict:
    return cache_snapshot(sched.kv.cache)


def config(**kw) -> SchedulerConfig:
    kw.setdefault("num_blocks", 1 + 24)
    kw.setdefault("num_host_blocks", 16)
    kw.setdefault("enable_kv_offload", True)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_num_seqs", 4)
    return SchedulerConfig(block_size=BS, kv_events=True, **kw)


def random_requests(rng: random.Random, n: int, max_model_len: int) -> list:
    """Prompts over a few shared prefixes (so hits, evictions and host-tier returns all happen),
    under a few tenants and adapters."""
    prefixes = [[rng.randrange(3, 60) for _ in range(rng.choice([4, 8, 12, 16]))] for _ in range(12)]
    reqs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 12))])
        prompt = prompt[: max_model_len - 9]
        lora = rng.choice([None, None, None, "math"])
        reqs.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 8), ignore_eos=rng.random() < 0.5,
                                 cache_salt=rng.choice([None, None, "tenant"]),
                                 lora_name=lora, lora_key=f"{lora}#1" if lora else None))
    return reqs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "one-step-ahead"])
def test_the_index_rebuilt_from_events_equals_the_cache_after_every_step(seed, one_step_ahead):
    rng = random.Random(seed)
    cfg = config(preemption_mode=rng.choice(["recompute", "swap", "auto"]))
    sched = Scheduler(cfg)
    reqs = random_requests(rng, 250, cfg.max_model_len)   # 1,000 over the four seeds
    index = BlockIndex()
    arrivals: dict[int, list] = {}
    for r in reqs:
        arrivals.setdefault(rng.randrange(0, 400), []).append(r)
    aborts = {rng.randrange(0, 400): f"r{rng.randrange(len(reqs))}" for _ in range(10)}
    resets = 0

    def on_step(step, out):
        nonlocal resets
        if step in aborts:
            sched.abort_requests([aborts[step]])
        if step % 97 == 96 and not sched.kv.pool.num_in_use and sched.reset_prefix_cache():
            resets += 1
        for event in sched.kv.take_events():
            index.apply(event)
        assert index.snapshot() == engine_snapshot(sched)

    drive(sched, arrivals=arrivals, on_step=on_step, one_step_ahead=one_step_ahead)
    for event in sched.kv.take_events():
        index.apply(event)
    assert index.snapshot() == engine_snapshot(sched)
    # the workload exercised what the events must follow
    cache = sched.kv.cache
    assert cache.num_evictions > 0 and cache.num_saved_blocks > 0 and cache.num_loaded_blocks > 0
    assert cache.num_host_evictions > 0
    assert len(index.blocks) > 0


def test_a_prefill_is_one_chain_and_an_eviction_moves_it_between_media():
    sched = Scheduler(config(num_blocks=1 + 4, num_host_blocks=8, max_num_seqs=1))
    a = make_request("a", 12, max_tokens=1)            # 3 full prompt blocks
    drive(sched, [a])
    (stored,) = sched.kv.take_events()
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_DEVICE
    assert stored.parent_block_hash is None and len(stored.block_hashes) == 3
    assert stored.token_ids == a.prompt_token_ids[:12] and stored.block_size == BS
    # the hashes are cumulative: each covers its parent's
    h = [block_hash(0, None, tuple(a.prompt_token_ids[:4]), first=True)]
    for j in (1, 2):
        h.append(block_hash(h[-1], None, tuple(a.prompt_token_ids[4 * j:4 * j + 4]), first=False))
    assert stored.block_hashes == h
    # another prompt needs the device blocks: a's blocks leave the device for the host
    drive(sched, [make_request("b", 16, max_tokens=1)])
    events = sched.kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_DEVICE]
    to_host = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_HOST]
    assert {x for e in removed for x in e.block_hashes} >= set(h[1:])
    assert {x for e in to_host for x in e.block_hashes} >= set(h[1:])
    assert sched.reset_prefix_cache()
    assert [type(e) for e in sched.kv.take_events()] == [AllBlocksCleared]


def test_the_same_tokens_under_another_salt_or_adapter_hash_differently():
    tokens = tuple(range(3, 3 + BS))
    plain = block_hash(0, None, tokens, first=True)
    assert plain == block_hash(0, None, tokens, first=True)            # stable
    assert plain != block_hash(0, "tenant", tokens, first=True)
    sched = Scheduler(config())
    reqs = [make_request("x", list(tokens) * 2, max_tokens=1),
            make_request("y", list(tokens) * 2, max_tokens=1, cache_salt="t"),
            make_request("z", list(tokens) * 2, max_tokens=1, lora_name="math", lora_key="math#1")]
    drive(sched, reqs)
    assert_outputs_match_reference(reqs, sched.config.max_model_len)
    # the chains' first blocks: one per namespace
    events = [e for e in sched.kv.take_events() if isinstance(e, BlockStored) and e.parent_block_hash is None]
    assert len(events) == 3 and len({e.block_hashes[0] for e in events}) == 3
    by_salt = {(e.extra_keys[0] if e.extra_keys else None, e.lora_name) for e in events}
    assert by_salt == {(None, None), (("t",), None), (None, "math")}


def test_without_the_flag_nothing_is_recorded_or_hashed():
    sched = Scheduler(SchedulerConfig(block_size=BS, num_blocks=1 + 8, max_model_len=32))
    drive(sched, [make_request("a", 12, max_tokens=2)], runner=FakeRunner(9, BS))
    assert sched.kv.cache.events is None and sched.kv.take_events() == []
    assert all(n.hash == 0 for n in sched.kv.cache.all_nodes())
