"""Draft tokens by n-gram lookup over a request's own tokens (prompt lookup decoding), no model.

Text that quotes, summarises, edits or repeats its context continues the way some earlier part of
it did: find the most recent earlier occurrence of the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min, a longer match first since it predicts better) and
propose the tokens that followed it. The search is one vectorised comparison per n over the
request's tokens (numpy), so it costs microseconds per request per step at a few thousand tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (the
    largest n in [min_n, max_n] that has one); [] when none matches."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # windows starting at 0 .. length - n - 1: every earlier n-gram with at least one token after it
        windows = sliding_window_view(seq[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []
