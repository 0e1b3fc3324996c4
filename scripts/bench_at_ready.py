"""What a server gives the traffic that arrives the moment it says it is ready: output tokens per
second in the first window after ready, beside the same load once every bucket is warm.

    python scripts/bench_at_ready.py --start warm --output docs/results/at-ready.json \
        -- --max-num-seqs 8 --quantization w8a8 --quantize-lm-head

One `jaxserve serve` process (the embedded model unless the serve arguments name one), spawned the
way a user starts it. `--start cold` gives it empty compilation and start-up caches; `--start
warm` first primes them with a start that runs until every bucket is warm, then starts again on
them. As soon as its log says "jaxserve ready", `--streams` closed-loop clients (gRPC, each a
fresh prompt of `--prompt-len` random token ids, `--output-len` tokens, greedy, ignore_eos) run
for `--window-s` seconds; the tokens that arrive inside the window are counted. Then the script
waits for the log's "warm-up: all" (and, where start-up deferred its calibration to an idle
engine, for that to run: it would stall the window's steps) and runs the same window again. `--checkout DIR` runs another
checkout's code (jaxserve.bench.run_from_checkout), for a before/after on one machine.

A benchmark, not a test: the numbers depend on the machine and its load (recorded beside them);
the ratio of the two windows, taken minutes apart on the same process, is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)    # appended: the folder sched/ must not shadow the standard library's sched

from jaxserve.client import GenerationClient  # noqa: E402

READY = "jaxserve ready"
ALL_WARM = "warm-up: all"
PROVISIONAL = "provisional until this machine's timings are measured"   # engine/builder.py: calibration deferred
CALIBRATED = "calibrated while idle"      # engine/deferred_calibration.py: the deferred calibration ran
GUARD_S = 1800.0     # a start or a warm-up that never gets there ends the run instead of hanging it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, caches: list[str], log_path: str):
        self.port = _free_port()
        code = "import sys; from jaxserve.cli import main; sys.exit(main())"
        if args.checkout:
            cmd = [sys.executable, "-m", "jaxserve.bench.run_from_checkout", "--checkout", args.checkout,
                   "jaxserve.cli"]
        else:
            cmd = [sys.executable, "-c", code]
        cmd += ["--log-level", "INFO", "serve", "--port", str(self.port), *caches, *args.serve_args]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.spawned = time.monotonic()
        # cwd outside any checkout: a folder named sched/ must not shadow the standard library's
        self.proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def settled(self) -> float:
        """Seconds from the spawn until every bucket is warm and a deferred calibration has run
        (it runs on the step thread once the engine is idle: a window during it would time it)."""
        at = self.wait_for(ALL_WARM)
        if PROVISIONAL in open(self.log_path, errors="replace").read():
            at = self.wait_for(CALIBRATED)
        return at

    def wait_for(self, line: str) -> float:
        """Seconds from the spawn until the log holds `line`."""
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            if line in open(self.log_path, errors="replace").read():
                return time.monotonic() - self.spawned
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            time.sleep(0.05)
        raise RuntimeError(f"no {line!r} in {GUARD_S} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def window(port: int, args, seed: int) -> dict:
    """`streams` closed-loop clients for window_s seconds: tokens that arrived in the window."""
    start = time.perf_counter()
    end = start + args.window_s
    tokens: list[float] = []
    ttfts: list[float] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = np.random.default_rng([seed, i])
        with GenerationClient(f"127.0.0.1:{port}", timeout=GUARD_S) as c:
            while time.perf_counter() < end:
                prompt = rng.integers(3, 40_000, args.prompt_len).tolist()
                sent, first = time.perf_counter(), None
                for chunk in c.stream(prompt, max_tokens=args.output_len, temperature=0.0, ignore_eos=True):
                    now = time.perf_counter()
                    if now >= end:
                        break
                    if first is None and chunk.token_ids:
                        first = now
                        with lock:
                            ttfts.append(now - sent)
                    with lock:
                        tokens.extend([now] * len(chunk.token_ids))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"output_tokens": len(tokens), "output_tok_s": len(tokens) / args.window_s,
            "requests_started_first_token": len(ttfts),
            "ttft_median_s": statistics.median(ttfts) if ttfts else None}


def run(args) -> dict:
    scratch = tempfile.mkdtemp(prefix="jaxserve-at-ready-")
    caches = [f"--compilation-cache-dir={scratch}/xla", f"--cache-dir={scratch}/cache"]
    out: dict = {"start": args.start, "serve_args": args.serve_args, "checkout": args.checkout,
                 "streams": args.streams, "prompt_len": args.prompt_len, "output_len": args.output_len,
                 "window_s": args.window_s, "load_average_before": os.getloadavg()}
    if args.start == "warm":
        primer = Server(args, caches, os.path.join(scratch, "prime.log"))
        try:
            primer.settled()      # the caches then hold every bucket and this machine's timings
        finally:
            primer.stop()
    server = Server(args, caches, os.path.join(scratch, "serve.log"))
    try:
        out["ready_s"] = server.wait_for(READY)
        out["at_ready"] = window(server.port, args, seed=1)
        out["all_warm_s"] = server.wait_for(ALL_WARM)
        out["settled_s"] = server.settled()
        out["warm"] = window(server.port, args, seed=2)
        log = open(server.log_path, errors="replace").read()
        out["ready_line"] = next((ln for ln in log.splitlines() if READY in ln), "")
        out["caps"] = re.findall(r"warm-up: (\d+/\d+ buckets ready \([^)]*\))", log)
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    out["ratio"] = out["at_ready"]["output_tok_s"] / out["warm"]["output_tok_s"]
    out["load_average_after"] = os.getloadavg()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", choices=("cold", "warm"), default="warm")
    p.add_argument("--checkout", default=None, help="run this checkout's code (a before/after)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--window-s", type=float, default=90.0)
    p.add_argument("--output", default=None, help="append the result to this JSON list")
    p.add_argument("--keep", action="store_true", help="keep the caches and logs (printed)")
    p.add_argument("serve_args", nargs="*", help="after --: arguments for `jaxserve serve`")
    args = p.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.output:
        done = json.load(open(args.output)) if os.path.exists(args.output) else []
        json.dump(done + [result], open(args.output, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
