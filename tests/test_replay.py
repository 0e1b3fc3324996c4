"""reference_logprobs (jaxserve/replay.py): the per-token logprobs of given tokens from a dense
full-sequence forward of the engine's model function equal HF transformers' log-softmax on the
tiny random models; jit, vmap over a right-padded batch and grad (checked against a central
difference) work on it. The gap to the engine's sampled logprobs is measured where an engine runs
anyway (tests/examples/test_rl_policy_gradient.py; a raw-mode engine in the slow test below)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve import reference_logprobs
from jaxserve.models.config import ModelConfig
from jaxserve.models.params import params_from_hf

TOKENS = [1, 17, 42, 99, 7, 23, 64, 11, 150, 3, 88, 201, 9, 250, 31, 77, 5, 5, 260, 13]
# two float32 programs of one function: measured 2.8e-6 (Llama) to 4.8e-6 (Qwen2) on the tiny models
HF_ATOL = 1e-4


def model_and_params(path):
    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    return config, params_from_hf(config, load_file(os.path.join(path, "model.safetensors")), jnp.float32)


def hf_next_token_logprobs(path, token_ids):
    """HF transformers (fp32): log p(token i + 1 | tokens <= i), float64 [T - 1]."""
    import torch

    from jaxserve.testing.tiny_models import _hf_model

    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([token_ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].numpy()


SHORT = 12                                       # the batch's second row: TOKENS[:12], right-padded with 0


@pytest.fixture(scope="module")
def replay(tiny_llama_dir):
    """(config, params, the jitted replay, a [2, T] batch: TOKENS and TOKENS[:SHORT] padded)."""
    config, params = model_and_params(tiny_llama_dir)
    batch = np.zeros((2, len(TOKENS)), np.int32)
    batch[0] = TOKENS
    batch[1, :SHORT] = TOKENS[:SHORT]
    return config, params, jax.jit(lambda p, ids: reference_logprobs(config, p, ids)), jnp.asarray(batch)


def test_equal_to_hf_log_softmax_on_a_right_padded_batch(tiny_llama_dir, replay):
    config, params, fn, batch = replay
    got = np.asarray(fn(params, batch))
    assert got.shape == (2, len(TOKENS) - 1) and got.dtype == np.float32
    np.testing.assert_allclose(got[0], hf_next_token_logprobs(tiny_llama_dir, TOKENS), atol=HF_ATOL, rtol=0)
    # causal: the padding after the short sequence changes none of its own positions
    np.testing.assert_allclose(got[1, :SHORT - 1], hf_next_token_logprobs(tiny_llama_dir, TOKENS[:SHORT]),
                               atol=HF_ATOL, rtol=0)


def test_the_gradient_is_the_derivative(replay):
    """grad of a completion's summed logprobs, against a central difference along a random
    direction (through the same jitted replay)."""
    config, params, fn, batch = replay

    def objective(p):
        return jnp.sum(fn(p, batch)[0, 8:])          # the tokens after a 9-token "prompt"

    grads = jax.jit(jax.grad(objective))(params)
    leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    assert len(leaves) == len(jax.tree.leaves(params))
    assert all(np.all(np.isfinite(g)) and np.abs(g).max() > 0 for g in leaves)
    # numpy for the direction and the perturbed params (eager jax ops would compile one program per shape)
    rng = np.random.default_rng(0)
    host = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
    direction = [rng.normal(size=x.shape) for x in host]
    eps = 1e-3

    def moved(sign):
        return jax.tree.unflatten(jax.tree.structure(params),
                                  [jnp.asarray(x + sign * eps * d, jnp.float32) for x, d in zip(host, direction)])

    numeric = float(objective(moved(1)) - objective(moved(-1))) / (2 * eps)
    analytic = sum(float(np.vdot(g, d)) for g, d in zip(leaves, direction))
    assert abs(numeric - analytic) <= 2e-2 * abs(analytic), (numeric, analytic)


def test_bad_arguments_are_refused(tiny_llama_dir):
    config, params = model_and_params(tiny_llama_dir)
    with pytest.raises(ValueError, match="T >= 2"):
        reference_logprobs(config, params, jnp.array([5]))
    with pytest.raises(ValueError, match="temperature=0"):
        reference_logprobs(config, params, jnp.array(TOKENS), temperature=0)
    with pytest.raises(TypeError, match="an LLM, an Engine, a ModelRunner or a ModelConfig"):
        reference_logprobs("llama", params, jnp.array(TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3"])
def test_equal_to_hf_log_softmax_on_more_architectures(arch, tmp_path):
    """Gemma's soft caps, sliding windows and (1 + w) norms, Qwen3's q/k norms."""
    from jaxserve.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch, seed=0)
    config, params = model_and_params(path)
    tokens = TOKENS * 2                          # 40 tokens: past Gemma's sliding window of 8
    got = np.asarray(reference_logprobs(config, params, jnp.array(tokens)))
    np.testing.assert_allclose(got, hf_next_token_logprobs(path, tokens), atol=HF_ATOL, rtol=0)


@pytest.mark.slow
def test_gap_to_a_raw_mode_engine_over_many_buckets(tiny_llama_dir, capsys):
    """The engine's raw sampled logprobs (paged attention, bucketed rows, prefill chunks beside
    decodes) against the replay of the same tokens, under the same params; the gap printed."""
    from jaxserve import LLM, SamplingParams
    from tests.conftest import TINY_ENGINE

    llm = LLM(tiny_llama_dir, **TINY_ENGINE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=int(rng.integers(3, 40))).tolist() for _ in range(10)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=2, temperature=0.8, top_k=20, logprobs=0, max_tokens=24, ignore_eos=True,
                                       seed=3), use_tqdm=False)
    fn = jax.jit(lambda p, ids: reference_logprobs(llm, p, ids))
    gaps = []
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            replay = np.asarray(fn(llm.engine.runner.params, jnp.array(prompt + c.token_ids)))[len(prompt) - 1:]
            engine = np.array([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)])
            gaps.append(np.abs(replay - engine).max())
    with capsys.disabled():
        print(f"\nraw engine vs replay, {len(gaps)} sequences: max |dlogprob| {max(gaps):.2e}, "
              f"median of per-sequence max {np.median(gaps):.2e}")
    assert max(gaps) < HF_ATOL
