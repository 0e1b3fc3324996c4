"""AIPerf (NVIDIA's `aiperf` on PyPI) against a server: one short streamed profile per endpoint
type, chat (/v1/chat/completions), responses (/v1/responses) and messages (Anthropic's
/v1/messages), each with AIPerf's synthetic prompts of --isl tokens and --osl output tokens at
--concurrency, --requests requests after --warmup warm-up requests.

aiperf pins versions this project's environment does not take (pandas, rich, pyzmq, ...), so it
lives in its own venv (--aiperf, default ~/.cache/jaxserve/conformance/aiperf-venv, created with
`pip install aiperf==VERSION` when missing). Its prompts are counted with the served model's own
tokenizer: the embedded GGUF's, saved as a Hugging Face tokenizer folder by this project's
transformers (or --tokenizer). chat and responses also send `ignore_eos: true` (vLLM's extra,
which both routes take) so every answer is --osl tokens; Anthropic's Messages API has no such field
(and an unknown field is a 400 here), so messages answers may end earlier: AIPerf's output
sequence length says how long they were.

    python scripts/conformance/aiperf.py                          # starts `jaxserve serve` (embedded model)
    python scripts/conformance/aiperf.py --url http://127.0.0.1:8080/v1 --target llama-server --endpoints chat

Flags after `--` go to `jaxserve serve`. Writes docs/results/conformance-aiperf[-TARGET].json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import served  # noqa: E402

AIPERF_VERSION = "0.13.0"
IGNORE_EOS = {"chat", "responses"}
METRICS = ("request_throughput", "output_token_throughput", "time_to_first_token", "inter_token_latency",
           "request_latency", "output_sequence_length", "input_sequence_length")


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxserve", "conformance")


def find_aiperf(given: str | None, version: str) -> str:
    if given:
        return given
    venv = os.path.join(cache_dir(), "aiperf-venv")
    exe = os.path.join(venv, "bin", "aiperf")
    if not os.path.exists(exe):
        print(f"creating {venv} with aiperf=={version}", file=sys.stderr)
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", f"aiperf=={version}"], check=True)
    return exe


def embedded_tokenizer_dir() -> str:
    """The embedded GGUF's tokenizer as a Hugging Face tokenizer folder (made once)."""
    from jaxserve.bench.model_files import embedded_gguf_path

    gguf = embedded_gguf_path()
    out = os.path.join(cache_dir(), "tokenizer-" + os.path.splitext(os.path.basename(gguf))[0])
    if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
    return out


def profile(aiperf: str, url: str, model: str, endpoint: str, tokenizer: str, out_dir: str, args) -> dict:
    root = url[:-len("/v1")] if url.endswith("/v1") else url
    cmd = [aiperf, "profile", "--model", model, "--url", root, "--endpoint-type", endpoint, "--streaming",
           "--tokenizer", tokenizer, "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
           "--warmup-request-count", str(args.warmup), "--prompt-input-tokens-mean", str(args.isl),
           "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.osl),
           "--prompt-output-tokens-stddev", "0", "--random-seed", "1", "--artifact-dir", out_dir,
           "--ui-type", "none"]
    if endpoint in IGNORE_EOS:
        cmd += ["--extra-inputs", "ignore_eos:true"]
    print("running: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # not HF_HUB_OFFLINE: aiperf 0.13.0's offline path cannot load a tokenizer folder (HFValidationError); a
    # folder needs no hub either way
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = round(time.perf_counter() - t0, 1)
    found = glob.glob(os.path.join(out_dir, "**", "profile_export_aiperf.json"), recursive=True)
    if p.returncode != 0 or not found:
        return {"endpoint": endpoint, "ok": False, "returncode": p.returncode, "seconds": seconds,
                "tail": (p.stdout[-2000:] + p.stderr[-3000:])}
    with open(found[0]) as f:
        export = json.load(f)
    metrics = {k: export[k] for k in METRICS if isinstance(export.get(k), dict)}
    errors = export.get("error_summary") or []
    counts = {k: export[k] for k in ("request_count", "error_request_count") if k in export}
    return {"endpoint": endpoint, "ok": True, "seconds": seconds, "metrics": metrics, "counts": counts,
            "error_summary": errors, "ignore_eos": endpoint in IGNORE_EOS,
            "console": p.stdout[-6000:]}


def stat(m: dict, name: str, key: str = "avg") -> str:
    v = m.get(name, {}).get(key)
    return "-" if v is None else f"{v:.4g}"


def main(argv=None) -> int:
    argv, serve_extra = served.split_serve_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server's /v1 base URL (default: start `jaxserve serve` here)")
    p.add_argument("--target", default="jaxserve")
    p.add_argument("--endpoints", default="chat,responses,messages")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--aiperf", help="the aiperf command (default: its own venv in the cache, made when missing)")
    p.add_argument("--aiperf-version", default=AIPERF_VERSION)
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the embedded GGUF's)")
    p.add_argument("--artifacts", help="AIPerf's artifact folder (default: a temporary one)")
    p.add_argument("--out", help="result JSON (default docs/results/conformance-aiperf[-TARGET].json)")
    args = p.parse_args(argv)
    aiperf = find_aiperf(args.aiperf, args.aiperf_version)
    version = subprocess.run([os.path.join(os.path.dirname(aiperf), "python"), "-c",
                              "import importlib.metadata as m; print(m.version('aiperf'))"],
                             capture_output=True, text=True).stdout.strip() or args.aiperf_version
    tokenizer = args.tokenizer or embedded_tokenizer_dir()
    artifacts = args.artifacts or os.path.join("/tmp", f"aiperf-{args.target}-{int(time.time())}")
    runs = []
    t0 = time.perf_counter()
    prov = served.provenance([os.path.relpath(sys.argv[0], served.ROOT), *sys.argv[1:]])
    out = args.out or os.path.join(served.RESULTS, "conformance-aiperf.json" if args.target == "jaxserve"
                                   else f"conformance-aiperf-{args.target}.json")

    def result(model: str) -> dict:
        return {"suite": "aiperf", "aiperf": version, "target": args.target, "model": model,
                "settings": {"concurrency": args.concurrency, "requests": args.requests, "warmup": args.warmup,
                             "isl": args.isl, "osl": args.osl, "streaming": True, "tokenizer": tokenizer,
                             "serve_flags": serve_extra if not args.url else None, "url": args.url},
                **prov, "seconds": round(time.perf_counter() - t0, 1), "runs": runs}

    with served.jaxserve(serve_extra, url=args.url) as url:
        model = served.served_model(url)
        for endpoint in [e.strip() for e in args.endpoints.split(",") if e.strip()]:
            r = profile(aiperf, url, model, endpoint, tokenizer, os.path.join(artifacts, endpoint), args)
            runs.append(r)
            if r["ok"]:
                m = r["metrics"]
                print(f"{args.target} {endpoint:9s} req/s {stat(m, 'request_throughput')}  out tok/s "
                      f"{stat(m, 'output_token_throughput')}  TTFT ms p50 {stat(m, 'time_to_first_token', 'p50')} "
                      f"p99 {stat(m, 'time_to_first_token', 'p99')}  ITL ms p50 {stat(m, 'inter_token_latency', 'p50')}"
                      f"  latency ms p50 {stat(m, 'request_latency', 'p50')}  OSL avg "
                      f"{stat(m, 'output_sequence_length')}  errors {r['counts'].get('error_request_count', 0)}",
                      flush=True)
            else:
                print(f"{args.target} {endpoint:9s} FAILED (rc {r['returncode']}):\n{r['tail'][-1500:]}", flush=True)
            served.write_result("", result(model), out)     # after each endpoint: a cut-short run keeps its part
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
