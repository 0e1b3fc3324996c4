"""Run inside a child process with N CPU devices (tests/parallel/cpu_devices.py): builds engines
at several tensor-parallel sizes and prints one JSON report as its last stdout line. The tests
assert on the report; nothing here decides pass or fail.

    tp_probe.py tiny CACHE DIR:SIZES[:IMPL] ...  per model dir, one engine per size (attention IMPL,
                                        default auto): greedy outputs, n=2
                                        forks, the compiled steps' collectives, bytes per device;
                                        every engine keeps its executables in the one folder CACHE
    tp_probe.py quantized DIR SIZE      int8 weights and an int8 KV cache at 1 and SIZE devices; int4
                                        (group 32) at SIZE, whose 2 groups of o/down rows do not split
    tp_probe.py embedded SIZE           the embedded model at 1 and SIZE on one workload with
                                        prefix hits, chunked prefill, preemption and n=2
    tp_probe.py start DIR CACHE SIZE    one start at SIZE devices keeping its executables in CACHE:
                                        how many steps and samplers it compiled, its greedy outputs
    tp_probe.py update DIR DIR2 SIZE    weight updates at SIZE devices: DIR2's tensors by name, then
                                        DIR's params from one device (resharded); greedy outputs
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.parallel.collectives import collectives
from jaxserve.parallel.sharding import bytes_on_each_device

TINY_PROMPTS = ["The tide comes in", "def add(a, b):",
                "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and a long tail of words to make it chunked"]
TINY_SHAPES = dict(max_num_seqs=4, max_model_len=128, block_size=4, prefill_tile=8, max_num_batched_tokens=32,
                   num_kv_blocks=96, swap_space=0, xla_optimization_level=0, compilation_cache_dir="",
                   cache_dir="", progress=False, long_prefill_token_threshold=0,
                   decode_buckets=(4,), decode_only_buckets=(4,), prefill_buckets=(0, 4))


def runner_of(llm: LLM):
    return llm.engine.runner


def leaf_bytes(params) -> list[dict]:
    """Per parameter: its path, global bytes, and bytes held by each device."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        held = bytes_on_each_device(leaf)
        out.append({"path": "/".join(str(getattr(k, "key", k)) for k in path), "nbytes": int(leaf.nbytes),
                    "per_device": [held.get(d.id, 0) for d in jax.devices()]})
    return out


def step_collectives(runner, bucket) -> list[list]:
    text = runner.steps[bucket].as_text()            # the executable the engine runs
    return [[c.kind, c.dtype, list(c.shape)] for c in collectives(text)]


def tiny(cache_dir: str, *specs: str) -> dict:
    return {"devices": jax.device_count(),
            "models": {spec.split(":")[0]: tiny_model(cache_dir, *spec.split(":")) for spec in specs}}


def tiny_model(cache_dir: str, model_dir: str, sizes: str, attention_impl: str = "auto") -> dict:
    """Per size: the engine's greedy outputs (three prompts, and n=2 forks of the first in the same
    call) with HF transformers' greedy continuations beside them (the one-device engine equals HF:
    tests/engine/test_llm_tiny.py), the compiled steps' collectives, and bytes per device, with
    the one-device params' and arena's bytes from their shapes."""
    from jaxserve.models.params import abstract_params
    from jaxserve.runner.kv_arena import ArenaSpec
    from jaxserve.testing.tiny_models import hf_greedy

    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    forked = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, n=2)
    report = {"engines": {}}
    for size in [int(s) for s in sizes.split(",")]:
        llm = LLM(model_dir, **{**TINY_SHAPES, "cache_dir": cache_dir}, tensor_parallel_size=size,
                  attention_impl=attention_impl)
        runner = runner_of(llm)
        outs = llm.generate(TINY_PROMPTS + TINY_PROMPTS[:1], [greedy] * len(TINY_PROMPTS) + [forked],
                            use_tqdm=False)
        kv = bytes_on_each_device(runner.kv_caches)
        report["engines"][size] = {
            "tokens": [o.outputs[0].token_ids for o in outs[:-1]],
            "forked": [c.token_ids for c in outs[-1].outputs],
            "params": leaf_bytes(runner.params),
            "kv_per_device": [kv.get(d.id, 0) for d in jax.devices()],
            "kv_total": int(sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)),
            "kv_heads": runner.arena_spec.num_kv_heads,
            "collectives": {f"{d},{p}": step_collectives(runner, (d, p)) for d, p in [(4, 0), (4, 4)]},
            "compilations_after_warmup": llm.stats().steps.num_compilations_after_warmup,
            "mesh": runner.mesh_info.as_dict(),
            "executables_kept": sorted(os.listdir(os.path.join(cache_dir, "executables"))),
        }
        prompts = [o.prompt_token_ids for o in outs[:-1]]
        config = llm.engine.runner.model_config
        del llm, runner
    one = dataclasses.replace(config, num_key_value_heads=_checkpoint_kv_heads(model_dir))   # unreplicated
    arena = ArenaSpec(one.num_hidden_layers, TINY_SHAPES["num_kv_blocks"] + 1, TINY_SHAPES["block_size"],
                      one.num_key_value_heads, one.head_dim, "float32")
    report["hf_tokens"] = [hf_greedy(model_dir, ids, 12) for ids in prompts]
    report["one_device"] = {
        "params": {"/".join(str(getattr(k, "key", k)) for k in path): int(np.prod(leaf.shape)) * 4
                   for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(one, "float32"))[0]},
        "kv_total": arena.bytes_per_block * arena.num_blocks,
        "kv_heads": one.num_key_value_heads,
    }
    report.update(layers=one.num_hidden_layers, hidden=one.hidden_size, vocab=one.vocab_size)
    return report


def _checkpoint_kv_heads(model_dir: str) -> int:
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)["num_key_value_heads"]


def quantized(model_dir: str, size: str) -> dict:
    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    report = {}
    for tp in (1, int(size)):
        llm = LLM(model_dir, **TINY_SHAPES, tensor_parallel_size=tp, quantization="int8", kv_cache_dtype="int8")
        runner = runner_of(llm)
        report[tp] = {"tokens": [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, greedy, use_tqdm=False)],
                      "kv_dtype": runner.arena_spec.dtype,
                      "qweight_per_device": sorted(bytes_on_each_device(
                          runner.params["layers_0"]["mlp"]["down_proj"]["qweight"]).values()),
                      "kv_scales_shape": list(runner.params["kv_scales"]["k"].shape)}
        del llm, runner
    try:
        LLM(model_dir, **TINY_SHAPES, tensor_parallel_size=int(size), quantization="int4")
        report["int4_error"] = ""
    except ValueError as e:
        report["int4_error"] = str(e)
    return report


EMBEDDED_QUESTIONS = ["Tell me about tides.", "What is the capital of France?", "Write a haiku about the sea."]


def embedded(size: int) -> dict:
    """One workload through the engine at sizes 1 and `size`: three chat prompts sharing a long
    system prompt (prefix-cache hits), longer than a step's token budget (chunked prefill), n=2
    (forks, copy-on-write), on a pool too small for all of them at once (preemption)."""
    system = ("You are a careful assistant. Answer briefly and exactly. " * 6).strip()
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in EMBEDDED_QUESTIONS]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, n=2)
    report = {}
    for tp in (1, size):
        llm = LLM(None, tensor_parallel_size=tp, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=256, block_size=16, num_kv_blocks=64, usable_kv_blocks=12, kv_watermark=0.0, prefill_tile=16,
                  decode_buckets=(8,), decode_only_buckets=(8,), prefill_buckets=(0, 4),
                  long_prefill_token_threshold=0, preemption_mode="recompute", swap_space=0, xla_optimization_level=0,
                  compilation_cache_dir="", cache_dir="", progress=False)
        outs = llm.chat(convs, params, use_tqdm=False)
        s = llm.stats()
        report[tp] = {"tokens": [[c.token_ids for c in o.outputs] for o in outs],
                      "text": [o.outputs[0].text for o in outs],
                      "prompt_lens": [len(o.prompt_token_ids) for o in outs],
                      "preemptions": s.scheduler.num_preemptions, "prefix_hits": s.scheduler.prefix_cache_hits,
                      "compilations_after_warmup": s.steps.num_compilations_after_warmup,
                      "mesh": llm.engine.runner.mesh_info.as_dict()}
        del llm
    return report


def start(model_dir: str, cache_dir: str, size: str) -> dict:
    """One engine start, as a server's would be: what it compiled (steps and samplers go through
    compile_to_keep only when the executable cache misses) and what it generates."""
    from jaxserve.runner import programs

    compiled = []
    keep = programs.compile_to_keep

    def counting(lowered, *args, **kwargs):
        compiled.append(1)
        return keep(lowered, *args, **kwargs)

    programs.compile_to_keep = counting
    llm = LLM(model_dir, **{**TINY_SHAPES, "cache_dir": cache_dir}, tensor_parallel_size=int(size))
    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    outs = llm.generate(TINY_PROMPTS, greedy, use_tqdm=False)
    return {"compiled": len(compiled), "tokens": [o.outputs[0].token_ids for o in outs],
            "mesh_devices": [d.id for d in llm.engine.runner.execution_devices],
            "compilations_after_warmup": llm.stats().steps.num_compilations_after_warmup}


def update(first_dir: str, second_dir: str, size: str) -> dict:
    """Weight updates on a SIZE-way engine (engine/weight_update.py): the second model's tensors
    by checkpoint name (the shard-major reorder applied on the host), then the first model's
    params as a pytree placed on one device (resharded onto the mesh); greedy outputs after each,
    HF transformers' beside them, and whether every leaf kept the engine's sharding."""
    from safetensors.numpy import load_file

    from jaxserve.testing.tiny_models import hf_greedy

    llm = LLM(first_dir, **TINY_SHAPES, tensor_parallel_size=int(size))
    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in TINY_PROMPTS]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, greedy, use_tqdm=False)]

    runner = runner_of(llm)
    own = runner.params
    shardings = jax.tree.map(lambda x: x.sharding, own)
    first = tokens()
    llm.update_weights(load_file(os.path.join(second_dir, "model.safetensors")).items(), version="second")
    second = tokens()
    one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), own)
    llm.update_weights(one_device, version="first")
    kept = jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, runner.params, shardings))
    back = tokens()
    return {"first": first, "second": second, "back": back, "shardings_kept": bool(kept),
            "hf_first": [hf_greedy(first_dir, i, 12) for i in ids],
            "hf_second": [hf_greedy(second_dir, i, 12) for i in ids],
            "compilations_after_warmup": llm.stats().steps.num_compilations_after_warmup}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    result = {"tiny": tiny, "quantized": quantized, "embedded": lambda size: embedded(int(size)),
              "start": start, "update": update}[cmd](*args)
    print(json.dumps(result))
