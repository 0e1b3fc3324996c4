"""BFCL's cases against `jaxserve serve` on the embedded model, as scripts/conformance/bfcl.py runs
them (docs/benchmarks.md, "Conformance suites"): under tool_choice "required" every tool call of
an answer that finished parses and validates against its function's schema, in each of the
categories simple, multiple and parallel. Slow (the embedded model compiled and a few dozen
answers on 2 cores); skipped where bfcl-eval's data is not installed (`python
scripts/conformance/bfcl.py` installs it, --no-deps, into its own folder; no test downloads)."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "conformance", "bfcl.py")


def _bfcl_script():
    spec = importlib.util.spec_from_file_location("conformance_bfcl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    return module


@pytest.mark.slow   # the embedded model compiled, 12 constrained answers, one call each (~5 min on 2 cores)
def test_bfcl_required_calls_all_parse_and_validate(tmp_path):
    bfcl = _bfcl_script()
    bfcl_dir = bfcl.bfcl_dir_default(bfcl.BFCL_VERSION)
    if not os.path.isdir(os.path.join(bfcl_dir, "bfcl_eval")) and importlib.util.find_spec("bfcl_eval") is None:
        pytest.skip(f"bfcl-eval is not installed in {bfcl_dir} (python scripts/conformance/bfcl.py installs it)")
    out = tmp_path / "bfcl.json"
    rc = bfcl.main(["--categories", "simple,multiple,parallel", "--modes", "required", "--per-category", "4",
                    "--concurrency", "4", "--max-tokens", "256", "--parallel-tool-calls", "false", "--out", str(out),
                    "--", "--compilation-cache-dir", str(tmp_path / "xla"), "--cache-dir", str(tmp_path / "cache"),
                    "--max-model-len", "2048"])
    result = json.loads(out.read_text())
    for run in result["runs"]:
        s = run["summary"]
        assert s.get("http_errors", 0) == 0, run["invalid_reasons"]
        # required: every answer is a call (one cut by max_tokens before its name ended may not be)
        assert s["cases"] == 4 and s["answers_with_calls"] >= 4 - s.get("cut_answers", 0), run["category"]
        assert s["calls_finished"] > 0 and run["valid_call_rate_finished"] == 1.0, run["invalid_reasons"]
    assert rc == 0
