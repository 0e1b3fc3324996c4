"""Start-up benchmark: how long `jaxserve generate` takes to answer and `jaxserve serve` to say it
is ready, from empty caches (cold) and from the caches a first start left (warm).

    python scripts/bench_startup.py --repeats 3 --output docs/results/startup.json \
        -- --max-model-len 512 --max-num-seqs 4

Each start is a fresh process, run the way a user runs it, with `--log-level INFO`; the wall clock
is taken from spawning it to its exit (generate: the answer is printed) or to its log line
"jaxserve ready" (serve). A server that warms its other buckets in the background after it is
ready (warm_up="background", `serve`'s default) then runs until it logs that all are ready
("all warm s": from the spawn; with --no-wait-all-warm it is stopped at ready, and a cold start
then leaves a partly filled cache for the warm ones); then it is stopped with SIGTERM. The per-phase seconds come from the
start-up line the engine logs (jaxserve.engine.startup_timings); "outside build" is the wall clock
the build does not account for: the interpreter and imports, tokenizing, generating, exiting.
Cold starts get empty `--compilation-cache-dir` and `--cache-dir` folders; the warm starts of a
mode reuse the folders its cold start filled. A benchmark, not a test: numbers depend on the
machine and its load, so each run records the load average before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)    # appended: the folder sched/ must not shadow the standard library's sched

from jaxserve.engine.startup_timings import StartupTimings  # noqa: E402

READY = "jaxserve ready"
ALL_WARM = "warm-up: all"                 # engine/background_warmup.py, once every bucket is ready
WARM_UP_ENDED = ("warm-up stopped", ALL_WARM)
BACKGROUND = "warming in the background"  # the ready line of a server that is still warming
DEFAULT_PROMPT = "Tell me about tides."


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    jaxserve = shlex.split(args.jaxserve)
    root = args.caches or tempfile.mkdtemp(prefix="jaxserve-startup-", dir=args.scratch)
    runs, started = [], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    for mode in args.modes.split(","):
        caches = [f"--compilation-cache-dir={os.path.join(root, mode, 'xla')}",
                  f"--cache-dir={os.path.join(root, mode, 'cache')}"]
        for kind, repeats in (("cold", args.cold_repeats), ("warm", args.repeats)):
            for i in range(repeats):
                if kind == "cold" and i:       # every cold start from empty folders
                    caches = [c + f"-{i}" for c in caches]
                run = _start(jaxserve, mode, args, caches + args.engine_args)
                run.update(kind=kind, round=i)
                runs.append(run)
                print(_row(run), flush=True)
    summary = _summary(runs)
    result = {"command": "python scripts/bench_startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "prompt": args.prompt, "max_tokens": args.max_tokens, "engine_args": args.engine_args,
              "environment": {**_environment(), "started_utc": started}, "runs": runs, "medians": summary}
    print()
    print(markdown_table(summary))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.output}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="warm starts per mode")
    p.add_argument("--cold-repeats", type=int, default=1, help="cold starts per mode (each compiles everything)")
    p.add_argument("--modes", default="generate,serve")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--jaxserve", default=f"{shlex.quote(sys.executable)} -m jaxserve.cli",
                   help="the command that runs jaxserve")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a start is given up")
    p.add_argument("--scratch", default=None, help="where the cold starts' cache folders go (default: $TMPDIR)")
    p.add_argument("--caches", default=None,
                   help="use the cache folders an earlier run left here (its MODE/xla, MODE/cache), e.g. with "
                        "--cold-repeats 0 to time warm starts only")
    p.add_argument("--output", default=None, help="JSON results file")
    p.add_argument("--no-wait-all-warm", dest="wait_all_warm", action="store_false",
                   help="serve: stop a server at ready, without waiting for its background warm-up")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: engine flags for both commands")
    return p


def _start(jaxserve: list[str], mode: str, args, engine_args: list[str]) -> dict:
    engine_args = [a for a in engine_args if a != "--"]
    if mode == "generate":
        cmd = jaxserve + ["--log-level", "INFO", "generate", args.prompt, "--max-tokens", str(args.max_tokens)]
    else:
        cmd = jaxserve + ["--log-level", "INFO", "serve", "--port", "0"]
    cmd += engine_args
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    load = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines, wall, all_warm = [], None, None
    try:
        if mode == "generate":
            out, err = proc.communicate(timeout=args.timeout)
            wall = time.perf_counter() - t0
            lines = err.splitlines()
            if proc.returncode:
                raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{err[-3000:]}")
            answer = out.strip()
        else:
            answer = ""
            deadline = t0 + args.timeout
            for line in proc.stderr:
                lines.append(line.rstrip("\n"))
                if READY in line:
                    wall = time.perf_counter() - t0
                    if not (args.wait_all_warm and BACKGROUND in line):
                        break
                if wall is not None and any(m in line for m in WARM_UP_ENDED):
                    if ALL_WARM in line:
                        all_warm = time.perf_counter() - t0
                    break
                if time.perf_counter() > deadline:
                    break
            proc.send_signal(signal.SIGTERM)
            rest, _ = proc.communicate(timeout=120)
            if wall is None:
                raise RuntimeError(f"{cmd} never said {READY!r}:\n" + "\n".join(lines[-40:]) + (rest or "")[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    timings = _last_timings(lines)
    return {"mode": mode, "command": shlex.join(cmd), "wall_s": wall, "all_warm_s": all_warm,
            "load_average_1m": load[0],
            "startup": None if timings is None else {**timings.phases(), "total": timings.total},
            "outside_build_s": None if timings is None else wall - timings.total,
            "log": [ln for ln in lines if "start-up" in ln or "calibration" in ln or "warmed" in ln
                    or READY in ln or "not loaded ahead" in ln or "warm-up" in ln],
            "answer": answer}


def _last_timings(lines: list[str]) -> StartupTimings | None:
    found = [ln for ln in lines if re.search(rf"{StartupTimings.PREFIX} [0-9.]+ s: ", ln)]
    return StartupTimings.parse(found[-1]) if found else None


def _summary(runs: list[dict]) -> list[dict]:
    out = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        for kind in ("cold", "warm"):
            group = [r for r in runs if r["mode"] == mode and r["kind"] == kind]
            if not group:
                continue
            warm_all = [r["all_warm_s"] for r in group if r.get("all_warm_s") is not None]
            row = {"mode": mode, "kind": kind, "runs": len(group),
                   "wall_s": statistics.median(r["wall_s"] for r in group),
                   "all_warm_s": statistics.median(warm_all) if warm_all else None,
                   "load_average_1m": statistics.median(r["load_average_1m"] for r in group)}
            timed = [r for r in group if r["startup"]]
            for name in StartupTimings.phase_names() + ("total",):
                row[name] = statistics.median(r["startup"][name] for r in timed) if timed else None
            row["outside_build_s"] = statistics.median(r["outside_build_s"] for r in timed) if timed else None
            out.append(row)
    return out


def markdown_table(summary: list[dict]) -> str:
    phases = StartupTimings.phase_names()
    head = ["start", "runs", "wall s", "all warm s", *phases, "build total", "outside build", "load avg"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary:
        cells = [f"`{r['mode']}` {r['kind']}", str(r["runs"]), f"{r['wall_s']:.1f}", _num(r.get("all_warm_s")),
                 *(_num(r[p]) for p in phases), _num(r["total"]), _num(r["outside_build_s"]),
                 f"{r['load_average_1m']:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _row(run: dict) -> str:
    s = run["startup"] or {}
    warm = f", all warm at {run['all_warm_s']:.1f} s" if run.get("all_warm_s") is not None else ""
    return (f"{run['mode']:8s} {run['kind']} #{run['round']}: {run['wall_s']:.1f} s wall{warm}, build "
            f"{s.get('total', float('nan')):.1f} s, load {run['load_average_1m']:.1f}")


def _environment() -> dict:
    from jaxserve.runner.fingerprint import cpu_model

    import importlib.metadata
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": importlib.metadata.version("jax"), "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


if __name__ == "__main__":
    sys.exit(main())
