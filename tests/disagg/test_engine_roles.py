"""The engine builder wires a prefill or decode engine's KV connector from EngineConfig's role
settings (disagg/attach.py), so an offline LLM gets the connector `jaxserve serve --role ...` gets,
and the server only passes the config along."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine_args import replace_args
from jaxserve.disagg.service import HeldLease, lease_of
from jaxserve.engine.builder import build_engine
from jaxserve.sched.kv_cache_manager import cdiv

from tests.conftest import TINY_ENGINE

LEASE_S = 7.0


@pytest.fixture(scope="module")
def prefill_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, role="prefill", kv_lease_s=LEASE_S, **TINY_ENGINE)


def _config(llm, **role):
    return replace_args(llm.config, **role)


def test_an_offline_prefill_engine_holds_a_finished_prompt_under_a_lease(prefill_llm):
    engine = prefill_llm.engine
    conn = engine.kv_connector
    assert engine.role == "prefill" and conn.sender is not None and conn.receiver is None
    assert engine.scheduler.kv_connector is conn and conn.sender.leases.lease_s == LEASE_S
    ids = list(range(3, 20))
    req = engine.input_processor.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_processed("r1", req, kv_transfer="send")
    while engine.has_unfinished_requests():
        engine.step()
    lease = lease_of(engine, "r1")
    assert lease == HeldLease("r1", lease.generation, len(ids), LEASE_S)
    assert conn.sender.leases.num_blocks_held == cdiv(len(ids), engine.scheduler.config.block_size)
    assert conn.sender.release("r1", lease.generation)        # acknowledged: every block back
    s = prefill_llm.stats()
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


def test_a_decode_engine_gets_a_receiver_with_the_configured_deadline_and_policy(prefill_llm):
    # on the prefill engine's compiled runner: only the transfer buckets compile
    engine = build_engine(_config(prefill_llm, role="decode", kv_load_timeout_s=3.0, kv_load_failure_policy="fail"),
                          share_runner_of=prefill_llm.engine)
    conn = engine.kv_connector
    try:
        assert engine.role == "decode" and conn.sender is None and conn.receiver is not None
        assert engine.scheduler.kv_connector is conn and engine.scheduler.kv_loads.failure_policy == "fail"
        assert conn.receiver.timeout_s == 3.0 and conn.receiver.lease_s == prefill_llm.config.disagg.kv_lease_s
        assert conn.receiver.local.role == "decode"
        assert conn.receiver.local.checkpoint_identity == prefill_llm.engine.checkpoint_identity
    finally:
        conn.close()


def test_a_colocated_engine_has_no_connector_and_refuses_kv_transfers(prefill_llm):
    engine = build_engine(_config(prefill_llm, role="both"), share_runner_of=prefill_llm.engine)
    assert engine.kv_connector is None and engine.scheduler.kv_connector is None and engine.role == "both"
    req = engine.input_processor.process({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="needs --role prefill"):
        engine.add_processed("r", req, kv_transfer="send")
