"""Accuracy of each quantization mode against float32: perplexity on a held-out text and the
share of greedy tokens that match float32's.

Both run the model directly (its architecture's forward with dense causal attention, no runner), so a
mode's number is its arithmetic alone, not batching or bucket padding. A quantized KV cache is
modelled by storing K/V through the runner's own quantize_kv and reading them back scaled
(exactly what the paged step computes: it writes a step's K/V before attending over them).

Greedy match: for each prompt, MATCH_TOKENS greedy tokens from float32; the mode is then
teacher-forced on float32's sequence and scored on how many of those positions its own argmax
agrees with. Teacher forcing keeps one early divergence from counting every later token as a
miss, and it costs one forward per prompt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.int8_dot import cpu_kernels
from jaxserve.models import registry
from jaxserve.models.attention import dense_causal_attention
from jaxserve.models.config import ModelConfig
from pallas_kernels.kv_quant import quantize_kv

MATCH_TOKENS = 32
FAST_COMPILE = {"xla_backend_optimization_level": 0}

# prompts written for this measurement: plain requests of the kinds a chat model gets
PROMPTS = (
    "The three primary colors are",
    "To make a cup of tea, first",
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "A good way to learn a new language is",
    "The largest planet in our solar system",
    "Once upon a time, in a small village,",
)


@dataclass(frozen=True)
class ModeAccuracy:
    mode: str
    perplexity: float
    ppl_ratio: float          # perplexity / float32's
    greedy_match: float       # share of float32's greedy tokens this mode's argmax reproduces
    num_tokens: int           # held-out tokens scored


def kv_fake_quant_attention(config: ModelConfig, kv_scales: dict, kv_dtype: str):
    """Dense causal attention that reads K/V as a quantized cache would give them back."""
    dense = dense_causal_attention(config)

    def attention(layer, q, k, v, cache):
        ks, vs = kv_scales["k"][layer], kv_scales["v"][layer]
        kq = quantize_kv(k, ks, kv_dtype).astype(jnp.float32) * ks[None, :, None]
        vq = quantize_kv(v, vs, kv_dtype).astype(jnp.float32) * vs[None, :, None]
        return dense(layer, q, kq.astype(q.dtype), vq.astype(q.dtype), cache)

    return attention


class Scorer:
    """One compiled forward of a model over a fixed-width padded window: ids [width] -> logits
    [width, V]. Causal attention: padding after a position never changes its logits."""

    def __init__(self, params, config: ModelConfig, width: int, attention=None, native_kernels: bool = False):
        attention = attention or dense_causal_attention(config)
        self.params, self.width = params, width

        model = registry.for_config(config).model()

        def run(params, ids):
            hidden, _ = model.forward(params, config, ids, jnp.arange(width, dtype=jnp.int32), None, attention)
            return model.compute_logits(params, config, hidden)

        run = jax.jit(run, compiler_options=FAST_COMPILE)
        if native_kernels:   # traced now as the engine traces a single-device CPU step, kept compiled
            with cpu_kernels():
                run = run.lower(params, jnp.zeros(width, jnp.int32)).compile()
        self._run = run

    def logits(self, ids) -> np.ndarray:
        padded = np.zeros(self.width, np.int32)
        padded[:len(ids)] = ids
        return np.asarray(self._run(self.params, jnp.asarray(padded)))[:len(ids)]


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1]."""
    lg = logits[:-1].astype(np.float64)
    top = lg.max(axis=1)
    lse = np.log(np.exp(lg - top[:, None]).sum(axis=1)) + top
    nll = lse - lg[np.arange(len(ids) - 1), ids[1:]]
    return float(math.exp(nll.mean()))


def greedy_reference(scorer: Scorer, prompts: list[list[int]], n: int = MATCH_TOKENS) -> list[np.ndarray]:
    """Float32's greedy continuation of each prompt: prompt + n tokens."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(n):
            ids.append(int(np.argmax(scorer.logits(ids)[-1])))
        out.append(np.asarray(ids, np.int32))
    return out


def greedy_match(scorer: Scorer, references: list[np.ndarray], prompt_lens: list[int]) -> float:
    hits = total = 0
    for ref, plen in zip(references, prompt_lens):
        pred = scorer.logits(ref)[plen - 1:-1].argmax(axis=1)   # what positions plen.. would get
        hits += int((pred == ref[plen:]).sum())
        total += len(ref) - plen
    return hits / total


def with_ratio(results: list[ModeAccuracy]) -> list[ModeAccuracy]:
    base = next(r.perplexity for r in results if r.mode == "float32")
    return [dataclasses.replace(r, ppl_ratio=r.perplexity / base) for r in results]


def measure_accuracy(modes: list[str], *, source: str | None = None, heldout_text: str | None = None,
                     calibration_data: str | None = None, prompts=PROMPTS, match_tokens: int = MATCH_TOKENS,
                     max_heldout_tokens: int = 512, cache_dir: str | None = None,
                     on_result=None) -> list[ModeAccuracy]:
    """Perplexity on the held-out text and greedy match against float32, for each of `modes`
    (float32 is always measured first: it is the reference)."""
    from jaxserve.checkpoints import load_checkpoint
    from jaxserve.quant.modes import is_gguf, mode_params
    from jaxserve.quant.texts import HELDOUT

    if heldout_text is None:
        with open(HELDOUT, encoding="utf-8") as f:
            heldout_text = f.read()
    ckpt = load_checkpoint(source)
    config = ModelConfig.from_hf_config(ckpt.config)
    text_ids = np.asarray(ckpt.tokenizer.encode(heldout_text)[:max_heldout_tokens], np.int32)
    prompt_ids = [ckpt.tokenizer.encode(p) for p in prompts]
    # two windows: the held-out text's, and the prompts' (short: greedy generation runs one
    # forward per token over it)
    prompt_width = max(len(p) for p in prompt_ids) + match_tokens
    results, references = [], None
    for mode in ["float32"] + [m for m in modes if m != "float32"]:
        if mode == "int4_gguf_native" and not is_gguf(source):
            continue
        mp = mode_params(mode, ckpt, config, source=source, calibration_data=calibration_data, cache_dir=cache_dir)
        attention = kv_fake_quant_attention(config, mp.kv_scales, mp.kv_dtype) if mp.kv_scales else None
        native = mp.native_kernels
        ppl = perplexity(Scorer(mp.params, config, len(text_ids), attention, native).logits(text_ids), text_ids)
        scorer = Scorer(mp.params, config, prompt_width, attention, native)
        if references is None:
            references = greedy_reference(scorer, prompt_ids, match_tokens)
        match = greedy_match(scorer, references, [len(p) for p in prompt_ids])
        results.append(ModeAccuracy(mode, ppl, ppl / results[0].perplexity if results else 1.0, match,
                                    len(text_ids)))
        if on_result is not None:
            on_result(results[-1])
    return with_ratio(results)
