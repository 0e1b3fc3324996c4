"""What expert parallelism costs each device, measured: `python -m jaxserve.bench.expert_report`.

Two tables (docs/benchmarks.md, "Mixture of experts", holds their output):

1. Per expert-parallel size (and TP), for a tiny random Qwen3-MoE engine (8 experts, top 2; built
   with transformers, as the tests build theirs): the weight and expert bytes and the KV arena
   bytes each device holds (from the arrays' shards), and the collectives in two compiled steps
   (decode-only, and with prefill tiles) by kind, with their bytes, for each dispatch form.
2. The expert layer alone (parallel/experts.py on a random layer: E experts, top k, D, F) at
   decode sizes (a few token rows) and prefill sizes (hundreds to thousands): the median time of
   each dispatch form and the bytes its compiled collectives move. This is what chose the
   engine's form (`experts.dispatch_for`).

    python -m jaxserve.bench.expert_report --cpu-devices 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.expert_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-devices", type=int, default=None, help="fake this many CPU devices (set before jax starts)")
    p.add_argument("--meshes", default="1x1,2x1,4x1,2x2", help="EPxTP settings of the engine table")
    p.add_argument("--sizes", default="4,32,512,2048", help="token rows of the layer table")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    if not args.skip_engine:
        print(engine_table(meshes))
        print()
    print(layer_table([int(s) for s in args.sizes.split(",")], [m for m in meshes if m[0] > 1], args.repeats))
    return 0


def engine_table(meshes: list[tuple[int, int]]) -> str:
    from jaxserve import LLM
    from jaxserve.parallel.collectives import collectives, count_by_kind
    from jaxserve.parallel.sharding import bytes_on_each_device
    from jaxserve.testing.tiny_models import make_tiny_model

    model = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="jaxserve-ep-"), "qwen3_moe"), "qwen3_moe",
                            hidden_size=128, num_heads=4, num_kv_heads=4, num_layers=2, intermediate_size=256)
    rows = ["| EP x TP | dispatch | weights per device (MiB) | of which experts | KV arena per device (MiB) | step | "
            "all-reduce | all-gather | all-to-all | other | collective KiB per step |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ep, tp in meshes:
        for form in (("all_gather",) if ep == 1 else ("all_gather", "all_to_all")):
            llm = LLM(model, tensor_parallel_size=tp, expert_parallel_size=ep, expert_dispatch=form,
                      max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=16,
                      num_kv_blocks=64, prefill_tile=16, decode_buckets=(8,), decode_only_buckets=(8,),
                      prefill_buckets=(0, 4), swap_space=0, warm_up="none", long_prefill_token_threshold=0,
                      compilation_cache_dir="", cache_dir="", progress=False)
            runner = llm.engine.runner
            weights = max(bytes_on_each_device(runner.params).values())
            experts = {k: v for k, v in _expert_leaves(runner.params)}
            expert_bytes = max(bytes_on_each_device(experts).values())
            kv = max(bytes_on_each_device(runner.kv_caches).values())
            for bucket in ((8, 0), (8, 4)):
                runner.load_executables([bucket])
                ops = collectives(runner.steps[bucket].as_text())
                c = count_by_kind(ops)
                other = sum(v for k, v in c.items() if k not in ("all-reduce", "all-gather", "all-to-all"))
                rows.append(f"| {ep} x {tp} | {form} | {weights / 2**20:.2f} | {expert_bytes / 2**20:.2f} | "
                            f"{kv / 2**20:.2f} | {bucket} | {c['all-reduce']} | {c['all-gather']} | "
                            f"{c['all-to-all']} | {other} | {sum(op.nbytes for op in ops) / 2**10:.1f} |")
            del llm, runner
    return "\n".join(rows)


def _expert_leaves(params):
    for layer, tree in params.items():
        if isinstance(tree, dict) and "mlp" in tree and "experts" in tree["mlp"]:
            yield layer, tree["mlp"]["experts"]


def layer_table(sizes: list[int], meshes: list[tuple[int, int]], repeats: int, *, experts: int = 32, top_k: int = 4,
                hidden: int = 256, columns: int = 128) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from jaxserve.models.moe import ExpertWeights, route
    from jaxserve.parallel.collectives import collectives
    from jaxserve.parallel.experts import DISPATCH_FORMS, ExpertParallel, experts_specs
    from jaxserve.parallel.layout import split_columns_order
    from jaxserve.parallel.mesh import make_moe_mesh

    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((experts, hidden, 2 * columns)) * 0.05).astype(np.float32)
    down = (rng.standard_normal((experts, columns, hidden)) * 0.05).astype(np.float32)
    rows = [f"Expert layer alone: {experts} experts, top {top_k}, D {hidden}, F {columns}, float32; medians of "
            f"{repeats}, forms interleaved", "",
            "| EP x TP | rows T | all_gather ms | all_to_all ms | all_to_all / all_gather | all_gather collective KiB | "
            "all_to_all collective KiB |", "|---|---|---|---|---|---|---|"]
    for ep, tp in meshes:
        mesh = make_moe_mesh(ep, tp)
        host = ExpertWeights({"kernel": gate_up[..., split_columns_order((columns, columns), tp)]}, {"kernel": down})
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host, experts_specs(host))
        for t in sizes:
            x = jnp.asarray(rng.standard_normal((t, hidden)), jnp.float32)
            routing = route(jnp.asarray(rng.standard_normal((t, experts)), jnp.float32), top_k=top_k,
                            norm_topk_prob=True)
            runs, moved = {}, {}
            for form in DISPATCH_FORMS:
                fn = jax.jit(lambda x, r, w, form=form: ExpertParallel(mesh, form)(x, r, w, activation=jax.nn.silu))
                compiled = fn.lower(x, routing, placed).compile()
                moved[form] = sum(op.nbytes for op in collectives(compiled.as_text()))
                jax.block_until_ready(compiled(x, routing, placed))
                runs[form] = compiled
            times = {form: [] for form in DISPATCH_FORMS}
            for _ in range(repeats):
                for form, compiled in runs.items():
                    start = time.perf_counter()
                    jax.block_until_ready(compiled(x, routing, placed))
                    times[form].append(time.perf_counter() - start)
            g, a = (statistics.median(times[f]) * 1e3 for f in DISPATCH_FORMS)
            rows.append(f"| {ep} x {tp} | {t} | {g:.2f} | {a:.2f} | {a / g:.2f} | {moved['all_gather'] / 2**10:.1f} | "
                        f"{moved['all_to_all'] / 2**10:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
