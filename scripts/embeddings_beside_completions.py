"""An embeddings body beside 1-token completions: the completions' latency idle and beside it.

Starts `--serve` (a `jaxserve serve` command line) on `--port` over HTTP, waits for /health,
times `--completions` 1-token /v1/completions one after another while idle, then sends one
/v1/embeddings body of `--inputs` copies of "hello there" and, from a second later, the same
completions one after another while it runs; prints one JSON line (medians, their ratio, how
long the body took) and, unless --no-over-cap, what a body over --max-embedding-inputs gets.

    python scripts/embeddings_beside_completions.py \
        --serve ".venv/bin/jaxserve serve --enable-embeddings --embedding-window 2" --port 8731
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import time

import httpx2 as httpx


async def measure(url: str, args) -> dict:
    async with httpx.AsyncClient(timeout=900) as c:
        model = (await c.get(url + "/models")).json()["data"][0]["id"]

        async def completion() -> float:
            t0 = time.perf_counter()
            r = await c.post(url + "/completions", json={"model": model, "prompt": "The weather today is",
                                                          "max_tokens": 1})
            r.raise_for_status()
            return time.perf_counter() - t0

        for _ in range(3):
            await completion()                   # first runs of the paths involved
        idle = [await completion() for _ in range(args.completions)]
        t0 = time.perf_counter()
        body = asyncio.ensure_future(c.post(url + "/embeddings", json={"model": model,
                                                                        "input": ["hello there"] * args.inputs}))
        await asyncio.sleep(1.0)
        beside = []
        while len(beside) < args.completions and not body.done():
            beside.append(await completion())
        answer = await body
        result = {"inputs": args.inputs, "idle_s": idle, "beside_s": beside,
                  "idle_median": statistics.median(idle),
                  "beside_median": statistics.median(beside) if beside else None,
                  "ratio": statistics.median(beside) / statistics.median(idle) if beside else None,
                  "embeddings_status": answer.status_code, "embeddings_s": time.perf_counter() - t0}
        if not args.no_over_cap:
            over = await c.post(url + "/embeddings", json={"model": model, "input": ["hello there"] * 10_000})
            result["over_cap"] = {"status": over.status_code, "error": over.json().get("error", {}).get("message")}
        return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", required=True, help="the server's command line (HTTP flags are added)")
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--inputs", type=int, default=3000)
    p.add_argument("--completions", type=int, default=7, help="completions timed idle and beside")
    p.add_argument("--no-over-cap", action="store_true", help="skip the 10,000-input body (an older server runs it)")
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen(shlex.split(args.serve) + ["--http-port", str(args.port), "--no-grpc"],
                            stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        deadline = time.time() + 1800
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise SystemExit("the server never turned healthy")
        time.sleep(20)   # the background warm-up's first buckets
        print(json.dumps(asyncio.run(measure(base + "/v1", args))))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
