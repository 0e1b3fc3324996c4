"""The Open Responses compliance suite (github.com/openresponses/openresponses, bin/compliance-test.ts,
run with bun) against a server's /v1/responses: each of its HTTP tests on its own, one after
another (a 135M model on 2 cores answers one request at a time fastest; the suite's own run sends
them all at once), its --json verdict kept per test.

The suite is the repository's tree at --suite-rev (cloned from --suite-git, default GitHub, or an
existing checkout given by --suite-dir); of its dependencies only zod is installed (with bun, into a
folder beside the tree: its site and code generators are not needed to run the tests). bun is the
one on PATH, or --bun, or installed from npm into the cache (`npm install --prefix`).

Tests that need what jaxserve refuses by design are reported as such, with the reason (the exit
status is 0 when every other test passes):

- image-input: an `input_image` part; the served models are text-only, and /v1/responses refuses
  any non-text part with a 400 naming it.
- compact-response, compact-missing-model: POST /v1/responses/compact (server-side compaction into
  an opaque item); not served (405), as `context_management` is refused on /v1/responses.
- websocket-* (run only with --websocket): /v1/responses over WebSocket is not served.

    python scripts/conformance/open_responses.py                   # starts `jaxserve serve` (embedded model)
    python scripts/conformance/open_responses.py --suite-dir ~/src/openresponses --url http://127.0.0.1:8000/v1

Flags after `--` go to `jaxserve serve` (default: --max-model-len 2048, so an answer the model never
ends stops at the context, not after 8192 tokens). Writes docs/results/conformance-open-responses.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import served  # noqa: E402

SUITE_GIT = "https://github.com/openresponses/openresponses.git"
ZOD = "zod@3.25.76"          # the suite's package.json: "zod": "^3.25.76"
DEFAULT_SERVE = ["--max-model-len", "2048"]
BY_DESIGN = {
    "image-input": "input_image parts are refused (400 naming the part): the served models are text-only",
    "compact-response": "POST /v1/responses/compact is not served (405): no server-side compaction "
                        "(context_management is refused too)",
    "compact-missing-model": "POST /v1/responses/compact is not served (405), so it cannot answer 400 for a "
                             "missing model",
}
WEBSOCKET_WHY = "/v1/responses over WebSocket is not served"


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxserve", "conformance")


def find_bun(given: str | None) -> str:
    if given:
        return given
    on_path = shutil.which("bun")
    if on_path:
        return on_path
    prefix = os.path.join(cache_dir(), "bun")
    bun = os.path.join(prefix, "node_modules", ".bin", "bun")
    if not os.path.exists(bun):
        print(f"installing bun from npm into {prefix}", file=sys.stderr)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", prefix, "bun@1"], check=True)
    return bun


def git(*a, cwd=None) -> str:
    return subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def suite_tree(args, bun: str) -> tuple[str, str]:
    """(the suite's folder, its commit): --suite-dir as it is, or the tree at --suite-rev of a
    clone of --suite-git; zod installed beside it (node's lookup walks up to it)."""
    if args.suite_dir:
        path = os.path.abspath(args.suite_dir)
        try:
            commit = git("rev-parse", "HEAD", cwd=path)
        except subprocess.CalledProcessError:
            commit = args.suite_commit or "unknown"
        base = os.path.dirname(path)
    else:
        clone = os.path.join(cache_dir(), "openresponses.git")
        if not os.path.isdir(clone):
            subprocess.run(["git", "clone", "-q", "--bare", args.suite_git, clone], check=True)
        commit = git("rev-parse", args.suite_rev + "^{commit}", cwd=clone)
        base = os.path.join(cache_dir(), f"openresponses-{commit[:12]}")
        path = os.path.join(base, "suite")
        if not os.path.isdir(path):
            os.makedirs(path)
            archive = subprocess.Popen(["git", "archive", commit], cwd=clone, stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", path], stdin=archive.stdout, check=True)
            archive.wait()
    if not os.path.isdir(os.path.join(base, "node_modules", "zod")):
        if not os.path.exists(os.path.join(base, "package.json")):
            with open(os.path.join(base, "package.json"), "w") as f:
                json.dump({"name": "openresponses-suite-deps", "private": True}, f)
        subprocess.run([bun, "add", ZOD], cwd=base, check=True)
    return path, commit


def suite_tests(bun: str, path: str) -> list[dict]:
    """The suite's test templates: id, name, transport."""
    code = ('import { testTemplates } from "./src/lib/compliance-tests"; console.log(JSON.stringify('
            'testTemplates.map((t) => ({ id: t.id, name: t.name, transport: t.transport ?? "http" }))));')
    out = subprocess.run([bun, "-e", code], cwd=path, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_test(bun: str, path: str, url: str, model: str, test: dict, timeout: float) -> dict:
    cmd = [bun, "run", "bin/compliance-test.ts", "--base-url", url, "--api-key", "none", "--model", model,
           "--filter", test["id"], "--json"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=path, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"id": test["id"], "status": "failed", "errors": [f"no verdict in {timeout:.0f} s"],
                "seconds": round(time.perf_counter() - t0, 1)}
    seconds = round(time.perf_counter() - t0, 1)
    try:
        report = json.loads(p.stdout[p.stdout.index("{"):])
        [r] = [r for r in report["results"] if r["id"] == test["id"]]
    except (ValueError, KeyError):
        return {"id": test["id"], "status": "failed", "errors": [f"unreadable output: {p.stdout[-500:]}"
                                                                 f"{p.stderr[-500:]}"], "seconds": seconds}
    return {"id": test["id"], "status": r["status"], "errors": r.get("errors") or [], "seconds": seconds,
            "duration_ms": r.get("duration"), "stream_events": r.get("streamEvents"),
            "response": r.get("response") if r["status"] != "passed" else None}


def main(argv=None) -> int:
    argv, serve_extra = served.split_serve_args(argv, DEFAULT_SERVE)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server's /v1 base URL (default: start `jaxserve serve` here)")
    p.add_argument("--target", default="jaxserve")
    p.add_argument("--suite-dir", help="an existing checkout of the suite's repository")
    p.add_argument("--suite-commit", help="the commit of --suite-dir when it is no git checkout (for the record)")
    p.add_argument("--suite-git", default=SUITE_GIT)
    p.add_argument("--suite-rev", default="HEAD")
    p.add_argument("--bun", help="the bun binary (default: on PATH, else installed from npm into the cache)")
    p.add_argument("--filter", help="comma-separated test ids (default: every HTTP test)")
    p.add_argument("--websocket", action="store_true", help="also the WebSocket tests")
    p.add_argument("--test-timeout", type=float, default=900)
    p.add_argument("--out", help="result JSON (default docs/results/conformance-open-responses[-TARGET].json)")
    args = p.parse_args(argv)
    bun = find_bun(args.bun)
    path, commit = suite_tree(args, bun)
    tests = suite_tests(bun, path)
    if args.filter:
        wanted = {t.strip() for t in args.filter.split(",")}
        tests = [t for t in tests if t["id"] in wanted]
    elif not args.websocket:
        tests = [t for t in tests if t["transport"] == "http"]
    results = []
    t0 = time.perf_counter()
    with served.jaxserve(serve_extra, url=args.url) as url:
        model = served.served_model(url)
        for t in tests:
            r = run_test(bun, path, url, model, t, args.test_timeout)
            r["name"], r["transport"] = t["name"], t["transport"]
            why = BY_DESIGN.get(t["id"]) or (WEBSOCKET_WHY if t["transport"] == "websocket" else None)
            if why and r["status"] != "passed":
                r["refused_by_design"] = why
            results.append(r)
            mark = {"passed": "PASS", "skipped": "skip"}.get(r["status"], "FAIL")
            print(f"{mark} {t['id']:32s} {r['seconds']:6.1f} s  {'; '.join(r['errors'])[:160]}", flush=True)
    passed = sum(r["status"] == "passed" for r in results)
    by_design = [r["id"] for r in results if "refused_by_design" in r]
    other = [r["id"] for r in results if r["status"] != "passed" and "refused_by_design" not in r]
    print(f"{args.target}: {passed}/{len(results)} passed; refused by design: {', '.join(by_design) or 'none'}; "
          f"other failures: {', '.join(other) or 'none'}")
    result = {"suite": "open-responses", "suite_repository": args.suite_git if not args.suite_dir else args.suite_dir,
              "suite_commit": commit, "bun": subprocess.run([bun, "--version"], capture_output=True,
                                                            text=True).stdout.strip(),
              "target": args.target, "model": model, "serve_flags": serve_extra if not args.url else None,
              **served.provenance([os.path.relpath(sys.argv[0], served.ROOT), *sys.argv[1:]]),
              "seconds": round(time.perf_counter() - t0, 1), "passed": passed, "total": len(results),
              "refused_by_design": by_design, "other_failures": other, "tests": results}
    name = "conformance-open-responses.json" if args.target == "jaxserve" else \
        f"conformance-open-responses-{args.target}.json"
    served.write_result(name, result, args.out)
    return 0 if not other else 1


if __name__ == "__main__":
    sys.exit(main())
