"""A tiny random-weight Llama in an HF directory, with a BPE tokenizer trained on the bench corpus.

The model maker lives in the library (jaxserve/bench/random_model.py), shared with
scripts/gpu_bench.sh; the tests use its "tiny" shape.
"""

from __future__ import annotations

from jaxserve.bench.random_model import make_random_hf_model


def make_tiny_hf_model(directory: str, vocab_size: int = 384, seed: int = 0) -> str:
    return make_random_hf_model(directory, "tiny", "float32", seed=seed, device="cpu", vocab_size=vocab_size)
