"""Two measurements for issue 21, on the embedded model (or --model), in one process:

1. The cost of structured output: the same chat prompts, greedy, with a JSON schema and then
   without one, each request making as many tokens as it did with the schema (EOS ignored), arms
   alternated for --rounds rounds on one engine; output tok/s, mean TPOT and the host time
   llguidance spends filling masks. (The schema arm also runs without the one-step-ahead overlap,
   which a grammar's mask needs: that is part of its cost.)
2. The HTTP front's overhead against gRPC on one stream: the same greedy request streamed through
   the OpenAI-compatible API (the official client) and through gRPC (jaxserve.client), in turn,
   --stream-rounds times each, both fronts served in-process on one AsyncEngine over loopback;
   client-side TTFT, mean gap between chunks and total time.

    .venv/bin/python scripts/bench_structured_http.py [--model PATH] [--rounds 2] [--stream-rounds 5]

Not a test: it prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 200},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
        "mood": {"enum": ["calm", "rough", "unknown"]},
    },
    "required": ["topic", "summary", "facts", "mood"],
    "additionalProperties": False,
}
QUESTIONS = ["Tell me about tides.", "Describe a paged KV cache.", "What is continuous batching?",
             "Explain the moon's pull on the sea.", "Summarise how a compiler works.", "What makes a good map?",
             "Describe a lighthouse at night.", "How do bees find flowers?"]


def timed_fill():
    """Count the host time llguidance spends filling token masks."""
    from jaxserve.runner import token_mask

    spent = {"s": 0.0, "rows": 0}
    fill = token_mask.TokenConstraint.fill

    def counting(self, row):
        t = time.perf_counter()
        fill(self, row)
        spent["s"] += time.perf_counter() - t
        spent["rows"] += 1

    token_mask.TokenConstraint.fill = counting
    return spent


def arm(llm, params, n_requests):
    """params: one SamplingParams for all requests, or one per request."""
    convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}] for i in range(n_requests)]
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(o.metrics.token_times[-1] - o.metrics.token_times[0]) / (len(o.metrics.token_times) - 1)
             for o in outs if len(o.metrics.token_times) > 1]
    return wall, tokens, statistics.mean(tpots), outs


def structured_cost(llm, rounds: int, n_requests: int, max_tokens: int):
    import jsonschema

    from jaxserve import SamplingParams
    from jaxserve.structured_outputs import StructuredOutputs

    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    schema = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA))
    spent = timed_fill()
    arm(llm, plain, 2), arm(llm, schema, 2)          # warm: llguidance's tokenizer, first masks
    rows = []
    for r in range(rounds):
        # the schema arm first; the other then makes exactly as many tokens per request (EOS
        # ignored), so both arms carry the same batch through the same lengths
        lengths = None
        for name in ("JSON schema", "no schema"):
            params = schema if name == "JSON schema" else [
                SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
            spent.update(s=0.0, rows=0)
            wall, tokens, tpot, outs = arm(llm, params, n_requests)
            if lengths is None:
                lengths = [len(o.outputs[0].token_ids) for o in outs]
            valid = ""
            if name == "JSON schema":
                ok = 0
                for o in outs:
                    try:
                        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                        ok += 1
                    except Exception:   # noqa: BLE001 - counted, not raised
                        pass
                valid = f"{ok}/{len(outs)}"
            mask_ms = 1000 * spent["s"] / spent["rows"] if spent["rows"] else 0.0
            rows.append((r + 1, name, wall, tokens, tokens / wall, 1000 * tpot, mask_ms, valid))
    return rows


def stream_overhead(llm, rounds: int, max_tokens: int):
    """gRPC and HTTP on one AsyncEngine in a server thread; the clients in this thread."""
    import grpc.aio
    import openai

    from jaxserve import LLM
    from jaxserve.client import GenerationClient
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.request_caps import RequestCaps
    from jaxserve.server.http.app import create_app
    from jaxserve.server.http.listener import HTTPListener
    from jaxserve.server.http.openai_front import OpenAIFront
    from jaxserve.proto import generation_pb2_grpc as pb_grpc
    from jaxserve.server.servicer import GenerationServicer
    from jaxserve.server.state import Phase, ServerState

    engine = LLM.sharing_runner(llm).engine
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    state = ServerState()

    async def start():
        state.aengine = AsyncEngine(engine)
        state.aengine.start()
        state.phase = Phase.SERVING
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(
            GenerationServicer(state, max_concurrent_streams=8, limits=RequestCaps()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        http = HTTPListener(create_app(OpenAIFront(state, limits=RequestCaps(), metrics=None,
                                                   max_concurrent_streams=8)), "127.0.0.1", 0)
        await http.start()
        return server, port, http

    server, grpc_port, http = asyncio.run_coroutine_threadsafe(start(), loop).result()
    prompt = "The tide comes in twice a day, pulled by the moon and the sun."
    results = {"gRPC": [], "HTTP": []}
    with GenerationClient(f"127.0.0.1:{grpc_port}", timeout=600) as g, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="none", timeout=600) as o:
        def via_grpc():
            t0 = time.perf_counter()
            times = [time.perf_counter() for _ in g.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True)]
            return t0, times

        def via_http():
            t0 = time.perf_counter()
            times = [time.perf_counter() for c in o.completions.create(
                model=engine.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) if c.choices and c.choices[0].text]
            return t0, times

        via_grpc(), via_http()   # warm both paths
        for _ in range(rounds):
            for name, fn in (("gRPC", via_grpc), ("HTTP", via_http)):
                t0, times = fn()
                gaps = [b - a for a, b in zip(times, times[1:])]
                results[name].append((times[0] - t0, statistics.mean(gaps), times[-1] - t0, len(times)))
    asyncio.run_coroutine_threadsafe(http.stop(), loop).result()
    asyncio.run_coroutine_threadsafe(state.aengine.shutdown(), loop).result()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--stream-rounds", type=int, default=5)
    ap.add_argument("--stream-tokens", type=int, default=64)
    args = ap.parse_args()

    from jaxserve import LLM

    llm = LLM(args.model)
    print(f"model {llm.engine.model_name}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n| round | arm | s | output tokens | output tok/s | mean TPOT ms | mask ms per row | valid |")
    print("|---|---|---|---|---|---|---|---|")
    rows = structured_cost(llm, args.rounds, args.requests, args.max_tokens)
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.2f} | {r[7]} |")
    for name in ("no schema", "JSON schema"):
        print(f"median {name}: {statistics.median(r[4] for r in rows if r[1] == name):.1f} tok/s, "
              f"TPOT {statistics.median(r[5] for r in rows if r[1] == name):.1f} ms")

    res = stream_overhead(llm, args.stream_rounds, args.stream_tokens)
    print(f"\n| front | TTFT ms (median of {args.stream_rounds}) | mean gap ms | total s | chunks |")
    print("|---|---|---|---|---|")
    for name, runs in res.items():
        print(f"| {name} | {1000 * statistics.median(r[0] for r in runs):.1f} | "
              f"{1000 * statistics.median(r[1] for r in runs):.1f} | {statistics.median(r[2] for r in runs):.2f} | "
              f"{runs[0][3]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
