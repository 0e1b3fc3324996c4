"""The sampler's coupling with a draft model's draws (speculative sampling, Leviathan et al.): the
target's tokens follow its own filtered distribution p whatever the draft's q, the draft's token is
kept at the rate sum(min(p, q)), and rows without a draft sample, or greedy rows, are untouched."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

from jaxserve.engine.draft_proposer import draft_options
from jaxserve.runner.sampler import sample, sampling_arrays
from jaxserve.sched.sampling import SamplingOptions

N = 4000                                            # one row per seed
VOCAB = 32                                          # the sampler's logprobs need >= 20 tokens
TARGET = np.log(np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03] + [1e-6] * (VOCAB - 6), np.float32))
DRAFT = np.log(np.array([0.05, 0.40, 0.10, 0.30, 0.05, 0.10] + [1e-6] * (VOCAB - 6), np.float32))
TOP_K = 4                                           # applies to p (and to q, as the draft samples)


def filtered(logits, top_k):
    p = np.exp(logits.astype(np.float64) - logits.max())
    p[np.argsort(-p)[top_k:]] = 0.0
    return p / p.sum()


def rows(opts):
    """The sampler's arrays for N rows, the first len(opts) of them requests' (the rest padding)."""
    return sampling_arrays([(o, 0) for o in opts] + [None] * (N - len(opts)), N)


@functools.cache
def _sampler(probs_out: bool):
    return jax.jit(functools.partial(sample, pad_to=N, probs_out=probs_out))


def draw(logits, arrays, probs_out=False):
    return _sampler(probs_out)(jnp.asarray(np.tile(logits, (N, 1))), arrays)


def target_opts(seeds, temperature=1.0):
    return [SamplingOptions(temperature=temperature, top_k=TOP_K, seed=int(s)) for s in seeds]


def coupled(opts):
    draft = draw(DRAFT, rows([draft_options(o) for o in opts]), probs_out=True)
    out = draw(TARGET, {**rows(opts), "draft_probs": draft["probs"], "draft_tokens": draft["padded_tokens"]})
    return np.asarray(out["tokens"]), np.asarray(draft["tokens"]), np.asarray(draft["probs"])


def test_coupled_tokens_follow_the_target_and_keep_the_draft_at_the_overlap_rate():
    tokens, guesses, q_rows = coupled(target_opts(range(N)))
    p, q = filtered(TARGET, TOP_K), filtered(DRAFT, TOP_K)
    np.testing.assert_allclose(q_rows[0], q, atol=1e-6)        # the draft's q is what it sampled from
    assert np.all(p[tokens] > 0)
    observed = np.bincount(tokens, minlength=len(p))[p > 0]
    _, p_value = scipy_stats.chisquare(observed, p[p > 0] / p[p > 0].sum() * observed.sum())
    assert p_value > 1e-3, f"coupled tokens do not follow the target (p={p_value:.2g})"
    kept = np.mean(tokens == guesses)
    overlap = np.minimum(p, q).sum()                           # 1 - total variation
    assert abs(kept - overlap) < 4 * np.sqrt(overlap * (1 - overlap) / N), (kept, overlap)
    # a point-mass guess (the draft's argmax) would be kept only at p(argmax q)
    assert overlap > p[np.argmax(q)] + 0.2


def test_rows_without_a_draft_sample_and_greedy_rows_are_untouched():
    opts = target_opts(range(64))
    plain = np.asarray(draw(TARGET, rows(opts))["tokens"])
    no_draft = {**rows(opts), "draft_probs": jnp.zeros((N, VOCAB), jnp.float32),
                "draft_tokens": jnp.full((N,), -1, jnp.int32)}
    assert np.array_equal(np.asarray(draw(TARGET, no_draft)["tokens"])[:64], plain[:64])
    greedy = [SamplingOptions()] * 64
    draft = draw(DRAFT, rows(greedy), probs_out=True)
    out = draw(TARGET, {**rows(greedy), "draft_probs": draft["probs"], "draft_tokens": draft["padded_tokens"]})
    assert np.all(np.asarray(out["tokens"])[:64] == np.argmax(TARGET))


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours():
    seeds = np.arange(200)
    alone = coupled(target_opts(seeds))[0]
    mixed = target_opts(seeds)
    mixed[::2] = [SamplingOptions(temperature=0.5, seed=1000 + i) for i in range(100)]   # other requests
    together = coupled(mixed)[0]
    assert np.array_equal(alone[1:200:2], together[1:200:2])
