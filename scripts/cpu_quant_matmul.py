"""A decode step's projections in each quantized form on this CPU, through models/linear.py's own
matmul: float32, int4 widened by XLA, int4 through the native kernel (cpu_kernels/int4_dot.cc),
w8a8 as the engine runs it (the native int8 dot up to its row limit), w8a8_xla (XLA's int8 dot
at every row count) and w8a8_native (the native dot at every row count: what the limit would
be measured by). One jitted function per form and row count runs every layer's
fused qkv, o, fused gate-up and down projection (random weights, SmolLM2-135M's shapes by
default), each layer's input depending on the last's output so XLA cannot overlap them, and with
--vocab an LM head in the same form. The programs take turns, one call each per round. Prints the
median ms of `--repeats` rounds and each form's ratio to w8a8, and the bytes each form's weights
hold.

  python scripts/cpu_quant_matmul.py --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def layer_weights(rng, hidden: int, intermediate: int, kv: int) -> list[np.ndarray]:
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    return [(rng.standard_normal(s) * 0.05).astype(np.float32) for s in shapes]


def leaves_for(form: str, w: np.ndarray):
    import jax.numpy as jnp

    from jaxserve.models.params import projection_leaves
    from jaxserve.quant.int4 import quantize_int4
    from jaxserve.quant.w8a8 import quantize_w8a8

    if form == "float32":
        return projection_leaves([w], jnp.float32)
    if form.startswith("int4"):
        return projection_leaves([quantize_int4(w, 32)], jnp.float32)
    # w8a8, w8a8_xla, w8a8_native: the same weights, traced differently
    smooth = np.ones(w.shape[1], np.float32)
    return projection_leaves([quantize_w8a8(w, smooth)], jnp.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv", type=int, default=192, help="K (= V) columns of the fused qkv")
    p.add_argument("--forms", default="float32,int4_xla,int4_native,w8a8")
    p.add_argument("--vocab", type=int, default=0, help="also an LM head of this many rows in the same form "
                   "(49152: SmolLM2's; 0: none)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--output-json")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from cpu_kernels import int8_dot
    from cpu_kernels.int8_dot import cpu_kernels
    from jaxserve.models.linear import matmul

    rng = np.random.default_rng(0)
    layers = [layer_weights(rng, args.hidden, args.intermediate, args.kv) for _ in range(args.layers)]
    head = (rng.standard_normal((args.vocab, args.hidden)) * 0.05).astype(np.float32) if args.vocab else None
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    row_counts = [int(r) for r in args.rows.split(",")]
    programs = {}              # (form, rows) -> (compiled, params, x, weight bytes)
    for form in forms:
        params = {"layers": [[leaves_for(form, w) for w in layer] for layer in layers]}
        if head is not None:
            params["head"] = leaves_for(form, head)
        nbytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))

        def step(params, x):
            for qkv, o, gate_up, down in params["layers"]:
                h = matmul(x, qkv, jnp.float32)[:, :args.hidden]
                h = matmul(h, o, jnp.float32)
                gu = matmul(h, gate_up, jnp.float32)
                x = x + matmul(jax.nn.silu(gu[:, :args.intermediate]) * gu[:, args.intermediate:], down, jnp.float32)
            return matmul(x, params["head"], jnp.float32) if "head" in params else x

        for rows in row_counts:
            x = jnp.asarray(rng.standard_normal((rows, args.hidden)).astype(np.float32))
            # w8a8_native: the kernel at every row count, past this CPU's crossover too
            limit = max(int8_dot.max_rows(), rows) if form == "w8a8_native" else None
            with cpu_kernels(form not in ("int4_xla", "w8a8_xla"), max_rows=limit):
                compiled = jax.jit(step).lower(params, x).compile()
            compiled(params, x).block_until_ready()
            programs[(form, rows)] = (compiled, params, x, nbytes)
    # the forms take turns, one call each per round: on a shared machine a slow minute then
    # slows every form alike instead of the one that happened to run in it
    times = {key: [] for key in programs}
    for _ in range(args.repeats):
        for key, (compiled, params, x, _) in programs.items():
            t0 = time.perf_counter()
            compiled(params, x).block_until_ready()
            times[key].append((time.perf_counter() - t0) * 1e3)
    results = []
    for (form, rows), (_, _, _, nbytes) in programs.items():
        results.append({"form": form, "rows": rows, "ms": statistics.median(times[(form, rows)]), "weight_bytes": nbytes})
        print(f"{form:12s} rows {rows:2d}  {results[-1]['ms']:7.2f} ms   weights {nbytes / 1e6:6.1f} MB", flush=True)
    base = {r["rows"]: r["ms"] for r in results if r["form"] == "w8a8"}
    if base:
        print("\nratio to w8a8 (median ms):")
        for r in results:
            print(f"  {r['form']:12s} rows {r['rows']:2d}  {r['ms'] / base[r['rows']]:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"command": "scripts/cpu_quant_matmul.py", "args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
