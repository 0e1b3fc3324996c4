"""What multi-LoRA serving refuses, each with a ValueError that says why: adapters that do not fit
the model or the engine (rank above max_lora_rank, a module the model has none of, factors of
other shapes, PEFT features the slots do not compute, a bad path), configurations it is not built
for, and a LoRARequest on an engine without enable_lora. Nothing of a refused request is queued."""

import json
import os

import numpy as np
import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.engine_args import engine_config
from jaxserve.lora.peft_adapter import load_peft_adapter
from jaxserve.lora.random_adapter import write_random_adapter
from jaxserve.lora.engine_lora import lora_targets
from jaxserve.models.config import ModelConfig
from tests.conftest import TINY_ENGINE
from tests.lora.conftest import LORA_ENGINE


@pytest.fixture(scope="module")
def targets(tiny_llama_dir):
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        return lora_targets(ModelConfig.from_hf_config(json.load(f)))


def _adapter(tmp_path, targets, name="a", **kw):
    args = dict(r=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    return write_random_adapter(tmp_path / name, targets, **{**args, **kw})


def test_a_good_adapter_loads_with_its_scale(tmp_path, targets):
    adapter = load_peft_adapter(_adapter(tmp_path, targets), targets, max_rank=8)
    assert adapter.rank == 4 and adapter.target_modules == ("q_proj", "v_proj")
    assert {f.scale for f in adapter.factors.values()} == {2.0}                 # alpha / r
    rs = load_peft_adapter(_adapter(tmp_path, targets, "rs", use_rslora=True), targets, max_rank=8)
    assert {f.scale for f in rs.factors.values()} == {4.0}                      # alpha / sqrt(r)


def test_adapters_that_do_not_fit_are_refused(tmp_path, targets):
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        load_peft_adapter(_adapter(tmp_path, targets, "big", r=16), targets, max_rank=8)
    with pytest.raises(ValueError, match=r"targets \['embed_proj'\], which this model has no projection"):
        path = _adapter(tmp_path, targets, "unknown")
        cfg_file = os.path.join(path, "adapter_config.json")
        cfg = json.load(open(cfg_file))
        cfg["target_modules"] = ["q_proj", "embed_proj"]
        json.dump(cfg, open(cfg_file, "w"))
        load_peft_adapter(path, targets, max_rank=8)
    from safetensors.numpy import load_file, save_file
    path = _adapter(tmp_path, targets, "shape")
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = np.zeros((4, 48), np.float32)                # the tiny model's hidden size is 64
    save_file(tensors, file)
    with pytest.raises(ValueError, match="another base model"):
        load_peft_adapter(path, targets, max_rank=8)
    path = _adapter(tmp_path, targets, "layers")
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 64), np.float32)
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = np.zeros((64, 4), np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="layers.7.self_attn.q_proj', which this model has no projection"):
        load_peft_adapter(path, targets, max_rank=8)
    path = _adapter(tmp_path, targets, "dora")
    cfg = json.load(open(os.path.join(path, "adapter_config.json")))
    json.dump({**cfg, "use_dora": True}, open(os.path.join(path, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="use_dora"):
        load_peft_adapter(path, targets, max_rank=8)
    with pytest.raises(ValueError, match="is not a directory"):
        load_peft_adapter(str(tmp_path / "nowhere"), targets, max_rank=8)


def test_configurations_lora_is_not_built_for_are_refused():
    for kw, what in ((dict(speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 2}),
                      "draft model"),
                     (dict(batch_invariant=True), "batch_invariant"),
                     (dict(expert_parallel_size=2), "expert_parallel_size")):
        with pytest.raises(ValueError, match=f"enable_lora=True is not supported with .*{what}"):
            engine_config(enable_lora=True, **kw)
    engine_config(enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_lora_rank=0 must be a positive integer"):
        engine_config(enable_lora=True, max_lora_rank=0)


def test_a_lora_request_without_enable_lora_is_refused_at_the_door(tiny_llama_dir, tmp_path, targets):
    llm = LLM(tiny_llama_dir, **dict(TINY_ENGINE, warm_up="none"))
    req = LoRARequest("a", 1, _adapter(tmp_path, targets))
    with pytest.raises(ValueError, match="needs an engine built with enable_lora=True"):
        llm.generate("hello", SamplingParams(max_tokens=2), lora_request=req, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.add_lora(req)
    assert llm.list_loras() == [] and llm.remove_lora("a") is False


def test_a_bad_adapter_is_refused_at_the_door_and_nothing_is_queued(tiny_llama_dir, tmp_path, targets):
    llm = LLM(tiny_llama_dir, **dict(LORA_ENGINE, warm_up="none"))
    good = LoRARequest("good", 1, _adapter(tmp_path, targets))
    bad = LoRARequest("big", 2, _adapter(tmp_path, targets, "big", r=16))
    with pytest.raises(ValueError, match="above max_lora_rank=8"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), lora_request=[good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()                 # the good one was taken back too
    with pytest.raises(ValueError, match="not registered and its request has no lora_path"):
        llm.generate("a", SamplingParams(max_tokens=2), lora_request=LoRARequest("ghost", 3), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'good'"):
        llm.add_lora(LoRARequest("other", 1, good.lora_path))
    assert [r.lora_name for r in llm.list_loras()] == ["good"]
