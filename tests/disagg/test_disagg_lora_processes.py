"""Disaggregated prefill and decode under a LoRA adapter, as real processes on loopback (tiny
model, a random PEFT adapter registered on every engine with --lora-modules): a prompt prefilled
under the adapter on the prefill engine and decoded on the decode engine from its lease gives the
colocated engine's tokens under that adapter (which differ from the base model's, so the check can
fail); the lease names the adapter; a decode request under another adapter (or the base model)
than the lease's is refused with INVALID_ARGUMENT; behind the router the same tokens come back.
The block accounting is whole on both sides afterwards."""

from __future__ import annotations

import grpc
import pytest

from jaxserve.proto import generation_pb2 as pb
from tests.disagg.test_disagg_processes import _request, _tokens, assert_blocks_whole
from tests.lora.conftest import adapter_dirs  # noqa: F401  (the fixture)
from tests.router.router_process import RouterProcess
from tests.server.server_process import ServerProcess

PROMPT = list(range(3, 3 + 21))
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, xla_cache_dir, adapter_dirs, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("pd-lora")
    modules = ["--lora-modules", f"qv4={adapter_dirs['qv4']}", f"all8={adapter_dirs['all8']}"]
    flags = {
        "prefill": (*LORA, *modules, "--role", "prefill", "--kv-lease-s", "20"),
        "decode": (*LORA, *modules, "--role", "decode", "--kv-load-timeout-s", "30"),
        "colocated": (*LORA, *modules),
    }
    procs = {}
    try:
        # one after another: the first compiles into the shared cache, the others load from it
        for name, f in flags.items():
            procs[name] = ServerProcess(tiny_llama_dir, xla_cache_dir, d / f"{name}.log", *f)
            procs[name].wait_serving()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


def _lease(prefill, rid, lora_name):
    _, msgs = _tokens(prefill.target, _request(PROMPT, rid, max_tokens=1, kv_transfer=pb.KVTransfer(send=True),
                                                lora_name=lora_name))
    lease = msgs[-1].complete.kv_lease
    assert lease.transfer_id == rid and lease.num_tokens == len(PROMPT)
    assert lease.lora_name == lora_name
    return pb.RemoteKV(peer=prefill.target, transfer_id=lease.transfer_id, generation=lease.generation,
                       num_tokens=lease.num_tokens, lora_name=lease.lora_name)


@pytest.mark.slow   # three server processes with LoRA slots, then a router (~2-4 min on 2 cores)
def test_a_prompt_prefilled_under_an_adapter_decodes_elsewhere_with_the_colocated_tokens(engines, tiny_llama_dir,
                                                                                         tmp_path):
    prefill, decode, colocated = engines["prefill"], engines["decode"], engines["colocated"]
    want = _tokens(colocated.target, _request(PROMPT, lora_name="all8"))[0]
    base = _tokens(colocated.target, _request(PROMPT))[0]
    assert want != base     # the adapter changes the answer: the comparison below can fail

    remote = _lease(prefill, "h1", "all8")
    got = _tokens(decode.target, _request(PROMPT, "h1", kv_transfer=pb.KVTransfer(load=remote), lora_name="all8"))[0]
    assert got == want

    # a lease computed under all8 is refused for a request under qv4, or under the base model
    for rid, name in (("h2", "qv4"), ("h3", None)):
        remote = _lease(prefill, rid, "all8")
        kw = {} if name is None else {"lora_name": name}
        with pytest.raises(grpc.RpcError) as refused:
            _tokens(decode.target, _request(PROMPT, rid, kv_transfer=pb.KVTransfer(load=remote), **kw))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "computed under LoRA adapter 'all8'" in refused.value.details()

    router = RouterProcess([], tmp_path / "router.log", "--prefill", prefill.target, "--decode", decode.target,
                           "--prefill-threshold-tokens", "8", "--model", tiny_llama_dir)
    try:
        router.wait_serving()
        assert _tokens(router.target, _request(PROMPT, lora_name="all8"))[0] == want
        assert _tokens(router.target, _request(PROMPT))[0] == base
    finally:
        assert router.stop() == 0, router.log()
    assert_blocks_whole(decode, colocated)
