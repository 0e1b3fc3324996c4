"""The issue's accuracy bounds on the embedded SmolLM2-135M, relative to float32 perplexity on the
held-out text (jaxserve/quant/data/heldout_gettysburg.txt, 320 tokens), measured once per module
by the same code as `jaxserve bench accuracy`.

Bounds met: int8 <= +1%, int4 <= +10%, int8 KV <= +1%, and w8a8 (int8 activations too, not in
the issue) held to int8's +1%; w8a8 with its LM head in int8 too (measured +1.24%) to +2%; int4
through the native CPU kernel (activations rounded to int8 per group: measured +0.72%) to issue
62's +3%.
Bounds NOT met, held as strict xfails
(they pass the day the method gets good enough, and then must be promoted) beside the bound the
current method does hold, so a regression still fails: fp8 (issue: +3%, measured about +12%) and
an fp8 KV cache (issue: +1%, measured about +3%). e4m3 keeps 3 mantissa bits: weight-only e4m3
alone costs +7% on this model, whose weights are 4-bit values (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from jaxserve.quant.accuracy import PROMPTS, measure_accuracy

# fp8_uncalibrated, bench accuracy's other mode, holds no bound: it is left to the benchmark
MODES = ["int8", "int4", "fp8", "kv_fp8", "kv_int8", "w8a8", "w8a8_lm_head", "int4_native_dot"]
# a measurement of the real model (every mode's calibration and forward, about 80 s on 2 cores):
# slow; each mode's arithmetic on tiny models is tests/quant/test_engine_quantized.py's
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    # 2 prompts x 16 greedy tokens: the reference takes one forward per token
    out = measure_accuracy(MODES, prompts=PROMPTS[:2], match_tokens=16)
    return {r.mode: r for r in out}


@pytest.mark.parametrize("mode, bound", [("int8", 0.01), ("int4", 0.10), ("kv_int8", 0.01),
                                              ("w8a8", 0.01), ("w8a8_lm_head", 0.02), ("int4_native_dot", 0.03)])
def test_perplexity_within_the_issue_bound(results, mode, bound):
    r = results[mode]
    assert r.ppl_ratio - 1 <= bound, f"{mode}: perplexity {r.perplexity:.3f} is {100 * (r.ppl_ratio - 1):+.2f}%"
    assert r.num_tokens >= 300


@pytest.mark.parametrize("mode, held_bound", [("fp8", 0.16), ("kv_fp8", 0.045)])
def test_fp8_holds_its_measured_bound(results, mode, held_bound):
    r = results[mode]
    assert r.ppl_ratio - 1 <= held_bound, f"{mode}: {100 * (r.ppl_ratio - 1):+.2f}%"


@pytest.mark.xfail(strict=True, reason="e4m3's 3-bit mantissa: fp8 measures about +12%, fp8 KV about +3%")
@pytest.mark.parametrize("mode, issue_bound", [("fp8", 0.03), ("kv_fp8", 0.01)])
def test_fp8_within_the_issue_bound(results, mode, issue_bound):
    assert results[mode].ppl_ratio - 1 <= issue_bound


def test_greedy_tokens_mostly_match_float32(results):
    assert results["float32"].greedy_match == 1.0
    assert results["int8"].greedy_match >= 0.85
    assert results["kv_int8"].greedy_match >= 0.85
    assert results["w8a8"].greedy_match >= 0.85
    # and the measurement can tell modes apart: a lossy mode misses some tokens
    assert min(r.greedy_match for r in results.values()) < 1.0
