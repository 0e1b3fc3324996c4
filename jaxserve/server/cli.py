"""`jaxserve serve` (the gRPC server and the OpenAI-compatible HTTP API) and `jaxserve client PROMPT` (stream an answer in the terminal).

Registered into the main CLI by `add_server_parsers(subparsers)`; imports stay light until a
command runs, so `jaxserve --help` does not load jax.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxserve.engine_args import add_engine_args, engine_config_from_args, help_states_default

API_KEY_ENV = "JAXSERVE_API_KEY"


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends a flag's help with its default, once: not when the help already states it (the engine
    flags do, with EngineConfig's defaults) nor when the default is None (nothing to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if help_states_default(text) or action.default in (None, argparse.SUPPRESS):
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)"


def add_server_parsers(subparsers) -> None:
    s = subparsers.add_parser("serve", help="serve the model over gRPC and/or the OpenAI-compatible HTTP API",
                              formatter_class=_DefaultsHelpFormatter)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    g.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    g.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) "
                        "on this port, beside gRPC (0: pick a free one)")
    g.add_argument("--no-grpc", action="store_true", help="serve only the HTTP API (needs --http-port)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    g.add_argument("--metrics-names", default="both", choices=["both", "vllm", "jaxserve"],
                   help="the metric names /metrics shows: jaxserve's (jaxserve_...), vLLM's (vllm:num_requests_waiting, "
                        "vllm:kv_cache_usage_perc, ...: what llm-d and the Gateway API inference extension read) or "
                        "both (so such a router works with no setting, and jaxserve's own dashboards too)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'authorization: Bearer KEY' on every call but health (default: ${API_KEY_ENV})")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: serve TLS)")
    g.add_argument("--tls-key", default=None, help="PEM private key")
    g.add_argument("--max-concurrent-streams", type=int, default=256,
                   help="Generate calls served at once; more get RESOURCE_EXHAUSTED")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight streams get to finish after SIGTERM/SIGINT")
    g.add_argument("--max-message-bytes", type=int, default=None,
                   help="largest gRPC message and HTTP request body accepted (default: what max_model_len tokens can need, "
                        "max_model_len x 256 bytes + 1 MiB: 3 MiB for 8192 tokens)")
    g.add_argument("--max-n", type=int, default=1, help="largest SamplingParams.n accepted")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens accepted (default: max_model_len bounds it)")
    g.add_argument("--max-prompts", type=int, default=64,
                   help="most prompts in one /v1/completions request (a list of prompts)")
    g.add_argument("--max-input-tokens", type=int, default=None,
                   help="most input tokens in one request, summed over its prompts or embedding inputs (default: "
                        "--max-prompts x the longest prompt the engine can run)")
    g.add_argument("--max-embedding-inputs", type=int, default=4096,
                   help="most inputs in one embeddings request (HTTP /v1/embeddings, gRPC Embed)")
    g.add_argument("--embedding-window", type=int, default=2,
                   help="an embeddings request's inputs in the engine at once: small keeps other requests' "
                        "latency (a completion beside 3,000 inputs: 1.8x idle at 2), large runs the embeddings "
                        "faster (2.3x at 16)")
    g.add_argument("--http-header-timeout", type=float, default=10.0,
                   help="seconds an HTTP request's headers may take to arrive; the connection is closed after")
    g.add_argument("--http-body-timeout", type=float, default=60.0,
                   help="seconds an HTTP request's body may take to arrive; 408 after")
    g.add_argument("--lenient-api", action="store_true",
                   help="HTTP: accept unknown request fields (dropped, with a warning naming them) instead of a 400")
    g.add_argument("--chat-content-special-tokens", action="store_true",
                   help="special-token text typed into chat message contents becomes control tokens "
                        "(default: it is tokenized as text, so no user can forge a turn)")
    from jaxserve.reasoning_parsers.registry import REASONING_PARSERS
    from jaxserve.tool_parsers.registry import TOOL_PARSERS
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the format of the model's tool calls on /v1/chat/completions (default: the one its chat "
                        "template or architecture names: hermes for Qwen, llama3_json for Llama, mistral for Mistral)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's reasoning (qwen3: <think>...</think>) into message.reasoning "
                        "and reasoning_content (default: not split, the reasoning stays in content)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve from the start, each as `model` NAME on "
                        "HTTP and lora_name NAME on gRPC (needs --enable-lora; more at run time with "
                        "POST /v1/load_lora_adapter or the LoadLoRAAdapter RPC)")
    g.add_argument("--responses-store-size", type=int, default=1024,
                   help="finished /v1/responses kept in memory (least recently used dropped first) for "
                        "GET /v1/responses/{id} and previous_response_id; 0 keeps none")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    c = subparsers.add_parser("client", help="stream an answer from a running `jaxserve serve`",
                              formatter_class=_DefaultsHelpFormatter)
    c.add_argument("prompt")
    c.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    c.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")
    c.add_argument("--tls-root-cert", default=None, help="PEM root certificate to trust (enables TLS)")
    c.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    c.add_argument("--top-p", type=float, default=None)
    c.add_argument("--top-k", type=int, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    c.set_defaults(func=cmd_client)


def server_config_from_args(args: argparse.Namespace):
    from jaxserve.server.lora_adapters import parse_lora_modules
    from jaxserve.server.request_caps import RequestCaps
    from jaxserve.server.server import ServerConfig

    return ServerConfig(host=args.host, port=args.port, grpc=not args.no_grpc, http_port=args.http_port,
                        metrics_port=args.metrics_port,
                        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        tls_cert=args.tls_cert, tls_key=args.tls_key,
                        max_concurrent_streams=args.max_concurrent_streams, grace_period=args.grace_period,
                        max_message_bytes=args.max_message_bytes,
                        responses_store_size=args.responses_store_size,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        http_header_timeout=args.http_header_timeout, http_body_timeout=args.http_body_timeout,
                        lenient_api=args.lenient_api, chat_content_special_tokens=args.chat_content_special_tokens,
                        metrics_names=args.metrics_names,
                        lora_modules=tuple(parse_lora_modules(getattr(args, "lora_modules", None))),
                        limits=RequestCaps(max_n=args.max_n, max_tokens=args.max_tokens_limit,
                                           max_prompts=args.max_prompts,
                                           max_embedding_inputs=args.max_embedding_inputs,
                                           embedding_window=args.embedding_window,
                                           max_input_tokens=args.max_input_tokens))


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from jaxserve.server.server import run_server

    if getattr(args, "warm_up", None) is None:
        # a server turns ready once one request's steps are warm and warms the rest while it
        # serves (engine/warm_start.py); --warm-up all waits for every step
        args.warm_up = "background"
    engine_config = engine_config_from_args(args)
    config = server_config_from_args(args)
    ensure_info_handler()
    return asyncio.run(run_server(config, engine_config, progress=sys.stderr.isatty(), hard_exit_during_warmup=True))


def ensure_info_handler(logger: str = "jaxserve.server") -> None:
    """The root logger may sit at WARNING; a server's own INFO lines ("ready") still show."""
    lg = logging.getLogger(logger)
    if not any(isinstance(h, logging.StreamHandler) for h in lg.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        lg.addHandler(h)
        lg.propagate = False
    lg.setLevel(logging.INFO)


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from jaxserve.client import Completion, GenerationClient

    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed)
    result = Completion()
    with GenerationClient(args.target, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                          tls_root_cert=args.tls_root_cert, timeout=args.timeout) as client:
        try:
            for chunk in client.stream(prompt, completion=result, **sampling):
                print(chunk.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\n[cancelled]", file=sys.stderr)
            return 130
    print()
    print(f"[{result.completion_tokens} tokens, finish_reason={result.finish_reason}]", file=sys.stderr)
    return 0
