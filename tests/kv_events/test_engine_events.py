"""An engine publishing its KV events end to end (a tiny random Llama, ZeroMQ on local sockets): a
subscriber that joined late rebuilds the prefix cache's both tiers from the events alone, after a
workload that evicts to the host tier and loads back; outputs do not change with events on."""

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.kv_events.block_index import BlockIndex
from jaxserve.kv_events.subscriber import KVEventSubscriber

from tests.conftest import TINY_ENGINE
from tests.kv_events.cache_snapshot import cache_snapshot

WAIT_S = 120.0   # a bound for a hang, not a speed
# 40 usable device blocks of 4 tokens, a host tier behind them
ENGINE = dict(TINY_ENGINE, num_kv_blocks=41, kv_offload_gib=0.004)


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv-events")
    return f"ipc://{d}/pub", f"ipc://{d}/replay"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, endpoints):
    pub, replay = endpoints
    llm = LLM(tiny_llama_dir, **ENGINE, kv_events_config={"enable_kv_cache_events": True, "endpoint": pub,
                                                          "replay_endpoint": replay, "topic": "kv"})
    yield llm
    llm.engine.close()


def workload(llm, seed: int, n: int):
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    systems = [tok.encode(f"System {i}: " + " ".join(f"rule{i}-{j}" for j in range(30)))[:40] for i in range(6)]
    return [rng.choice(systems) + tok.encode(f" question {rng.randrange(1000)}")[:4] for _ in range(n)]


def test_a_late_subscriber_rebuilds_both_tiers_from_the_events(llm, endpoints):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for p in workload(llm, 0, 8):      # before anyone listens: the replay buffer has it
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    index = BlockIndex()
    sub = KVEventSubscriber(endpoints[0], lambda seq, batch: index.apply_batch(batch),
                            replay_endpoint=endpoints[1], topic="kv")
    try:
        for i, p in enumerate(workload(llm, 1, 24)):
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            if i == 11:
                llm.engine.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": p} for p in workload(llm, 2, 6)], params, use_tqdm=False)
        assert sub.wait_for(llm.engine.kv_events.last_seq, WAIT_S)
        cache = llm.engine.scheduler.kv.cache
        assert index.snapshot() == cache_snapshot(cache)
        assert cache.num_saved_blocks > 0 and cache.num_loaded_blocks > 0   # both tiers moved
        assert any("CPU" in b.media for b in index.blocks.values())
        assert sub.num_missed == 0
    finally:
        sub.close()


def test_outputs_are_those_of_an_engine_without_events(llm, tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in workload(llm, 3, 6)]
    plain = LLM(tiny_llama_dir, **ENGINE)
    want = [o.outputs[0].token_ids for o in plain.generate(ids, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    assert got == want
