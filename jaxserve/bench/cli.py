"""`jaxserve bench ...` and `jaxserve plan ...`: the parsers the lead's CLI (jaxserve/cli.py) mounts.

    def main(argv=None):
        parser = argparse.ArgumentParser(prog="jaxserve")
        sub = parser.add_subparsers(dest="command", required=True)
        add_bench_parser(sub)
        add_plan_parser(sub)
        args = parser.parse_args(argv)
        return args.func(args)

Each subcommand sets `func` (returns the exit status 0, for the CLI) and `bench_run` (returns the
result dict, for Python callers).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    from jaxserve.bench import (cmd_accuracy, cmd_host, cmd_interference, cmd_latency, cmd_lora, cmd_overlap,
                                cmd_prefix, cmd_report, cmd_rollout, cmd_serve, cmd_sweep, cmd_throughput)

    p = subparsers.add_parser("bench", help="comparative benchmarks (jaxserve against the PyTorch path)")
    sub = p.add_subparsers(dest="bench_command", required=True,
                           metavar="{throughput,latency,prefix,interference,serve,overlap,host,sweep,report,rollout,lora}")
    for mod in (cmd_throughput, cmd_latency, cmd_prefix, cmd_interference, cmd_serve, cmd_overlap, cmd_host,
                cmd_sweep, cmd_report, cmd_accuracy, cmd_rollout, cmd_lora):
        mod.add_parser(sub)
    return p


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    from jaxserve.bench import cmd_plan

    return cmd_plan.add_parser(subparsers)


def main(argv: list[str] | None = None) -> Any:
    """Stand-alone entry (`python -m jaxserve.bench.cli bench throughput ...`), same parsers."""
    parser = argparse.ArgumentParser(prog="jaxserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.bench_run(args)


if __name__ == "__main__":
    main()
