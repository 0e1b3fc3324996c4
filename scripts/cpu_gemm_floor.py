"""The matmul floor of a CPU workload: XLA:CPU against torch on the model's own matmul shapes.

For each row count M it times the decoder stack's matmuls (per layer: fused qkv, o, fused
gate-up, down; random float32 weights, the default shapes are SmolLM2-135M's) plus the tied
lm_head, once through a jitted JAX function and once through torch, and prints both (median of
`--repeats`). With `--decode-steps` and `--prefill-tokens` it then sums a floor for a workload:
each decode step at the faster library's time for its rows, prefill at the faster library's
per-row time at `--prefill-rows` rows (no lm_head: only sampled rows need it). Attention,
norms, sampling and host work count as free, so real runs can only be slower.

  python scripts/cpu_gemm_floor.py --rows 1,8,32,128,512
  python scripts/cpu_gemm_floor.py --decode-steps 25:67,17:52,13:41,9:19,7:12,5:14,3:35,2:6,1:3 \\
      --prefill-tokens 9120 --output-tokens 4295

(The second line is the throughput workload's step trace on 2026-12-01, each bucket at the fewest
rows it can hold; see docs/benchmarks.md.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def parse_steps(text: str) -> dict[int, int]:
    """'25:67,17:52' -> {25: 67, 17: 52} (rows: number of steps)."""
    out = {}
    for part in filter(None, text.split(",")):
        try:
            rows, count = (int(v) for v in part.split(":"))
        except ValueError:
            raise ValueError(f"decode steps must be ROWS:STEPS pairs of integers, got {part!r}") from None
        if rows < 1 or count < 0:
            raise ValueError(f"decode steps need ROWS >= 1 and STEPS >= 0, got {part!r}")
        out[rows] = out.get(rows, 0) + count
    return out


def floor_seconds(best: dict[int, float], decode_steps: dict[int, int], prefill_tokens: int,
                  prefill_rows: int) -> tuple[float, float]:
    """(decode, prefill) seconds: each decode step at its rows' time, prefill in prefill_rows steps
    (a partial last step charged pro rata)."""
    decode = sum(count * best[rows] for rows, count in decode_steps.items())
    prefill = prefill_tokens / prefill_rows * best[prefill_rows] if prefill_tokens else 0.0
    return decode, prefill


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--qkv-width", type=int, default=960, help="(heads + 2 * kv heads) * head dim")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="", help="row counts to time, e.g. 1,8,32,512")
    p.add_argument("--decode-steps", default="", help="ROWS:STEPS,... of a workload's decode steps")
    p.add_argument("--prefill-tokens", type=int, default=0)
    p.add_argument("--prefill-rows", type=int, default=512, help="rows of a prefill step")
    p.add_argument("--output-tokens", type=int, default=0, help="to print the floor as tokens/s")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    try:
        decode_steps = parse_steps(a.decode_steps)
        rows = {int(r) for r in a.rows.split(",") if r}
    except ValueError as e:
        p.error(str(e))
    if any(r < 1 for r in rows) or a.prefill_rows < 1 or a.prefill_tokens < 0 or a.repeats < 1:
        p.error("--rows and --prefill-rows must be >= 1, --prefill-tokens >= 0, --repeats >= 1")

    import jax
    import jax.numpy as jnp
    import torch

    D, F, Q, L, V = a.hidden, a.intermediate, a.qkv_width, a.layers, a.vocab
    rng = np.random.default_rng(0)
    layers = [tuple(rng.standard_normal(s).astype(np.float32) * 0.02 for s in ((D, Q), (D, D), (D, 2 * F), (F, D)))
              for _ in range(L)]
    embedding = rng.standard_normal((V, D)).astype(np.float32) * 0.02

    def stack(ws, x):
        # the residual adds keep every layer's input dependent on the previous layer's output
        for qkv, o, gate_up, down in ws:
            x = x + (x @ qkv)[:, :D] @ o      # stands in for attention's output
            g = x @ gate_up
            x = x + (g[:, :F] * g[:, F:]) @ down
        return x

    jax_layers = jax.tree.map(jnp.asarray, layers)
    jax_embedding = jnp.asarray(embedding)
    jax_stack = jax.jit(stack)
    jax_head = jax.jit(lambda x, e: x @ e.T)
    torch_layers = [[torch.from_numpy(w) for w in ws] for ws in layers]
    torch_embedding = torch.from_numpy(embedding)

    wanted = sorted(rows | set(decode_steps)
                    | ({a.prefill_rows} if a.prefill_tokens else set()))
    best: dict[int, float] = {}
    print(f"{'rows':>6} {'xla ms':>9} {'torch ms':>9}   (stack + lm_head; lm_head skipped at the prefill rows)")
    for m in wanted:
        x = rng.standard_normal((m, D)).astype(np.float32)
        xj, xt = jnp.asarray(x), torch.from_numpy(x)
        with_head = not (a.prefill_tokens and m == a.prefill_rows)
        t_xla = median_seconds(lambda: jax_stack(jax_layers, xj).block_until_ready(), a.repeats)
        with torch.inference_mode():
            t_torch = median_seconds(lambda: stack(torch_layers, xt), a.repeats)
            if with_head:
                t_xla += median_seconds(lambda: jax_head(xj, jax_embedding).block_until_ready(), a.repeats)
                t_torch += median_seconds(lambda: xt @ torch_embedding.T, a.repeats)
        best[m] = min(t_xla, t_torch)
        print(f"{m:>6} {t_xla * 1e3:>9.1f} {t_torch * 1e3:>9.1f}", flush=True)

    if decode_steps or a.prefill_tokens:
        decode, prefill = floor_seconds(best, decode_steps, a.prefill_tokens, a.prefill_rows)
        line = f"matmul floor: decode {decode:.1f} s + prefill {prefill:.1f} s = {decode + prefill:.1f} s"
        if a.output_tokens:
            line += f" -> at most {a.output_tokens / (decode + prefill):.0f} output tok/s"
        print(line)


if __name__ == "__main__":
    main()
