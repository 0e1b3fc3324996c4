"""Multi-LoRA serving end to end on the tiny Llama with random PEFT adapters (tests/lora/conftest.py):
one mixed batch of the base model and three adapters equals HF + peft greedy, adapter by adapter;
a fourth adapter evicts the least recently used idle slot and an evicted adapter comes back from
the host registry (its directory gone); the prefix cache never serves one adapter's K/V to another;
a request waits for a slot held by running requests and is admitted when one frees; nothing
compiles after warm-up; the block accounting holds after each workload."""

import os
import shutil

import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.testing.lora_adapters import hf_peft_greedy
from tests.lora.conftest import LORA_ENGINE
from tests.sched.sched_testkit import check_invariants

PROMPT = [5, 17, 33, 71, 9, 100, 42, 8, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **LORA_ENGINE)


@pytest.fixture(scope="module")
def hf_tokens(tiny_llama_dir, adapter_dirs):
    """HF + peft's greedy tokens of PROMPT: the base model (None) and each adapter."""
    out = {None: hf_peft_greedy(tiny_llama_dir, None, PROMPT, 8)}
    for name, path in adapter_dirs.items():
        out[name] = hf_peft_greedy(tiny_llama_dir, path, PROMPT, 8)
    return out


def lora(adapter_dirs, name, i):
    return LoRARequest(name, i, adapter_dirs[name])


def _generate(llm, loras, prompt=PROMPT, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(loras), params, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def test_one_mixed_batch_equals_hf_peft_per_adapter(llm, adapter_dirs, hf_tokens):
    # each adapter really changes the output (a zero lora_B would make this test unable to fail)
    assert len({tuple(t) for t in hf_tokens.values()}) == len(hf_tokens)
    names = [None, "qv4", "all8", "mlp2", None, "qv4"]
    loras = [None if n is None else lora(adapter_dirs, n, i + 1) for i, n in enumerate(names)]
    tokens, _ = _generate(llm, loras)
    for name, got in zip(names, tokens):
        assert got == hf_tokens[name], name
    assert {r.lora_name for r in llm.list_loras()} == {"qv4", "all8", "mlp2"}   # registered at the door
    assert llm.stats().steps.num_compilations_after_warmup == 0
    check_invariants(llm.engine.scheduler)


def test_lru_eviction_and_reload_from_the_host_registry(llm, adapter_dirs, hf_tokens, tmp_path):
    slots = llm.engine.scheduler.lora_slots
    ids = {"qv4": 1, "all8": 2, "mlp2": 3}
    for name, i in ids.items():          # all three resident (registered already: same requests)
        llm.add_lora(lora(adapter_dirs, name, i))
    _generate(llm, [lora(adapter_dirs, "qv4", 1), lora(adapter_dirs, "all8", 2), lora(adapter_dirs, "mlp2", 3)])
    # use them in a known order: qv4 least recently, mlp2 most recently
    for name in ("qv4", "all8", "mlp2"):
        _generate(llm, [lora(adapter_dirs, name, ids[name])])
    assert sorted(k.split("#")[0] for k in slots.resident().values()) == ["all8", "mlp2", "qv4"]
    # a fourth adapter, from a directory that is deleted once it is registered
    moved = shutil.copytree(adapter_dirs["kq3"], tmp_path / "kq3")
    assert llm.add_lora(LoRARequest("kq3", 4, str(moved))) is True
    assert llm.add_lora(LoRARequest("kq3", 4, str(moved))) is False        # the same adapter again
    shutil.rmtree(moved)
    evictions = slots.num_evictions
    tokens, _ = _generate(llm, [LoRARequest("kq3", 4, str(moved))])
    assert tokens[0] == hf_tokens["kq3"]
    assert slots.num_evictions == evictions + 1
    resident = sorted(k.split("#")[0] for k in slots.resident().values())
    assert resident == ["all8", "kq3", "mlp2"], resident          # qv4 was the least recently used
    # the others come back one by one, each evicting the least recently used: all8, mlp2, then
    # kq3; kq3 then comes back from host memory (its directory is gone)
    loads = slots.num_loads
    for name in ("qv4", "all8", "mlp2"):
        tokens, _ = _generate(llm, [lora(adapter_dirs, name, ids[name])])
        assert tokens[0] == hf_tokens[name], name
    assert "kq3" not in {k.split("#")[0] for k in slots.resident().values()}
    tokens, _ = _generate(llm, [LoRARequest("kq3", 4), None])
    assert tokens == [hf_tokens["kq3"], hf_tokens[None]]
    assert slots.num_loads == loads + 4 and not os.path.exists(moved)
    assert llm.stats().steps.num_compilations_after_warmup == 0
    check_invariants(llm.engine.scheduler)
    assert llm.remove_lora("kq3") is True and llm.remove_lora(4) is False
    assert "kq3" not in {r.lora_name for r in llm.list_loras()}


def test_the_prefix_cache_never_crosses_adapters(llm, adapter_dirs):
    prompt = list(range(40, 64))                       # six full blocks of 4 tokens
    params = SamplingParams(temperature=0, max_tokens=2)
    a, b = lora(adapter_dirs, "qv4", 1), lora(adapter_dirs, "all8", 2)
    cached = []
    for req in (a, b, None, a, b, None):
        out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=req, use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0], cached             # first time under each: no hit from another
    assert all(c >= 20 for c in cached[3:]), cached     # the same adapter (or base) again: a hit
    check_invariants(llm.engine.scheduler)


def test_a_request_waits_for_a_slot_and_runs_when_one_frees(llm, adapter_dirs, hf_tokens):
    engine = llm.engine
    slots = engine.scheduler.lora_slots
    holders = [("qv4", 1, 20), ("all8", 2, 30), ("mlp2", 3, 30)]
    for name, i, n in holders:      # three long requests hold the three slots
        engine.add_request(f"hold-{name}", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=n,
                           min_tokens=n), lora_request=lora(adapter_dirs, name, i))
    engine.step()
    engine.step()
    assert slots.num_held() == 3
    engine.add_request("waiter", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora(adapter_dirs, "kq3", 4))
    outputs, waited, admitted_after = {}, 0, None
    while engine.has_unfinished_requests():
        running = {r.request_id for r in engine.scheduler.running}
        if "waiter" in running and admitted_after is None:
            admitted_after = set(outputs)          # the requests that had ended by then
        elif admitted_after is None:
            waited += 1                            # a seat is free (max_num_seqs=4), no slot is
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert waited > 10 and "hold-qv4" in admitted_after, (waited, admitted_after)
    assert list(outputs["waiter"].outputs[0].token_ids) == hf_tokens["kq3"]
    assert outputs["waiter"].outputs[0].finish_reason == "length"
    assert llm.stats().steps.num_compilations_after_warmup == 0
    check_invariants(engine.scheduler)


def test_the_async_engine_serves_adapters_and_their_registry(llm, adapter_dirs, hf_tokens):
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine

    async def main():
        aengine = AsyncEngine(llm.engine)
        try:
            assert await aengine.add_lora(lora(adapter_dirs, "mlp2", 3)) in (True, False)
            names = {r.lora_name for r in await aengine.list_loras()}
            final = {}

            async def one(name, i):
                req = None if name is None else lora(adapter_dirs, name, i)
                async for out in aengine.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=req):
                    final[name] = out
            await asyncio.wait_for(asyncio.gather(one("mlp2", 3), one("qv4", 1), one(None, 0)), 120)
            with pytest.raises(ValueError, match="has no lora_path"):
                async for _ in aengine.generate({"prompt_token_ids": PROMPT}, GREEDY,
                                                lora_request=LoRARequest("ghost", 9)):
                    pass
            return names, final
        finally:
            await aengine.shutdown()

    names, final = asyncio.run(main())
    assert "mlp2" in names
    for name, out in final.items():
        assert list(out.outputs[0].token_ids) == hf_tokens[name], name
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_ngram_speculation_verifies_with_the_adapter(tiny_llama_dir, adapter_dirs):
    # ngram guesses are checked by the target model, adapter included: the tokens stay the adapter's
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "adaptive": False}
    llm = LLM(tiny_llama_dir, **dict(LORA_ENGINE, speculative_config=spec))
    prompt = PROMPT * 3
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    names = ["all8", "qv4", None]
    loras = [None if n is None else lora(adapter_dirs, n, i + 1) for i, n in enumerate(names)]
    for name, req in zip(names, loras):       # one at a time: decode-only steps, where guesses run
        out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=req, use_tqdm=False)[0]
        expected = hf_peft_greedy(tiny_llama_dir, req and req.lora_path, prompt, 12)
        assert list(out.outputs[0].token_ids) == expected, name
    stats = llm.stats()
    assert stats.scheduler.spec_num_draft_tokens > 0 and stats.steps.num_compilations_after_warmup == 0
    check_invariants(llm.engine.scheduler)


def test_a_weight_update_keeps_the_resident_adapters(llm, adapter_dirs, hf_tokens):
    import jax

    params = llm.engine.runner.params
    base = jax.tree_util.tree_map_with_path(lambda path, x: x, params)        # a copy of the structure
    for layer in [k for k in base if k.startswith("layers_")]:                  # the base weights only
        for module in base[layer].values():
            if isinstance(module, dict):
                for proj in module.values():
                    if isinstance(proj, dict):
                        proj.pop("lora_a", None), proj.pop("lora_b", None)
    llm.update_weights(base)                                                     # the same weights
    names = [None, "qv4", "all8"]
    tokens, _ = _generate(llm, [None if n is None else lora(adapter_dirs, n, i + 1) for i, n in enumerate(names)])
    assert tokens == [hf_tokens[n] for n in names]
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_the_async_engine_reads_adapter_files_off_the_step_thread(llm, adapter_dirs, hf_tokens, monkeypatch):
    """add_lora and a request naming an unregistered adapter read its PEFT directory on the door's
    worker threads; the step thread only registers what was read (it reads no file)."""
    import asyncio
    import threading

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.lora import registry

    reads = []
    real = registry.load_peft_adapter

    def recording(path, *args, **kwargs):
        reads.append((os.path.basename(path), threading.current_thread()))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(registry, "load_peft_adapter", recording)
    for name in ("kq3", "all8"):
        llm.remove_lora(name)

    async def main():
        aengine = AsyncEngine(llm.engine)
        try:
            assert await aengine.add_lora(lora(adapter_dirs, "kq3", 4))
            final = None
            async for out in aengine.generate({"prompt_token_ids": PROMPT}, GREEDY,
                                              lora_request=lora(adapter_dirs, "all8", 2)):
                final = out
            return await aengine.call(lambda engine: threading.current_thread()), final
        finally:
            await aengine.shutdown()

    step_thread, final = asyncio.run(main())
    assert sorted(name for name, _ in reads) == ["all8", "kq3"]      # each directory read once
    assert all(thread is not step_thread and thread is not threading.main_thread() for _, thread in reads)
    assert list(final.outputs[0].token_ids) == hf_tokens["all8"]
    assert {r.lora_name for r in llm.list_loras()} >= {"kq3", "all8"}
    check_invariants(llm.engine.scheduler)
