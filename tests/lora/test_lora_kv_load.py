"""A request whose prompt KV is loaded from a prefill engine (disaggregated serving) under a LoRA
adapter is seated with its adapter's slot, or waits for one like any other request (pure Python:
the scheduler's KV connector seam with tests/disagg/test_kv_connector.py's loopback connector)."""

from tests.disagg.test_kv_connector import MAX_LEN, LoopbackConnector, _prefill, _remote, _sched
from tests.sched.sched_testkit import FakeRunner, assert_outputs_match_reference, check_invariants, make_request


def test_loaded_requests_take_their_adapters_slot_or_wait_for_it():
    prompts = {"a": make_request("a", 9).prompt_token_ids, "b": make_request("b", 13).prompt_token_ids}
    _, s_runner, s_conn = _prefill(prompts)
    r_runner = FakeRunner(64, 4)
    receiver = _sched(LoopbackConnector(s_runner, r_runner, held=s_conn.held), max_loras=1)
    reqs = []
    for rid, prompt in prompts.items():
        req = make_request(rid, prompt, max_tokens=5, ignore_eos=True)
        req.lora_name, req.lora_key = rid.upper(), f"{rid.upper()}#1"
        req.remote_kv = _remote(s_conn, rid)
        receiver.add_request(req)
        reqs.append(req)
    slots, loads = [], []
    for _ in range(200):
        if not receiver.has_unfinished_requests():
            break
        out = receiver.schedule()
        loads += out.lora_loads
        slots += [(r.request_id, r.lora_slot) for r in out.requests]
        running = {r.request_id for r in receiver.running}
        assert not {"a", "b"} <= running, "one slot, two adapters: never both running"
        receiver.update(out, r_runner.execute(out, receiver))
        check_invariants(receiver)
    assert_outputs_match_reference(reqs, MAX_LEN)
    assert loads == [(1, "A#1"), (1, "B#1")]
    assert {s for _, s in slots} == {1} and [rid for rid, _ in slots][0] == "a" and slots[-1][0] == "b"
