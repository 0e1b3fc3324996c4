"""Sampling on device: logit bias and presence/frequency/repetition penalties, greedy,
temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every row draws from its own key, fold_in(PRNGKey(seed), output index), so a seeded request
samples the same tokens whatever else shares its batch, and after a preemption. Filters that
need a sort of the vocabulary run only when some row asks for them (lax.cond), and logprobs only
when some row wants them. Likewise the logit adjustments (runner/logit_adjustments.py) run only
when some row has them, and a row without them keeps its logits bit for bit (jnp.where), so its
tokens are the same whatever shares its batch. Their arrays are the widest: a row's known tokens
[R, L] (L = max_model_len) and its bias [R, MAX_LOGIT_BIAS]; a step where no row adjusts passes
neutral ones the runner keeps on the device (`neutral_adjustment_arrays`). A row with structured
output carries its grammar's packed token mask ([R, ceil(V / 32)] int32, filled on the host from
its llguidance matcher, runner/token_mask.py); disallowed tokens get -inf after the adjustments.

Speculative decoding verifies guesses here too. A guess with no distribution of its own (an n-gram
lookup, or a greedy request's draft) is a point mass: its row samples as usual and the runner keeps
the guess while it equals the token the row before sampled, which is exactly rejection sampling of
a point mass. With a draft model, every sampled row is coupled with the draft model's row of the
same step (the draft runs the same rows first, `probs_out`): its token q-sampled there, g, is
kept with probability min(1, p(g) / q(g)), otherwise the row draws from max(p - q, 0)
renormalised (Leviathan et al.), where p is the target's distribution after temperature, top-k,
top-p and min-p. The draft drew its guesses with the same keys from the same distributions, so a
verification row's g is the guess it verifies; a rejected row's token is never g, so the runner's
rule still holds. Every sampled token, guessed or not, comes from that one rule, on keys of its
own output index: a seeded request's tokens do not depend on which steps speculated, or on what
shares its batch.

Logprobs describe one of two distributions, chosen per engine (`logprobs_mode`, a compile-time
constant: each mode is its own program, and raw mode's is the one it always was). "raw": the
model's, log_softmax of the logits before anything above touches them. "processed": the one the
token was drawn from: after the logit adjustments, grammar mask and min_tokens bans, divided by
the temperature, truncated by top-k / top-p / min-p and renormalized (tokens cut have -inf); a
greedy row's is its adjusted logits' log_softmax at temperature 1, untruncated (vLLM's
processed_logprobs: greedy rows skip temperature and truncation). What an RL trainer replays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import batch_invariant
from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxserve.sched.sampling import MAX_BANNED_IDS as MAX_BANNED
from jaxserve.sched.sampling import SamplingOptions


ADJUSTMENT_ARRAYS = ("known_tokens", "bias_ids", "bias_values", "token_mask")   # the wide ones
LOGPROBS_MODES = ("raw", "processed")     # what logprobs describe (module docstring)


def sampling_arrays(rows: list[tuple | None], num_rows: int, *, history_len: int = 1,
                    mask_words: int = 1, histories: dict | None = None) -> dict[str, np.ndarray]:
    """Host-side arrays for `sample`; rows[i] = (options, outputs before this token[, in-flight
    index]) or None for padding. The in-flight index is where the previous step's sampled ids hold
    this row's last token when the host does not know it yet (-1: the host knows every token).
    histories: as `adjustment_arrays` takes them, for the rows whose penalties read their tokens."""
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    seed = np.zeros(num_rows, np.uint32)
    step = np.zeros(num_rows, np.int32)
    banned = np.full((num_rows, MAX_BANNED), -1, np.int32)
    want_logprobs = np.zeros(num_rows, bool)
    adjusting = []
    for i, row in enumerate(rows):
        if row is None:
            continue
        s, num_out = row[0], row[1]
        temperature[i] = s.temperature
        top_k[i] = s.top_k
        # a top_p below float32's smallest normal would round to 0 (or a denormal flushed to 0) and
        # keep no token at all; at that floor it keeps the top token only, which is what it means
        top_p[i] = max(s.top_p, _TOP_P_FLOOR)
        min_p[i] = s.min_p
        seed[i] = s.seed & 0xFFFFFFFF
        step[i] = num_out
        if num_out < s.min_tokens and s.banned_before_min_tokens:
            ids = s.banned_before_min_tokens
            if len(ids) > MAX_BANNED:
                raise ValueError(f"{len(ids)} ids to ban before min_tokens; the sampler holds {MAX_BANNED}")
            banned[i, :len(ids)] = ids
        want_logprobs[i] = s.wants_logprobs
        if isinstance(s, AdjustedSamplingOptions):
            adjusting.append((i, s, row[2] if len(row) > 2 else -1))
    arrays = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
                  banned=banned, want_logprobs=want_logprobs)
    arrays.update(_adjustment_arrays(adjusting, num_rows, history_len, mask_words, histories))
    return arrays


def neutral_adjustment_arrays(num_rows: int, history_len: int, mask_words: int = 1) -> dict[str, np.ndarray]:
    """The wide adjustment arrays of a step where no row adjusts its logits."""
    return {k: v for k, v in _adjustment_arrays([], num_rows, history_len, mask_words).items()
            if k in ADJUSTMENT_ARRAYS}


def adjustment_arrays(adjusting: list, num_rows: int, history_len: int, mask_words: int = 1,
                      histories: dict | None = None) -> dict[str, np.ndarray]:
    """The logit-adjustment and token-mask arrays of `num_rows` rows; adjusting: (row, its
    AdjustedSamplingOptions, in-flight index) for the rows that have some. `histories[row]`, for
    each row whose penalties read its tokens: (its known tokens, prompt first, then the outputs the
    host knows; the prompt's length), which the persistent batch keeps per seat from the
    scheduler's deltas (ScheduledRequest.token_history)."""
    return _adjustment_arrays(adjusting, num_rows, history_len, mask_words, histories)


def _adjustment_arrays(adjusting: list, num_rows: int, history_len: int, mask_words: int,
                       histories: dict | None = None) -> dict[str, np.ndarray]:
    masked = np.zeros(num_rows, bool)
    token_mask = np.zeros((num_rows, mask_words), np.int32)    # bit t of word t // 32: token t allowed
    adjust = np.zeros(num_rows, bool)
    presence = np.zeros(num_rows, np.float32)
    frequency = np.zeros(num_rows, np.float32)
    repetition = np.ones(num_rows, np.float32)
    prompt_len = np.zeros(num_rows, np.int32)
    in_flight = np.full(num_rows, -1, np.int32)
    known = np.full((num_rows, history_len), -1, np.int32)
    bias_ids = np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    histories = histories or {}
    for i, opts, src in adjusting:
        if opts.constraint is not None:
            masked[i] = True
            opts.constraint.fill(token_mask[i])
        a = opts.adjust
        if a is None:
            continue
        adjust[i] = True
        presence[i], frequency[i], repetition[i] = a.presence_penalty, a.frequency_penalty, a.repetition_penalty
        if a.needs_tokens:
            kept = histories.get(i)
            if kept is None:
                raise ValueError(f"row {i}: its penalties read its tokens, and none were given")
            tokens, prompt_len[i] = kept
            n = len(tokens)
            if n + (src >= 0) > history_len:
                raise ValueError(f"{n} known tokens do not fit the sampler's history of {history_len}")
            known[i, :n] = tokens
            in_flight[i] = src
        if a.logit_bias:
            ids, values = zip(*a.logit_bias)
            bias_ids[i, :len(ids)] = ids
            bias_values[i, :len(ids)] = values
    return dict(adjust=adjust, presence=presence, frequency=frequency, repetition=repetition,
                prompt_len=prompt_len, in_flight=in_flight, known_tokens=known, bias_ids=bias_ids,
                bias_values=bias_values, masked=masked, token_mask=token_mask)


def _masked(logits, a):
    """Tokens a row's grammar does not allow next get -inf (rows with a mask only)."""
    vocab = logits.shape[1]
    ids = jnp.arange(vocab)
    words = jnp.asarray(a["token_mask"])[:, ids // 32]                                      # [R, V]
    allowed = ((words >> (ids % 32)[None, :]) & 1) == 1
    return jnp.where(a["masked"][:, None] & ~allowed, -jnp.inf, logits)


def _adjusted(logits, a, prev_tokens):
    """Logit bias, then the repetition, frequency and presence penalties (vLLM's order), on the
    rows that ask; logits: [R, V] float32."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    # the in-flight token, if any, is one more output token after the known ones
    src = a["in_flight"]
    last = (jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], -1) if prev_tokens is not None
            else jnp.full_like(src, -1))
    tokens = jnp.concatenate([a["known_tokens"], last[:, None]], axis=1)                   # [R, L + 1]
    position = jnp.arange(tokens.shape[1])[None, :]
    is_output = (position >= a["prompt_len"][:, None]) & (tokens >= 0)
    safe = jnp.where(tokens >= 0, tokens, vocab)                                             # vocab: dropped
    seen = jnp.zeros((num_rows, vocab), bool).at[rows, safe].set(True, mode="drop")
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, jnp.where(is_output, safe, vocab)].add(
        1.0, mode="drop")
    biased = logits.at[rows, jnp.where(a["bias_ids"] >= 0, a["bias_ids"], vocab)].add(a["bias_values"], mode="drop")
    rep = a["repetition"][:, None]
    out = jnp.where(seen, jnp.where(biased > 0, biased / rep, biased * rep), biased)
    out = out - a["frequency"][:, None] * counts - a["presence"][:, None] * (counts > 0)
    return jnp.where(a["adjust"][:, None], out, logits)


_TOP_P_FLOOR = float(np.finfo(np.float32).tiny)


def _filtered(scaled, top_k, top_p, min_p):
    """Mask logits outside top-k / top-p / min-p per row. scaled: [R, V] float32."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)                                  # [R, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)          # [R, 1]
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (the token crossing it included)
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = before < top_p[:, None]
    p_cut = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    max_prob = probs_sorted[:, :1]
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = (scaled >= kth) & (scaled >= p_cut) & (probs >= min_p[:, None] * max_prob)
    return jnp.where(keep, scaled, -jnp.inf)


def _keys(a, stream: int | None = None):
    """Each row's key: fold_in(PRNGKey(seed), output index), or an independent stream of it."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(a["seed"], a["step"])
    return keys if stream is None else jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)


def _coupled_with_draft(drawn, probs, a):
    """Rows a draft model sampled too (draft_tokens >= 0): keep its token g with probability
    min(1, p(g) / q(g)), else draw from max(p - q, 0) renormalised; other rows keep `drawn`.
    probs: p, [R, V]; a["draft_probs"], a["draft_tokens"]: the draft's q and g, [M, V] and [M]."""
    num_rows, vocab = probs.shape
    q = a["draft_probs"][:num_rows]
    g = a["draft_tokens"][:num_rows]
    guess = jnp.maximum(g, 0)
    p_g = jnp.take_along_axis(probs, guess[:, None], axis=-1)[:, 0]
    q_g = jnp.take_along_axis(q, guess[:, None], axis=-1)[:, 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(_keys(a, 1))
    accept = u * q_g < p_g                                 # u < p/q without dividing by a zero q
    residual = jnp.maximum(probs - q, 0.0)
    # p == q leaves no residual (and then g is always kept): fall back to p without g
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual,
                         jnp.where(jnp.arange(vocab)[None, :] == guess[:, None], 0.0, probs))
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(_keys(a, 2))
    resampled = jnp.argmax(jnp.log(residual) + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(g >= 0, jnp.where(accept, guess, resampled), drawn)


def sample(logits: jax.Array, a: dict, prev_tokens: jax.Array | None = None, *, pad_to: int,
           probs_out: bool = False, logprobs_mode: str = "raw") -> dict[str, jax.Array]:
    """logits: [R, V] float32 -> sampled ids [R] and logprob information. `padded_tokens` holds
    the ids again in a fixed [pad_to] array: the next step reads its placeholders from it on the
    device, and one shape serves every bucket. prev_tokens: the previous step's `padded_tokens`,
    where the penalties find a row's in-flight token. probs_out: also return `probs`, each row's
    distribution its token was drawn from ([pad_to, V]; one-hot for greedy rows): a draft model's
    sampler. With `draft_probs` and `draft_tokens` in `a` (a draft model's outputs for the same
    rows), sampled rows are coupled with the draft's (_coupled_with_draft). logprobs_mode: "raw"
    or "processed" (module docstring), static."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    processed = logprobs_mode == "processed"
    num_rows, vocab = logits.shape
    raw_logits = logits            # raw logprobs describe the model's distribution, before any mask
    if "adjust" in a:
        logits = jax.lax.cond(jnp.any(a["adjust"]), lambda x: _adjusted(x, a, prev_tokens), lambda x: x, logits)
    if "masked" in a:
        logits = jax.lax.cond(jnp.any(a["masked"]), lambda x: _masked(x, a), lambda x: x, logits)
    banned = a["banned"]
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], banned.shape)
    logits = logits.at[rows, jnp.where(banned >= 0, banned, vocab)].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = a["temperature"]

    coupled = "draft_probs" in a
    # the sampled rows' distributions, only where a draft model's guesses need them (a cond's
    # outputs are computed whether or not they are used)
    with_probs = probs_out or coupled
    one_hot = jax.nn.one_hot(greedy, vocab, dtype=jnp.float32) if with_probs else None

    def draw(_):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        needs_filter = jnp.any((a["top_k"] > 0) | (a["top_p"] < 1.0) | (a["min_p"] > 0.0))
        scaled = jax.lax.cond(needs_filter, lambda s: _filtered(s, a["top_k"], a["top_p"], a["min_p"]),
                              lambda s: s, scaled)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(_keys(a))
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        kept = scaled if processed else None     # the sampled rows' distribution, for processed logprobs
        if not with_probs:
            return drawn, None, kept
        probs = jax.nn.softmax(scaled, axis=-1)
        if coupled:
            drawn = jax.lax.cond(jnp.any(a["draft_tokens"][:num_rows] >= 0),
                                 lambda d: _coupled_with_draft(d, probs, a), lambda d: d, drawn)
        return drawn, probs, kept

    def all_greedy(_):
        return greedy, one_hot, (logits if processed else None)

    drawn, probs, drawn_from = jax.lax.cond(jnp.any(temperature > 0), draw, all_greedy, None)
    tokens = jnp.where(temperature > 0, drawn, greedy)
    # processed: a sampled row's scaled and truncated logits, a greedy row's adjusted ones
    logprob_logits = jnp.where((temperature > 0)[:, None], drawn_from, logits) if processed else raw_logits

    def logprob_info(_):
        lp = batch_invariant.log_softmax(logprob_logits)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def no_logprobs(_):
        return (jnp.zeros((num_rows,), jnp.float32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32))

    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(a["want_logprobs"]), logprob_info, no_logprobs, None)
    padded = jnp.zeros((pad_to,), jnp.int32).at[:num_rows].set(tokens)
    out = dict(tokens=tokens, logprob=chosen, top_ids=top_ids, top_logprobs=top_lp, padded_tokens=padded)
    if probs_out:
        probs = jnp.where((temperature > 0)[:, None], probs, one_hot)
        out["probs"] = jnp.zeros((pad_to, vocab), jnp.float32).at[:num_rows].set(probs)
    return out
