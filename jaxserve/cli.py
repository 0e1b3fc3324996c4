"""`jaxserve generate | chat | convert | serve | client | bench | plan | router`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxserve.engine_args import add_engine_args, engine_kwargs_from_args


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args):
    from jaxserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def _make_llm(args, **defaults):
    from jaxserve import LLM

    kwargs = {**defaults, **engine_kwargs_from_args(args)}
    model = kwargs.pop("model", None)
    print("loading the model and compiling its step buckets (cached after the first run)...", file=sys.stderr)
    return LLM(model, **kwargs)


def cmd_generate(args) -> int:
    """The prompts are known before the first step, so the engine warms up only the steps they can
    need (builder.prepare_for_requests) rather than every step a server could need."""
    from jaxserve.engine.builder import prepare_for_requests

    params = _sampling_params(args)
    llm = _make_llm(args, warm_up="none")
    prompts = _prompts(llm.get_tokenizer(), args)
    if llm.config.compilation.warm_up == "none":
        requests = [llm.engine.input_processor.process(p, params) for p in prompts]
        prepare_for_requests(llm.engine, [(len(r.prompt_token_ids), r.max_tokens) for r in requests
                                          for _ in range(r.params.n)])
    outs = llm.generate(prompts, params)
    for prompt, out in zip(args.prompts, outs):
        c = out.outputs[0]
        print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]\n")
    return 0


def _prompts(tok, args) -> list:
    """The prompts as the engine takes them: text, or token ids after the chat template."""
    if args.raw or not getattr(tok, "chat_template", None):
        return list(args.prompts)
    prompts = []
    for p in args.prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        prompts.append({"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    return prompts


def cmd_chat(args) -> int:
    """Interactive chat; tokens are printed as they are generated."""
    from jaxserve.sampling_params import OutputKind
    import dataclasses

    params = dataclasses.replace(_sampling_params(args), output_kind=OutputKind.DELTA)
    llm = _make_llm(args)
    engine, tok = llm.engine, llm.get_tokenizer()
    history = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("jaxserve chat: an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        rid = engine.add_request(None, {"prompt_token_ids": list(ids)}, params)
        answer = []
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        answer.append(out.outputs[0].text)
                        print(out.outputs[0].text, end="", flush=True)
        except KeyboardInterrupt:
            engine.abort(rid)
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
    return 0


def cmd_convert(args) -> int:
    from jaxserve.quant.convert import convert

    out = convert(args.src, args.dst, quantization=args.quantization, group_size=args.quantization_group_size,
                  calibration_data=args.calibration_data)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="An LLM inference server in JAX.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate answers to prompts (chat template applied unless --raw)")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--raw", action="store_true", help="send the prompts as plain text, without the chat template")
    _sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    c.add_argument("--system", default=None, help="system prompt")
    _sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("convert", help="convert a GGUF file or HF directory to a jaxserve checkpoint")
    v.add_argument("src", help="GGUF file or HF directory ('embedded' for the default model)")
    v.add_argument("dst")
    v.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "fp8", "w8a8"),
                   help="store the decoder projections quantized (fp8 and w8a8 run a calibration pass first)")
    v.add_argument("--quantization-group-size", type=int, default=32, help="int4: inputs per scale (32 or 128)")
    v.add_argument("--calibration-data", default=None,
                   help="fp8, w8a8: text file to calibrate activation ranges on "
                        "(default: a built-in public-domain text)")
    v.set_defaults(func=cmd_convert)

    for module, fn in (("jaxserve.server.cli", "add_server_parsers"), ("jaxserve.bench.cli", "add_bench_parser"),
                       ("jaxserve.bench.cli", "add_plan_parser"),
                       ("jaxserve.router.cli", "add_router_parser")):
        try:
            mod = __import__(module, fromlist=[fn])
        except ModuleNotFoundError:
            continue
        getattr(mod, fn)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "command", None) == "convert" and args.src == "embedded":
        args.src = None
    try:
        rc = args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 2
    if argv is None and args.command == "generate":
        _exit_without_teardown(rc)
    return rc


def _exit_without_teardown(rc: int) -> None:
    """End a finished `jaxserve generate` process without the interpreter's teardown, which frees
    every object one by one (the executables, the KV arena, the tokenizer's vocabulary): 2.6-3.9 s
    after the answer was printed, under load on the 2-core CPU. Everything worth keeping is written
    by then (caches write their files whole before returning); only the output buffers and the
    log handlers need flushing. Only when run as a program (`argv` None): a caller of main() in
    this process keeps its interpreter."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
