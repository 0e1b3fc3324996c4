"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every row draws from its own key, fold_in(PRNGKey(seed), output index), so a seeded request
samples the same tokens whatever else shares its batch, and after a preemption. Filters that
need a sort of the vocabulary run only when some row asks for them (lax.cond), and logprobs only
when some row wants them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sched.sampling import MAX_BANNED_IDS as MAX_BANNED
from jaxserve.sched.sampling import SamplingOptions


def sampling_arrays(rows: list[tuple[SamplingOptions, int] | None], num_rows: int) -> dict[str, np.ndarray]:
    """Host-side arrays for `sample`; rows[i] = (options, outputs before this token) or None for padding."""
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    seed = np.zeros(num_rows, np.uint32)
    step = np.zeros(num_rows, np.int32)
    banned = np.full((num_rows, MAX_BANNED), -1, np.int32)
    want_logprobs = np.zeros(num_rows, bool)
    for i, row in enumerate(rows):
        if row is None:
            continue
        s, num_out = row
        temperature[i] = s.temperature
        top_k[i] = s.top_k
        top_p[i] = s.top_p
        min_p[i] = s.min_p
        seed[i] = s.seed & 0xFFFFFFFF
        step[i] = num_out
        if num_out < s.min_tokens and s.banned_before_min_tokens:
            ids = s.banned_before_min_tokens
            if len(ids) > MAX_BANNED:
                raise ValueError(f"{len(ids)} ids to ban before min_tokens; the sampler holds {MAX_BANNED}")
            banned[i, :len(ids)] = ids
        want_logprobs[i] = s.wants_logprobs
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
                banned=banned, want_logprobs=want_logprobs)


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


def sample(logits: jax.Array, a: dict, *, pad_to: int) -> dict[str, jax.Array]:
    """logits: [R, V] float32 -> sampled ids [R] and logprob information. `padded_tokens` holds
    the ids again in a fixed [pad_to] array: the next step reads its placeholders from it on the
    device, and one shape serves every bucket."""
    num_rows, vocab = logits.shape
    raw_logits = logits            # logprobs describe the model's distribution, before any mask
    banned = a["banned"]
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], banned.shape)
    logits = logits.at[rows, jnp.where(banned >= 0, banned, vocab)].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = a["temperature"]

    def draw(_):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        needs_filter = jnp.any((a["top_k"] > 0) | (a["top_p"] < 1.0) | (a["min_p"] > 0.0))
        scaled = jax.lax.cond(needs_filter, lambda s: _filtered(s, a["top_k"], a["top_p"], a["min_p"]),
                              lambda s: s, scaled)
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(a["seed"], a["step"])
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
        return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    tokens = jnp.where(temperature > 0, drawn, greedy)

    def logprob_info(_):
        lp = jax.nn.log_softmax(raw_logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def no_logprobs(_):
        return (jnp.zeros((num_rows,), jnp.float32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32))

    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(a["want_logprobs"]), logprob_info, no_logprobs, None)
    padded = jnp.zeros((pad_to,), jnp.int32).at[:num_rows].set(tokens)
    return dict(tokens=tokens, logprob=chosen, top_ids=top_ids, top_logprobs=top_lp, padded_tokens=padded)
