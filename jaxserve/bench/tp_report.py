"""What tensor parallelism costs each device, measured: `python -m jaxserve.bench.tp_report`.

For each tensor-parallel size it builds the engine (on fake CPU devices with --cpu-devices),
then reports the weight and KV arena bytes each device holds (from the arrays' shards), and the
collectives in two compiled steps (a decode-only step and a step with prefill tiles), with their
bytes. Without --model-only it also gives the same bytes for a Llama-3-8B-shaped model, from the
params' shapes and PartitionSpecs (nothing allocated: it does not fit a CPU's memory at fp32).
docs/benchmarks.md holds its output; speed needs real devices (scripts/gpu_bench.sh
--tensor-parallel-size).

    python -m jaxserve.bench.tp_report --cpu-devices 3 --tensor-parallel-size 1,3   # the embedded model
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.tp_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    p.add_argument("--tensor-parallel-size", default="1,3", help="comma-separated sizes")
    p.add_argument("--cpu-devices", type=int, default=None, help="fake this many CPU devices (set before jax starts)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-only", action="store_true", help="skip the Llama-3-8B shape's planned bytes")
    args = p.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    sizes = [int(s) for s in args.tensor_parallel_size.split(",")]
    print(measured_table(args.model, sizes, args.dtype))
    if not args.model_only:
        print()
        print(planned_table("llama3-8b", [1, 2, 4, 8], "bfloat16", block_size=16, num_blocks=8192))
    return 0


def measured_table(model: str | None, sizes: list[int], dtype: str) -> str:
    from jaxserve import LLM
    from jaxserve.parallel.collectives import collectives, count_by_kind
    from jaxserve.parallel.sharding import bytes_on_each_device

    rows = ["| TP | weights per device (MiB) | KV arena per device (MiB) | step | all-reduce | all-gather | "
            "other | collective MiB per step |", "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        llm = LLM(model, tensor_parallel_size=size, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=256, block_size=16, num_kv_blocks=64, prefill_tile=16, decode_buckets=(8,),
                  decode_only_buckets=(8,), prefill_buckets=(0, 4), swap_space=0, warm_up="none",
                  long_prefill_token_threshold=0, compilation_cache_dir="", cache_dir="", progress=False)
        runner = llm.engine.runner
        weights = max(bytes_on_each_device(runner.params).values())
        kv = max(bytes_on_each_device(runner.kv_caches).values())
        for bucket in ((8, 0), (8, 4)):
            runner.load_executables([bucket])
            ops = collectives(runner.steps[bucket].as_text())
            counts = count_by_kind(ops)
            other = sum(v for k, v in counts.items() if k not in ("all-reduce", "all-gather"))
            rows.append(f"| {size} | {weights / 2**20:.1f} | {kv / 2**20:.2f} | {bucket} | {counts['all-reduce']} | "
                        f"{counts['all-gather']} | {other} | {sum(op.nbytes for op in ops) / 2**20:.3f} |")
        del llm, runner
    return "\n".join(rows)


def planned_table(shape: str, sizes: list[int], dtype: str, *, block_size: int, num_blocks: int) -> str:
    """Per-device bytes of a model shape's weights and of a `num_blocks` arena, from shapes alone."""
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.bench.random_model import hf_config
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.params import abstract_params, layout_of
    from jaxserve.parallel.layout import HeadLayout
    from jaxserve.parallel.sharding import planned_bytes_per_device

    config = ModelConfig.from_hf_config(hf_config(shape).to_dict())
    itemsize = jnp.dtype(dtype).itemsize
    rows = [f"| {shape} {dtype} TP | weights per device (GiB) | KV per device (GiB, {num_blocks} blocks of "
            f"{block_size}) | KV heads per device |", "|---|---|---|---|"]
    for size in sizes:
        layout = HeadLayout.for_model(config, size)
        runner_config = dataclasses.replace(config, num_key_value_heads=layout.kv_heads)
        weights = planned_bytes_per_device(abstract_params(runner_config, dtype), layout_of(runner_config), size,
                                           config.vocab_size)
        kv = (2 * config.num_hidden_layers * num_blocks * block_size * layout.kv_heads_per_shard
              * config.head_dim * itemsize)
        rows.append(f"| {size} | {weights / 2**30:.2f} | {kv / 2**30:.2f} | {layout.kv_heads_per_shard} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
