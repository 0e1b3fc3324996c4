"""Run in a child with N CPU devices (tests/parallel/cpu_devices.py): LoRA engines at the given
tensor-parallel sizes on a tiny Llama of 8 query and 2 KV heads (4 devices replicate KV heads),
serving random PEFT adapters; prints one JSON report (tokens per engine, HF + peft's tokens, how
the slot arrays are split, compilations after warm-up) as its last stdout line.

    lora_tp_probe.py WORKDIR SIZE[,SIZE...]
"""

from __future__ import annotations

import json
import sys

import jax

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.parallel.sharding import bytes_on_each_device
from jaxserve.testing.lora_adapters import hf_peft_greedy, make_peft_adapter
from jaxserve.testing.tiny_models import make_tiny_model

PROMPT = [5, 17, 33, 71, 9, 100, 42, 8, 11]
SHAPES = dict(max_num_seqs=4, max_model_len=128, block_size=4, prefill_tile=8, max_num_batched_tokens=32,
              num_kv_blocks=96, swap_space=0, xla_optimization_level=0, compilation_cache_dir="", cache_dir="",
              progress=False, long_prefill_token_threshold=0, decode_buckets=(4,), decode_only_buckets=(4,),
              prefill_buckets=(0, 4), enable_lora=True, max_loras=2, max_lora_rank=8)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(workdir: str, sizes: str) -> dict:
    base = make_tiny_model(f"{workdir}/base", "llama", seed=3, num_heads=8, num_kv_heads=2)
    adapters = {"kv4": make_peft_adapter(base, f"{workdir}/kv4", r=4, alpha=8.0, target_modules=("k_proj", "v_proj"),
                                         seed=1),
                "all8": make_peft_adapter(base, f"{workdir}/all8", r=8, alpha=12.0, target_modules=ALL,
                                          use_rslora=True, seed=2)}
    names = [None, "kv4", "all8", "kv4"]
    report = {"devices": jax.device_count(), "engines": {},
              "hf": {str(n): hf_peft_greedy(base, n and adapters[n], PROMPT, 8) for n in set(names)}}
    for size in (int(s) for s in sizes.split(",")):
        llm = LLM(base, **SHAPES, tensor_parallel_size=size)
        loras = [None if n is None else LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(names)]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(names), SamplingParams(temperature=0, max_tokens=8,
                            min_tokens=8), lora_request=loras, use_tqdm=False)
        qkv = llm.engine.runner.params["layers_0"]["self_attn"]["qkv_proj"]
        down = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]
        report["engines"][str(size)] = {
            "tokens": {str(n): list(o.outputs[0].token_ids) for n, o in zip(names, outs)},
            "bytes_per_device": {k: sorted(bytes_on_each_device(v).values()) + [int(v.nbytes)] for k, v in
                                 (("qkv_b", qkv["lora_b"]), ("qkv_a", qkv["lora_a"]), ("down_a", down["lora_a"]),
                                  ("down_b", down["lora_b"]))},
            "compilations_after_warmup": llm.stats().steps.num_compilations_after_warmup,
        }
        del llm
    return report


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
