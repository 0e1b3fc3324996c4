"""BFCL (the Berkeley Function-Calling Leaderboard, `bfcl-eval` on PyPI) against a server's
/v1/chat/completions: its local single-turn categories simple, multiple, parallel and
irrelevance (no API key), under tool_choice "required" and "auto".

Two measures per category and mode:

- **validity**, this script's: every tool call the server emits is parsed (its `arguments` a JSON
  object), names one of the request's functions, and validates (jsonschema, Draft 2020-12) against
  that function's parameters as sent. Under "required" the server constrains the answer to the
  tools' schemas, so the target is 100%. Answers cut by max_tokens are counted apart (a cut call's
  arguments stop where the budget did).
- **BFCL's AST accuracy**, BFCL's own checker (`bfcl_eval.eval_checker.ast_eval.ast_checker`, used as
  a library on BFCL's shipped question and possible-answer files) on the calls as BFCL's OpenAI
  function-calling handler decodes them (`[{name: json.loads(arguments)}]`); irrelevance counts an
  answer right when it has no call, as BFCL's relevance runner does. Under "required" an
  irrelevance answer always has a call, so its accuracy there is 0 by construction.

The request is the one BFCL's OpenAI FC handler sends: the case's messages, its functions as
OpenAI tools (BFCL's types mapped to JSON Schema's with BFCL's own table, GORILLA_TO_OPENAPI; dots
in names replaced by underscores, as BFCL does for OpenAI, and its checker maps back), no system
prompt, parallel_tool_calls left at the default (true); temperature 0 (BFCL: 0.001).

bfcl-eval pins numpy 1.26, sentence-transformers, faiss, vllm's and several vendors' SDKs, which
this project's environment does not take; only its data and the AST checker are used, so the
package is installed with --no-deps into its own folder (--bfcl-dir) and found there. The checker
module imports BFCL's model table (which imports every vendor's SDK) for one flag,
`underscore_to_dot`; a stand-in table answers True for the model under test, as BFCL's table does
for OpenAI-style FC models.

    python scripts/conformance/bfcl.py                        # starts `jaxserve serve` (embedded model)
    python scripts/conformance/bfcl.py --url http://127.0.0.1:8080/v1 --target llama-server
    python scripts/conformance/bfcl.py --per-category 50 --modes required -- --max-num-seqs 8

Flags after `--` go to `jaxserve serve`. Prints a table and writes docs/results/conformance-bfcl-TARGET.json.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import importlib
import json
import os
import subprocess
import sys
import time
import types

import httpx2 as httpx
import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import served  # noqa: E402

BFCL_VERSION = "2026.3.23"
# category -> BFCL's file stem (v4: "simple" is simple_python)
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel", "irrelevance": "irrelevance"}


# ---- bfcl-eval: its data and AST checker -------------------------------------------------------

def bfcl_dir_default(version: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "jaxserve", "conformance", f"bfcl-eval-{version}")


def load_bfcl(bfcl_dir: str, version: str):
    """The bfcl_eval package from its folder, installed there (--no-deps) when missing; returns
    (package root, ast_checker module, type_mappings module)."""
    if not os.path.isdir(os.path.join(bfcl_dir, "bfcl_eval")):
        print(f"installing bfcl-eval=={version} (--no-deps) into {bfcl_dir}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", bfcl_dir,
                        f"bfcl-eval=={version}"], check=True)
    if bfcl_dir not in sys.path:
        sys.path.append(bfcl_dir)      # appended: the folder holds only bfcl_eval
    importlib.import_module("bfcl_eval.constants")

    class _FCModel:                    # BFCL's ModelConfig, as far as the checker reads it
        underscore_to_dot = True
    stand_in = types.ModuleType("bfcl_eval.constants.model_config")
    stand_in.MODEL_CONFIG_MAPPING = collections.defaultdict(_FCModel)
    sys.modules.setdefault("bfcl_eval.constants.model_config", stand_in)
    checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    mappings = importlib.import_module("bfcl_eval.constants.type_mappings")
    enums = importlib.import_module("bfcl_eval.constants.enums")
    root = os.path.join(bfcl_dir, "bfcl_eval")
    return root, checker, mappings, enums


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sample(rows: list, n: int | None) -> list:
    """n cases spread evenly over the category (its order groups similar cases), or all."""
    if not n or n >= len(rows):
        return rows
    step = len(rows) / n
    return [rows[int(i * step)] for i in range(n)]


def load_cases(root: str, category: str, n: int | None) -> list[dict]:
    stem = CATEGORIES[category]
    questions = read_jsonl(os.path.join(root, "data", f"BFCL_v4_{stem}.json"))
    answers_path = os.path.join(root, "data", "possible_answer", f"BFCL_v4_{stem}.json")
    answers = {a["id"]: a["ground_truth"] for a in read_jsonl(answers_path)} if os.path.exists(answers_path) else {}
    cases = sample(questions, n)
    for c in cases:
        c["ground_truth"] = answers.get(c["id"])
    return cases


# ---- the request -------------------------------------------------------------------------------

def json_schema_of(node, mapping: dict):
    """BFCL's parameter schema -> JSON Schema: every `type` through BFCL's GORILLA_TO_OPENAPI
    (an unknown one as string, as BFCL does), recursively through properties and items."""
    if isinstance(node, list):
        return [json_schema_of(x, mapping) for x in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if isinstance(out.get("type"), str):
        out["type"] = mapping.get(out["type"], "string")
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: json_schema_of(v, mapping) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = json_schema_of(out[key], mapping)
    return out


def openai_tools(functions: list[dict], mapping: dict) -> list[dict]:
    tools = []
    for f in functions:
        params = json_schema_of(copy.deepcopy(f["parameters"]), mapping)
        params["type"] = "object"
        tools.append({"type": "function", "function": {"name": f["name"].replace(".", "_"),
                                                       "description": f.get("description", ""),
                                                       "parameters": params}})
    return tools


def ask(client: httpx.Client, url: str, model: str, case: dict, tools: list[dict], mode: str, args) -> dict:
    body = {"model": model, "messages": case["question"][0], "tools": tools, "tool_choice": mode,
            "temperature": 0, "max_tokens": args.max_tokens}
    if args.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = args.parallel_tool_calls == "true"
    t0 = time.perf_counter()
    r = client.post(url + "/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return {"http_status": r.status_code, "error": r.text[:500], "seconds": seconds}
    choice = r.json()["choices"][0]
    msg = choice["message"]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in msg.get("tool_calls") or []]
    return {"http_status": 200, "finish_reason": choice["finish_reason"], "content": msg.get("content"),
            "tool_calls": calls, "seconds": seconds, "completion_tokens": r.json()["usage"]["completion_tokens"]}


# ---- the measures ------------------------------------------------------------------------------

def call_validity(calls: list[dict], tools: list[dict]) -> list[str | None]:
    """Per call: None when it parses and validates, else why not."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for c in calls:
        if c["name"] not in schemas:
            out.append(f"unknown function {c['name']!r}")
            continue
        try:
            args = json.loads(c["arguments"])
        except json.JSONDecodeError as e:
            out.append(f"arguments are not JSON: {e}")
            continue
        if not isinstance(args, dict):
            out.append("arguments are not a JSON object")
            continue
        err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schemas[c["name"]]).iter_errors(args))
        out.append(None if err is None else f"schema: {err.message[:200]}")
    return out


def ast_verdict(checker, enums, case: dict, category: str, answer: dict, model_name: str) -> dict:
    """BFCL's verdict on the answer, as its eval runner reaches it for an OpenAI FC model."""
    calls = answer.get("tool_calls") or []
    if category == "irrelevance":
        return {"valid": not calls}
    if not calls:
        return {"valid": False, "error_type": "ast_decoder:decoder_failed"}
    try:
        decoded = [{c["name"]: json.loads(c["arguments"])} for c in calls]
    except json.JSONDecodeError:
        return {"valid": False, "error_type": "ast_decoder:decoder_failed"}
    if not all(isinstance(list(d.values())[0], dict) for d in decoded):
        return {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format"}
    r = checker.ast_checker(case["function"], decoded, case["ground_truth"], enums.Language.PYTHON,
                            CATEGORIES[category], model_name)
    return {"valid": bool(r["valid"]), "error_type": r.get("error_type")}


def run_category(url, model, category, mode, cases, mappings, checker, enums, args) -> dict:
    tools_of = {c["id"]: openai_tools(c["function"], mappings.GORILLA_TO_OPENAPI) for c in cases}
    with httpx.Client(timeout=args.request_timeout) as client, \
            concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(lambda c: ask(client, url, model, c, tools_of[c["id"]], mode, args), cases))
    s = collections.Counter()
    errors, ast_errors, rows = collections.Counter(), collections.Counter(), []
    for case, a in zip(cases, answers):
        s["cases"] += 1
        if a["http_status"] != 200:
            s["http_errors"] += 1
            errors[f"HTTP {a['http_status']}: {a['error'][:120]}"] += 1
            rows.append({"id": case["id"], **a})
            continue
        cut = a["finish_reason"] == "length"
        s["cut_answers"] += cut
        s["answers_with_calls"] += bool(a["tool_calls"])
        s["content_with_call_marker"] += bool(a["content"] and "<tool_call>" in a["content"])
        verdicts = call_validity(a["tool_calls"], tools_of[case["id"]])
        for v in verdicts:
            key = "cut" if cut else "finished"
            s[f"calls_{key}"] += 1
            s[f"valid_calls_{key}"] += v is None
            if v is not None:
                errors[("(cut) " if cut else "") + v.split(":")[0]] += 1
        verdict = ast_verdict(checker, enums, case, category, a, model)
        s["ast_correct"] += verdict["valid"]
        if not verdict["valid"]:
            ast_errors[verdict.get("error_type") or "no call expected, one made"] += 1
        s["completion_tokens"] += a["completion_tokens"]
        rows.append({"id": case["id"], "finish_reason": a["finish_reason"], "tool_calls": a["tool_calls"],
                     "content": (a["content"] or "")[:300], "invalid": [v for v in verdicts if v],
                     "ast": verdict, "seconds": round(a["seconds"], 2)})
    calls = s["calls_finished"] + s["calls_cut"]
    valid = s["valid_calls_finished"] + s["valid_calls_cut"]
    return {"category": category, "mode": mode, "summary": dict(s),
            "valid_call_rate": valid / calls if calls else None,
            "valid_call_rate_finished": s["valid_calls_finished"] / s["calls_finished"] if s["calls_finished"] else None,
            "call_rate": s["answers_with_calls"] / s["cases"] if s["cases"] else None,
            "ast_accuracy": s["ast_correct"] / s["cases"] if s["cases"] else None,
            "invalid_reasons": dict(errors), "ast_error_types": dict(ast_errors), "cases": rows}


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> int:
    argv, serve_extra = served.split_serve_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server's /v1 base URL (default: start `jaxserve serve` here)")
    p.add_argument("--target", default="jaxserve", help="the server's name in the results (default jaxserve)")
    p.add_argument("--categories", default="simple,multiple,parallel,irrelevance")
    p.add_argument("--modes", default="required,auto")
    p.add_argument("--per-category", type=int, default=50, help="cases per category, spread evenly (0: all)")
    p.add_argument("--concurrency", type=int, default=50,
                   help="requests in flight (default 50: a category's sample at once, one batch)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--parallel-tool-calls", choices=["true", "false"], default=None,
                   help="sent when given (BFCL's handler leaves it unset: the API's default, true)")
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument("--bfcl-version", default=BFCL_VERSION)
    p.add_argument("--bfcl-dir", help="where bfcl-eval is installed (default ~/.cache/jaxserve/conformance/...)")
    p.add_argument("--out", help="result JSON (default docs/results/conformance-bfcl-TARGET.json)")
    args = p.parse_args(argv)
    root, checker, mappings, enums = load_bfcl(args.bfcl_dir or bfcl_dir_default(args.bfcl_version),
                                               args.bfcl_version)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cases = {c: load_cases(root, c, args.per_category) for c in categories}
    t0 = time.perf_counter()
    runs = []
    prov = served.provenance([os.path.relpath(sys.argv[0], served.ROOT), *sys.argv[1:]])

    def result(model: str) -> dict:
        return {"suite": "bfcl", "bfcl_eval": args.bfcl_version, "target": args.target, "model": model,
                "settings": {"per_category": args.per_category, "concurrency": args.concurrency,
                             "max_tokens": args.max_tokens, "temperature": 0,
                             "parallel_tool_calls": args.parallel_tool_calls or "unset (default true)",
                             "serve_flags": serve_extra if not args.url else None, "url": args.url},
                **prov, "seconds": round(time.perf_counter() - t0, 1), "complete": len(runs) == len(modes) * len(
                    categories), "runs": runs}

    out = args.out or os.path.join(served.RESULTS, f"conformance-bfcl-{args.target}.json")
    with served.jaxserve(serve_extra, url=args.url) as url:
        model = served.served_model(url)
        for mode in modes:
            for c in categories:
                t = time.perf_counter()
                r = run_category(url, model, c, mode, cases[c], mappings, checker, enums, args)
                r["seconds"] = round(time.perf_counter() - t, 1)
                runs.append(r)
                s = r["summary"]
                print(f"{args.target} {mode:8s} {c:11s} cases {s['cases']:3d}  with calls {pct(r['call_rate']):>6s}  "
                      f"calls {s.get('calls_finished', 0) + s.get('calls_cut', 0):3d} valid {pct(r['valid_call_rate']):>6s} "
                      f"(finished answers {pct(r['valid_call_rate_finished']):>6s})  cut {s.get('cut_answers', 0):2d}  "
                      f"HTTP errors {s.get('http_errors', 0)}  AST {pct(r['ast_accuracy']):>6s}  {r['seconds']:.0f} s",
                      flush=True)
                served.write_result("", result(model), out)     # after each run: a cut-short run keeps its part
    required = [r for r in runs if r["mode"] == "required" and r["valid_call_rate_finished"] is not None]
    return 0 if all(r["valid_call_rate_finished"] == 1.0 for r in required) else 1


if __name__ == "__main__":
    sys.exit(main())
