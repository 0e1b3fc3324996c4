"""The embedded SmolLM2-135M (9 query heads, 3 KV heads) split over 3 CPU devices: greedy
generations in float32 token-identical to one device, on one workload that hits the prefix cache,
chunks its prompts, preempts, and forks n=2 samples. Runs in a child process with 3 devices
(cpu_devices.py); two engine builds of the real model, with few buckets."""

import pytest

from tests.parallel.cpu_devices import run_probe

# two builds of the real model (about 75 s on 2 cores): slow; tensor parallelism's parity on tiny
# models of every architecture is tests/parallel/test_tiny_models.py's
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    return run_probe(3, "embedded", "3", timeout=850)     # under pytest's own 900 s


def test_greedy_generations_identical_at_tensor_parallel_size_3(report):
    one, three = report["1"], report["3"]
    # the workload exercised what it is meant to, on both engines
    for r in (one, three):
        assert r["preemptions"] > 0
        assert r["prefix_hits"] > 0
        assert min(r["prompt_lens"]) > 64        # longer than the 64-token step budget: chunked
        assert r["compilations_after_warmup"] == 0
        assert all(len(sample) == 16 for samples in r["tokens"] for sample in samples)
    assert three["mesh"]["axis_sizes"] == {"data": 1, "model": 3}
    assert three["tokens"] == one["tokens"]
    assert any("Paris" in text for text in three["text"])      # the model really answers
