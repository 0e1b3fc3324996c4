"""Presence, frequency and repetition penalties and logit bias in the compiled sampler, against a
reference computed with numpy on the same logits (vLLM's definitions: bias, then repetition over
prompt and output, then frequency and presence over the output), including the token a step in
flight is sampling (read from the previous step's ids on the device); rows without adjustments
keep their tokens bit for bit whatever else shares the batch."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions, LogitAdjustments
from jaxserve.runner.sampler import _adjusted, sample, sampling_arrays
from jaxserve.sched.sampling import SamplingOptions

VOCAB = 64
HISTORY = 32


def adjusted_options(temperature=0.0, seed=0, **adjust):
    return AdjustedSamplingOptions(temperature=temperature, seed=seed, adjust=LogitAdjustments(**adjust))


def known(prompt, outputs):
    """A row's history as the persistent batch hands it to the sampler: its tokens, prompt length."""
    return np.asarray(list(prompt) + list(outputs), np.int32), len(prompt)


def reference(logits, prompt, outputs, presence=0.0, frequency=0.0, repetition=1.0, bias=()):
    out = logits.astype(np.float64).copy()
    for t, b in bias:
        out[t] += b
    seen = set(prompt) | set(outputs)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(outputs):
        out[t] -= frequency * outputs.count(t) + presence
    return out


CASES = [
    dict(prompt=[1, 2, 3, 3], outputs=[5, 5, 6], presence_penalty=0.5),
    dict(prompt=[1, 2, 3, 3], outputs=[5, 5, 6], frequency_penalty=1.5),
    dict(prompt=[1, 2, 3, 3], outputs=[5, 5, 6], repetition_penalty=1.7),
    dict(prompt=[7, 8], outputs=[], repetition_penalty=0.5, presence_penalty=-1.0),
    dict(prompt=[9], outputs=[9, 9, 10], logit_bias=((4, 3.0), (9, -2.5)), frequency_penalty=0.25,
         presence_penalty=2.0, repetition_penalty=1.3),
]


def test_adjusted_logits_equal_the_reference_with_and_without_an_in_flight_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (8, VOCAB)).astype(np.float32)
    prev = np.full(8, 0, np.int32)
    prev[3] = 11                                 # the previous step sampled 11 for row 5's request
    rows, histories = [], {}
    for i, c in enumerate(CASES):
        kw = {k: v for k, v in c.items() if k not in ("prompt", "outputs")}
        rows.append((adjusted_options(**kw), len(c["outputs"])))
        histories[i] = known(c["prompt"], c["outputs"])
    in_flight = dict(CASES[1])                   # row 5: CASES[1] whose last output is still in flight
    rows.append((adjusted_options(frequency_penalty=1.5), len(in_flight["outputs"]) + 1, 3))
    histories[5] = known(in_flight["prompt"], in_flight["outputs"])
    rows += [(SamplingOptions(), 0), None]       # a row without adjustments, and padding
    arrays = sampling_arrays(rows, 8, history_len=HISTORY, histories=histories)
    got = np.asarray(_adjusted(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in arrays.items()},
                               jnp.asarray(prev)))
    for i, c in enumerate(CASES):
        want = reference(logits[i], c["prompt"], c["outputs"], c.get("presence_penalty", 0.0),
                         c.get("frequency_penalty", 0.0), c.get("repetition_penalty", 1.0), c.get("logit_bias", ()))
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5, err_msg=str(c))
    want = reference(logits[5], in_flight["prompt"], in_flight["outputs"] + [11], frequency=1.5)
    np.testing.assert_allclose(got[5], want, rtol=1e-6, atol=1e-5)
    assert np.array_equal(got[6], logits[6]) and np.array_equal(got[7], logits[7])


def test_greedy_picks_the_reference_argmax():
    rng = np.random.default_rng(1)
    for trial in range(20):
        logits = rng.normal(0, 2, (2, VOCAB)).astype(np.float32)
        top = int(np.argmax(logits[0]))
        c = dict(prompt=[top], outputs=[top, top], frequency_penalty=1.0, repetition_penalty=1.5)
        opts = adjusted_options(frequency_penalty=1.0, repetition_penalty=1.5)
        arrays = sampling_arrays([(opts, 2), None], 2, history_len=HISTORY,
                                 histories={0: known(c["prompt"], c["outputs"])})
        tok = int(np.asarray(sample(jnp.asarray(logits), arrays, pad_to=2)["tokens"])[0])
        assert tok == int(np.argmax(reference(logits[0], [top], [top, top], frequency=1.0, repetition=1.5)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_without_adjustments_keep_their_tokens_whatever_shares_the_batch(temperature):
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(0, 2, (4, VOCAB)).astype(np.float32))
    plain = [(SamplingOptions(temperature=temperature, seed=s), 3) for s in range(4)]
    alone = sample(logits, sampling_arrays(plain, 4, history_len=HISTORY), pad_to=4)["tokens"]
    mixed_rows = list(plain)
    mixed_rows[1] = (adjusted_options(temperature=temperature, seed=1, presence_penalty=2.0,
                                      logit_bias=((5, 100.0),)), 1)
    mixed = sample(logits, sampling_arrays(mixed_rows, 4, history_len=HISTORY, histories={1: known([1, 2], [3])}),
                   pad_to=4)["tokens"]
    alone, mixed = np.asarray(alone), np.asarray(mixed)
    assert [alone[i] for i in (0, 2, 3)] == [mixed[i] for i in (0, 2, 3)]
    assert mixed[1] == 5                          # +100 on token 5 wins at any temperature


def test_a_row_whose_penalties_read_its_tokens_needs_them():
    rows = [(adjusted_options(presence_penalty=1.0), 0)]
    with pytest.raises(ValueError, match="penalties read its tokens"):
        sampling_arrays(rows, 2, history_len=HISTORY)
    sampling_arrays([(adjusted_options(logit_bias=((3, 1.0),)), 0)], 2, history_len=HISTORY)   # a bias reads none


def test_bad_values_are_refused_naming_the_field():
    from jaxserve.sampling_params import SamplingParams

    for kw, field in ((dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=float("nan")),
                      "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
                      (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={3: 1.0, 1: -1.0}).logit_bias == ((1, -1.0), (3, 1.0))
