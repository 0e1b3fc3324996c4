"""`jaxserve bench accuracy`: perplexity and greedy agreement of each quantization mode.

Runs jaxserve/quant/accuracy.py's measurement on a model (default: the embedded SmolLM2) and
prints one row per mode: perplexity on the held-out text (default: the Gettysburg Address,
jaxserve/quant/data), its ratio to float32's, the share of float32's greedy tokens the mode
reproduces (teacher-forced, 8 prompts x 32 tokens), and the bytes of the decoder projections.
Accuracy, not speed: nothing here is timed, so machine load does not change the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict
from typing import Any


def add_parser(sub: Any) -> None:
    from jaxserve.quant.modes import MODES

    p = sub.add_parser("accuracy", help="perplexity and greedy-token agreement of each quantization mode",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M GGUF)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (float32 always runs)")
    p.add_argument("--heldout", default=None, help="held-out text file (default: the built-in one)")
    p.add_argument("--calibration-data", default=None, help="calibration text (default: the built-in one)")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.set_defaults(func=run, bench_run=bench_run)


def bench_run(args) -> dict:
    """The results as a dict (for Python callers); also printed and written like `run`."""
    run(args)
    return _LAST


_LAST: dict = {}


def run(args) -> int:
    from jaxserve.quant.accuracy import measure_accuracy

    heldout = None
    if args.heldout:
        with open(args.heldout, encoding="utf-8") as f:
            heldout = f.read()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = measure_accuracy(modes, source=args.model, heldout_text=heldout,
                               calibration_data=args.calibration_data)
    print(f"{'mode':18s} {'perplexity':>10s} {'vs fp32':>8s} {'greedy match':>12s}")
    for r in results:
        print(f"{r.mode:18s} {r.perplexity:10.3f} {100 * (r.ppl_ratio - 1):+7.2f}% {100 * r.greedy_match:11.1f}%")
    out = {"model": args.model or "embedded", "results": [asdict(r) for r in results],
           "environment": {"load_average": os.getloadavg(), "cpu": platform.processor()}}
    _LAST.clear()
    _LAST.update(out)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
