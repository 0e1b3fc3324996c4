"""Stream an answer from a running `jaxserve serve` (start one with `jaxserve serve`).

    python examples/grpc_client.py "Tell me about tides." --target 127.0.0.1:50051

The same in asyncio, several questions at once, with --concurrent.
"""

import argparse
import asyncio
import os
import sys

from jaxserve.client import AsyncGenerationClient, GenerationClient


def stream_one(args) -> None:
    with GenerationClient(args.target, api_key=os.environ.get("JAXSERVE_API_KEY")) as client:
        info = client.model_info()
        print(f"model {info.model_name} ({info.checkpoint_identity[:19]}), max_model_len {info.max_model_len}",
              file=sys.stderr)
        chat = [{"role": "user", "content": args.prompt}]
        for chunk in client.stream(chat, max_tokens=args.max_tokens, temperature=0.0):
            print(chunk.text, end="", flush=True)
        print()


async def ask_many(args) -> None:
    questions = [args.prompt, "What is a KV cache?", "Name three rivers."]
    async with AsyncGenerationClient(args.target, api_key=os.environ.get("JAXSERVE_API_KEY")) as client:
        answers = await asyncio.gather(*(
            client.generate([{"role": "user", "content": q}], max_tokens=args.max_tokens, temperature=0.0)
            for q in questions))
    for q, a in zip(questions, answers):
        print(f"### {q}\n{a.text}\n[{a.completion_tokens} tokens, {a.finish_reason}]\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("prompt", nargs="?", default="Tell me about tides.")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrent", action="store_true", help="ask several questions at once (asyncio client)")
    args = p.parse_args()
    asyncio.run(ask_many(args)) if args.concurrent else stream_one(args)
