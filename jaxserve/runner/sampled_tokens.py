"""A step's sampled tokens read back on the host: per request its token (or, verifying a draft's
guesses, the guesses kept and one more) and, where asked, their logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def read_sampled(sampler_out: dict, sample_rows, wants: np.ndarray,
                 drafts: dict | None) -> tuple[dict[str, list[int]], dict[str, list[SampledToken]]]:
    """sampler_out: the sampler's arrays (their copies to the host started at dispatch);
    sample_rows: (request id, first logits row); wants: per logits row, whether it asked for
    logprobs; drafts: request id -> the guesses its rows verify."""
    # Python ints once for the whole step (indexing a numpy array per row costs more)
    tokens = np.asarray(sampler_out["tokens"]).tolist()
    drafts = drafts or {}
    any_logprobs = bool(wants.any())
    if not drafts and not any_logprobs:
        # the common step: one plain token per request
        return {rid: [tokens[row]] for rid, row in sample_rows}, {}
    lp = top_ids = top_lp = None
    if any_logprobs:
        lp, top_ids, top_lp = (np.asarray(sampler_out[k]) for k in ("logprob", "top_ids", "top_logprobs"))
    token_ids, logprobs = {}, {}
    for request_id, row in sample_rows:
        guesses = drafts.get(request_id, ())
        # row j sampled the token after guess j - 1: guess j is kept while it equals the token
        # row j sampled, so each kept token is exactly what one-token steps would have sampled
        kept = 0
        while kept < len(guesses) and tokens[row + kept] == guesses[kept]:
            kept += 1
        token_ids[request_id] = tokens[row:row + kept + 1]
        if any_logprobs and wants[row]:
            logprobs[request_id] = [
                SampledToken(tokens[r], float(lp[r]), tuple(zip(top_ids[r].tolist(), top_lp[r].tolist())))
                for r in range(row, row + kept + 1)]
    return token_ids, logprobs
