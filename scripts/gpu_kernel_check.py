"""Kernel tests on a real GPU: each compiled kernel against the reference, one line per case.

The CPU suite runs the kernels in interpreters; this runs the same cases (and a few larger,
realistic ones) compiled for the GPU, where ptxas and Mosaic GPU's own compile also check shared
memory, registers and layouts. Prints `kernel-check <impl> <case> max_err=... tol=... PASS|FAIL`
and exits non-zero if any case fails. Usage: python scripts/gpu_kernel_check.py [--full]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pallas_kernels"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernel_cases import TOLERANCES, Case, case, full_grid, make_inputs, with_options  # noqa: E402
from pallas_kernels import dispatch, ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.ragged_paged_attention_mosaic import ragged_paged_attention_mosaic  # noqa: E402
from pallas_kernels.ragged_paged_attention_triton import ragged_paged_attention_triton  # noqa: E402

KERNELS = {"mosaic": ragged_paged_attention_mosaic, "triton": ragged_paged_attention_triton}


def cases(full: bool) -> list[Case]:
    small = [
        case("decode", group=1, head_dim=64, dtype="bfloat16"),
        case("prefill", group=3, head_dim=128, dtype="float16", seed=1),
        case("mixed", group=4, head_dim=64, dtype="bfloat16", sliding_window=20, seed=2),
        case("mixed", group=8, head_dim=128, dtype="float16", soft_cap=3.0, seed=3),
        case("mixed", group=4, head_dim=128, dtype="float32", seed=4),
        with_options(case("prefill", group=4, head_dim=64, dtype="bfloat16", seed=5), block_size=64,
                     width=1, num_blocks=4),
    ]
    # Realistic: Llama-3-8B-shaped heads, 16-token blocks, long contexts, a ragged mixed batch.
    large = [
        Case(q_lens=(1,) * 8, kv_lens=(1, 15, 16, 17, 1000, 2048, 4095, 4096), num_kv_heads=8, group=4,
             head_dim=128, dtype="bfloat16", num_tokens=8, max_seqs=8, width=256, num_blocks=1100, seed=10),
        Case(q_lens=(1, 300, 1, 57), kv_lens=(3000, 300, 1, 1057), num_kv_heads=8, group=4, head_dim=128,
             dtype="bfloat16", num_tokens=384, max_seqs=8, width=192, num_blocks=600, seed=11),
        Case(q_lens=(1, 130), kv_lens=(5000, 4000), num_kv_heads=2, group=3, head_dim=64,
             dtype="float16", sliding_window=1024, num_tokens=256, max_seqs=4, width=512,
             num_blocks=600, seed=12),
    ]
    grid = full_grid() if full else []
    return small + large + grid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also the whole small grid")
    parser.add_argument("--interpret", action="store_true",
                        help="CPU interpreters, small cases only: a smoke test of this script")
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"device {device.device_kind} platform={device.platform} default_impl="
          f"{dispatch.default_implementation()}", flush=True)
    failures = 0
    for c in cases(args.full)[:2 if args.interpret else None]:
        inputs = make_inputs(c)
        with jax.default_matmul_precision("highest"):     # no TF32 in the source of truth
            want = np.asarray(ragged_paged_attention_reference(**inputs).astype("float32"))
        n = sum(c.q_lens)
        for name, kernel in KERNELS.items():
            used, _, _ = dispatch.choose(name, inputs["q"], inputs["k_cache"])
            if used != name:
                print(f"kernel-check {name:6s} {c.label()} declined (dispatch uses {used})", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                got = np.asarray(kernel(**inputs, interpret=args.interpret).astype("float32"))
            except Exception as e:  # one broken case must not hide the others
                failures += 1
                print(f"kernel-check {name:6s} {c.label()} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
                continue
            atol, rtol = TOLERANCES[c.dtype]
            err = np.abs(got - want)
            ok = (not np.isnan(got).any() and np.all(err <= atol + rtol * np.abs(want))
                  and np.all(got[n:] == 0))
            failures += not ok
            print(f"kernel-check {name:6s} {c.label()} max_err={np.nanmax(err):.2e} tol={atol:g}+{rtol:g}|ref| "
                  f"{'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f}s incl. compile)", flush=True)
    print(f"kernel-check summary: {failures} failing", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
