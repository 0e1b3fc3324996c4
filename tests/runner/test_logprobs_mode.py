"""logprobs_mode in the compiled sampler, against a numpy reference of each step: "processed"
logprobs (sampled token and top-k) are those of the distribution the token was drawn from (logit
bias, repetition/frequency/presence penalties, min_tokens bans and a grammar mask, then the
temperature, then top-k / top-p / min-p, renormalized; greedy rows: the adjusted logits at
temperature 1, untruncated), and the tokens drawn follow it; "raw" logprobs stay the model's
distribution whatever the row adjusts; the mode is part of the sampler's program and cache key."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions, LogitAdjustments
from jaxserve.runner.sampler import sample, sampling_arrays
from jaxserve.runner.token_mask import mask_words
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sched.sampling import SamplingOptions

VOCAB = 48
HISTORY = 16
NUM_ROWS = 64                      # every call pads to it: one program per mode
_COMPILED = {}


def compiled(mode, arrays):
    """The sampler of NUM_ROWS rows in this mode, compiled once (at XLA's lowest level, as the
    engine tests compile: half the compile time)."""
    if mode not in _COMPILED:
        specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
        lowered = jax.jit(functools.partial(sample, pad_to=NUM_ROWS, logprobs_mode=mode)).lower(
            jax.ShapeDtypeStruct((NUM_ROWS, VOCAB), jnp.float32), specs)
        _COMPILED[mode] = lowered.compile({"xla_backend_optimization_level": 0})
    return _COMPILED[mode]


class AllowOnly:
    """A grammar constraint that allows exactly these token ids next."""

    def __init__(self, allowed):
        self.allowed = tuple(allowed)

    def fill(self, row):
        row[:] = 0
        for t in self.allowed:
            row[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(1 << 31))


# one row each: (options kwargs, prompt, outputs)
ROWS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05),
    dict(temperature=1.1, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3,
         logit_bias=((3, 2.5), (9, -4.0)), prompt=[1, 2, 3, 3], outputs=[5, 5, 9]),
    dict(temperature=0.6, top_k=8, min_tokens=4, banned=(0, 1, 2), outputs=[7]),
    dict(temperature=1.0, top_p=0.8, allowed=(4, 8, 15, 16, 23, 42)),
    dict(temperature=0.0),                                            # greedy: untruncated, T = 1
    dict(temperature=0.0, top_k=3, repetition_penalty=1.5, logit_bias=((11, 3.0),), prompt=[11, 12], outputs=[]),
    dict(temperature=0.0, top_p=0.5),                                 # greedy, nothing adjusted: raw = processed
]


def options(row, seed):
    kw = {k: row[k] for k in ("temperature", "top_k", "top_p", "min_p", "min_tokens") if k in row}
    kw.update(seed=seed, num_logprobs=MAX_LOGPROBS, banned_before_min_tokens=tuple(row.get("banned", ())))
    adjust = {k: row[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
              if k in row}
    if not adjust and "allowed" not in row:
        return SamplingOptions(**kw)
    return AdjustedSamplingOptions(**kw, adjust=LogitAdjustments(**adjust) if adjust else None,
                                   constraint=AllowOnly(row["allowed"]) if "allowed" in row else None)


def log_softmax(x):
    finite = np.isfinite(x)
    m = x[finite].max()
    out = np.full_like(x, -np.inf)
    out[finite] = x[finite] - m - np.log(np.exp(x[finite] - m).sum())
    return out


def processed_reference(logits, row):
    """The distribution a row's token is drawn from, step by step, in float64."""
    x = logits.astype(np.float64).copy()
    prompt, outputs = row.get("prompt", [0]), row.get("outputs", [])
    for t, b in row.get("logit_bias", ()):
        x[t] += b
    rep = row.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(outputs):
        x[t] -= row.get("frequency_penalty", 0.0) * outputs.count(t) + row.get("presence_penalty", 0.0)
    if "allowed" in row:
        x[[t for t in range(VOCAB) if t not in row["allowed"]]] = -np.inf
    if len(outputs) < row.get("min_tokens", 0):
        x[list(row["banned"])] = -np.inf
    temperature = row["temperature"]
    if temperature == 0:
        return log_softmax(x)                   # greedy: no temperature, no truncation
    x = x / temperature
    order = np.argsort(-x, kind="stable")
    sorted_x = x[order]
    probs_sorted = np.exp(log_softmax(sorted_x))
    keep = np.ones(VOCAB, bool)
    k = row.get("top_k", 0)
    if k > 0:
        keep &= x >= sorted_x[k - 1]
    top_p = row.get("top_p", 1.0)
    if top_p < 1.0:
        # the smallest prefix (in descending order) whose mass reaches top_p, its last token included
        before = np.cumsum(probs_sorted) - probs_sorted
        keep &= x >= sorted_x[before < top_p].min()
    min_p = row.get("min_p", 0.0)
    if min_p > 0:
        keep &= np.exp(log_softmax(x)) >= min_p * probs_sorted[0]
    x[~keep] = -np.inf
    return log_softmax(x)


def run(logits, rows_opts, mode, token_rows):
    """The sampler on these rows (padded to NUM_ROWS), whose tokens are token_rows' prompt and
    outputs (ROWS entries); its outputs for them."""
    n = len(rows_opts)
    rows = [(o, len(r.get("outputs", []))) for o, r in zip(rows_opts, token_rows)] + [None] * (NUM_ROWS - n)
    # the tokens the penalties count, as the persistent batch hands them over: (tokens, prompt length)
    histories = {i: (r.get("prompt", [0]) + r.get("outputs", []), len(r.get("prompt", [0])))
                 for i, (o, r) in enumerate(zip(rows_opts, token_rows)) if o.reads_tokens}
    arrays = sampling_arrays(rows, NUM_ROWS, history_len=HISTORY, mask_words=mask_words(VOCAB), histories=histories)
    padded = np.zeros((NUM_ROWS, VOCAB), np.float32)
    padded[:n] = logits
    out = compiled(mode, arrays)(jnp.asarray(padded), {k: jnp.asarray(v) for k, v in arrays.items()})
    return {k: np.asarray(v)[:n] for k, v in out.items()}


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(0, 2.5, (len(ROWS), VOCAB)).astype(np.float32)


def test_processed_logprobs_of_sampled_tokens_and_top_k_equal_the_reference(logits):
    for seed in range(3):
        out = run(logits, [options(r, seed) for r in ROWS], "processed", ROWS)
        for i, row in enumerate(ROWS):
            want = processed_reference(logits[i], row)
            t = out["tokens"][i]
            assert np.isfinite(want[t]), (row, t)              # a token is drawn from its distribution only
            if row["temperature"] == 0:
                assert t == np.argmax(want), row
            np.testing.assert_allclose(out["logprob"][i], want[t], rtol=1e-5, atol=1e-5, err_msg=str(row))
            top = np.argsort(-want, kind="stable")[:MAX_LOGPROBS]
            alive = np.isfinite(want[top])
            # the top entries the distribution keeps, in order; the rest of the k are -inf
            assert out["top_ids"][i][alive].tolist() == top[alive].tolist(), row
            np.testing.assert_allclose(out["top_logprobs"][i][alive], want[top][alive], rtol=1e-5, atol=1e-5)
            assert np.all(np.isneginf(out["top_logprobs"][i][~alive])), row
            assert np.all(np.isneginf(want[out["top_ids"][i][~alive]])), row


def test_the_tokens_drawn_follow_the_processed_distribution(logits):
    """Many seeds of the same row: its empirical token frequencies are the reference's processed
    probabilities (2048 draws: a standard error under 0.012 per token)."""
    draws, batch = 2048, NUM_ROWS
    for i in (0, 1, 2, 3, 4, 7):                    # sampled rows with a cut (temperature, k, p, min-p, mask)
        row = ROWS[i]
        counts = np.zeros(VOCAB)
        for start in range(0, draws, batch):
            out = run(np.repeat(logits[i:i + 1], batch, 0), [options(row, s) for s in range(start, start + batch)],
                      "processed", [row] * batch)
            np.add.at(counts, out["tokens"], 1)
        want = np.exp(processed_reference(logits[i], row))
        freq = counts / draws
        assert np.all(freq[want == 0] == 0), row
        assert np.abs(freq - want).max() < 0.04, (row, np.abs(freq - want).max())


def test_raw_logprobs_stay_the_model_distribution_and_the_tokens_do_not_change(logits):
    raw = run(logits, [options(r, 5) for r in ROWS], "raw", ROWS)
    processed = run(logits, [options(r, 5) for r in ROWS], "processed", ROWS)
    assert raw["tokens"].tolist() == processed["tokens"].tolist()      # the mode changes logprobs only
    lp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    np.testing.assert_allclose(raw["logprob"], np.take_along_axis(np.asarray(lp), raw["tokens"][:, None], 1)[:, 0],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(raw["top_logprobs"], -np.sort(-np.asarray(lp), axis=1)[:, :MAX_LOGPROBS],
                               rtol=1e-6, atol=1e-6)
    # a greedy row that adjusts nothing: its processed logprobs are its raw ones, bit for bit
    np.testing.assert_array_equal(processed["top_logprobs"][-1], raw["top_logprobs"][-1])
    assert processed["logprob"][-1] == raw["logprob"][-1]


def test_the_mode_is_a_compile_time_constant_of_the_sampler():
    rows = NUM_ROWS
    arrays = sampling_arrays([None] * rows, rows, history_len=HISTORY, mask_words=mask_words(VOCAB))
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    lg = jax.ShapeDtypeStruct((rows, VOCAB), jnp.float32)
    text = {m: jax.jit(lambda x, a, m=m: sample(x, a, pad_to=rows, logprobs_mode=m)).lower(lg, specs).as_text()
            for m in ("raw", "processed")}
    assert text["raw"] != text["processed"]
    # raw is the default
    assert jax.jit(lambda x, a: sample(x, a, pad_to=rows)).lower(lg, specs).as_text() == text["raw"]
    # a draft model's sampler (probs_out) and a target's coupled with it trace in processed mode too
    coupled = dict(specs, draft_probs=jax.ShapeDtypeStruct((rows, VOCAB), jnp.float32),
                   draft_tokens=jax.ShapeDtypeStruct((rows,), jnp.int32))
    for a, probs_out in ((specs, True), (coupled, False)):
        jax.jit(lambda x, a, p=probs_out: sample(x, a, pad_to=rows, probs_out=p, logprobs_mode="processed")).lower(lg, a)
    with pytest.raises(ValueError, match="logprobs_mode='cooked' must be one of"):
        jax.jit(lambda x, a: sample(x, a, pad_to=rows, logprobs_mode="cooked")).lower(lg, specs)


def test_the_http_api_reports_a_token_cut_from_the_distribution_at_a_finite_floor():
    """Processed top-k lists hold -inf for tokens cut (top_k=5 with logprobs=20): the OpenAI
    shapes report them at vLLM's floor, so the JSON responses (which refuse infinities) serialize."""
    import json

    from jaxserve.outputs import Logprob
    from jaxserve.server.http.logprobs import LOGPROB_FLOOR, TokenText, chat_logprobs, completion_logprobs

    entry = {7: Logprob(-0.3), **{t: Logprob(lp, r) for r, (t, lp) in enumerate(
        [(7, -0.3), (3, -1.5), (4, -np.inf), (5, -np.inf)], start=1)}}
    text = TokenText(None)     # no tokenizer: a token's text is its id
    chat = chat_logprobs([7], [entry], 4, text).model_dump()
    completion = completion_logprobs([7], [entry], 4, text, 0).model_dump()
    json.dumps(chat, allow_nan=False), json.dumps(completion, allow_nan=False)
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.3, -1.5, LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert completion["top_logprobs"][0] == {"7": -0.3, "3": -1.5, "4": LOGPROB_FLOOR, "5": LOGPROB_FLOOR}
