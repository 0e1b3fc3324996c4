"""The closing lines of scripts/gpu_bench.sh: batch-1 decode against HBM bandwidth, and saturation.

At batch 1 a decode step reads every weight once to produce one token, so

    implied weight-read bandwidth = weight bytes read per step / TPOT

where the bytes are those of every tensor in the model's safetensors files except the input
embedding table (a step reads one row of it; when the LM head is tied to it, it is read whole
and counted). The KV cache read at these context lengths is ignored: 256 tokens of Llama-3-8B
KV are 32 MiB against 15 GB of weights. The ratio to the GPU's peak HBM bandwidth says how close
decoding runs to the memory-bound limit.

    python -m jaxserve.bench.gpu_summary --model DIR --gpu-name NAME [--plots-dir D] RESULT.json...

RESULT.json files are `jaxserve bench latency` (batch 1 TPOT) and `jaxserve bench throughput`
(saturation) results, one or more backends each; lines are printed per backend.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import struct
import sys
from typing import Any

# Peak HBM bandwidth, bytes/s, from NVIDIA's H100 and H200 datasheets. Matched against the name
# nvidia-smi prints ("NVIDIA H200", "NVIDIA H100 80GB HBM3" for SXM, "NVIDIA H100 PCIe",
# "NVIDIA H100 NVL"); anything else is "unknown".
HBM_BANDWIDTH: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("H200",), "H200", 4.8e12),
    (("H100", "PCIE"), "H100 PCIe", 2.0e12),
    (("H100", "NVL"), "H100 NVL", 3.9e12),
    (("H100", "HBM3"), "H100 SXM", 3.35e12),
    (("H100", "SXM"), "H100 SXM", 3.35e12),
)

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def hbm_bandwidth(gpu_name: str | None) -> tuple[str, float | None]:
    """(label, peak bytes/s) of the GPU nvidia-smi names; (name or 'unknown', None) if not known."""
    upper = (gpu_name or "").upper()
    for words, label, bandwidth in HBM_BANDWIDTH:
        if all(w in upper for w in words):
            return label, bandwidth
    return (gpu_name or "unknown GPU"), None


def safetensors_sizes(model_dir: str) -> dict[str, int]:
    """Bytes of every tensor in the directory's safetensors files, read from their headers only."""
    sizes: dict[str, int] = {}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {model_dir}")
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                sizes[name] = end - begin
    return sizes


def decode_read_bytes(model_dir: str) -> int:
    """Weight bytes one batch-1 decode step reads (see the module docstring)."""
    sizes = safetensors_sizes(model_dir)
    skip = {EMBEDDING} if LM_HEAD in sizes else set()
    return sum(v for k, v in sizes.items() if k not in skip)


def _si(x: float, unit: str) -> str:
    """3.35e12, 'B/s' -> '3.35 TB/s' (decimal prefixes, as bandwidths are quoted)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def _fmt_bytes_s(x: float) -> str:
    return _si(x, "B/s")


def batch1_tpot(result: dict[str, Any]) -> dict[str, float]:
    """backend -> median TPOT (s) at batch 1 of a latency result."""
    out = {}
    for backend, points in (result.get("extra", {}).get("latency_sweep") or {}).items():
        for p in points:
            if p.get("batch_size") == 1 and p.get("tpot_median_s") is not None:
                out[backend] = float(p["tpot_median_s"])
    return out


def saturation(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """backend -> output and total tokens/s of a throughput result."""
    return {run["backend"]: {"output": run["metrics"]["output_throughput"], "total": run["metrics"]["total_throughput"]}
            for run in result.get("runs", [])}


def summary_lines(results: list[dict[str, Any]], model_dir: str, gpu_name: str | None) -> list[str]:
    weight_bytes = decode_read_bytes(model_dir)
    label, peak = hbm_bandwidth(gpu_name)
    tpot: dict[str, float] = {}
    sat: dict[str, dict[str, float]] = {}
    sat_workload = ""
    for res in results:
        if res.get("subcommand") == "latency":
            tpot.update(batch1_tpot(res))
        elif res.get("subcommand") == "throughput":
            sat.update(saturation(res))
            w = res.get("workload", {})
            sat_workload = (f" ({w.get('num_requests')} requests, {w.get('total_prompt_tokens'):,} prompt + "
                            f"{w.get('total_output_tokens'):,} output tokens)") if w.get("num_requests") else ""
    peak_text = _fmt_bytes_s(peak) if peak else "unknown"
    lines = [f"gpu_bench: weights read per decode step {_si(weight_bytes, 'B')} ({weight_bytes:,} bytes); "
             f"{label} peak HBM bandwidth {peak_text}"]
    for backend in sorted(set(tpot) | set(sat), key=lambda b: (b != "jaxserve", b)):
        parts = [f"gpu_bench: {backend}:"]
        if backend in tpot:
            t = tpot[backend]
            bw = weight_bytes / t
            share = f"{100 * bw / peak:.1f}% of {peak_text}" if peak else "peak unknown"
            parts.append(f"batch-1 TPOT {1e3 * t:.2f} ms ({1 / t:.1f} tok/s) -> weight reads at "
                         f"{_fmt_bytes_s(bw)} ({share});")
        else:
            parts.append("batch-1 TPOT n/a;")
        if backend in sat:
            parts.append(f"saturation {sat[backend]['output']:,.1f} output tok/s, "
                         f"{sat[backend]['total']:,.1f} total tok/s{sat_workload}")
        else:
            parts.append("saturation n/a")
        lines.append(" ".join(parts))
    return lines


def _merged(results: list[dict[str, Any]], subcommand: str) -> dict[str, Any] | None:
    """The runs of every result of one subcommand as one result (one backend per file here)."""
    picked = [res for res in results if res.get("subcommand") == subcommand]
    if not picked:
        return None
    return {"subcommand": subcommand, "workload": picked[0].get("workload", {}),
            "runs": [run for res in picked for run in res["runs"]]}


def combined_plots(results: list[dict[str, Any]], plots_dir: str, prefix: str = "gpu") -> list[str]:
    """All backends in one figure: saturation throughput bars and latency CDFs, batch-1 latency CDFs."""
    from jaxserve.bench import plots

    out = []
    throughput = _merged(results, "throughput")
    if throughput:
        out.append(plots.throughput_bars(throughput, os.path.join(plots_dir, f"{prefix}-throughput-all-bars.png")))
        out.append(plots.latency_cdfs(throughput, os.path.join(plots_dir, f"{prefix}-throughput-all-latency-cdfs.png")))
    latency = _merged(results, "latency")
    if latency:
        out.append(plots.latency_cdfs(latency, os.path.join(plots_dir, f"{prefix}-latency-all-latency-cdfs.png")))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.gpu_summary", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="*", help="latency and throughput result JSON files")
    p.add_argument("--model", required=True, help="the HF directory the results were measured on")
    p.add_argument("--gpu-name", default=None, help="as nvidia-smi prints it (selects the HBM peak)")
    p.add_argument("--plots-dir", default=None, help="also write the combined throughput plots here")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    for line in summary_lines(results, args.model, args.gpu_name):
        print(line)
    if args.plots_dir:
        try:
            for path in combined_plots(results, args.plots_dir):
                print(f"gpu_bench: wrote {path}")
        except ImportError as e:
            print(f"gpu_bench: no combined plots ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
