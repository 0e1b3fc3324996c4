"""Comparative benchmarks: one workload through jaxserve and the PyTorch path, side by side.

`jaxserve bench {throughput, latency, prefix, interference, serve, report}` and `jaxserve plan`
(cli.py mounts them). A run: model_files resolves the one model file every backend loads,
workloads/arrivals make seeded requests, backends run them (dispatch releases timed ones),
metrics summarizes, results/summary/plots write the JSON, text and PNGs. docs/benchmarks.md
states the rules and the latest numbers.
"""
