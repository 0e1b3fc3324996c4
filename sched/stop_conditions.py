"""When a request stops, decided right after a token is appended (token-level conditions only).

Stop strings need text, so the engine's incremental detokenizer handles them and ends the request
through `Scheduler.finish_requests`. Here: EOS, stop token ids, max_tokens, max_model_len.
A token that is both a stop and the last allowed one reports "stop": the model chose to end.
"""

from __future__ import annotations

from jaxserve.sched.request import Request


def check_stop(req: Request, max_model_len: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if req must finish after its last appended token, else None."""
    # runs for every request after every step: the lists read directly, not through properties
    outputs = req.output_token_ids
    n_out = len(outputs)
    if n_out == 0:
        return None
    if n_out >= req.min_tokens:
        last = outputs[-1]
        if not req.ignore_eos and last in req.eos_token_ids:
            return ("stop", None)
        if last in req.stop_token_ids:
            return ("stop", last)
    if n_out >= req.max_tokens or len(req.prompt_token_ids) + n_out >= max_model_len:
        return ("length", None)
    return None


def append_until_stop(req: Request, new: tuple[int, ...], max_model_len: int):
    """Append new tokens one at a time, as single steps would have: the first that ends the
    request is its last, and what a verification sampled after it is dropped. Returns (the tokens
    appended, check_stop's verdict for the last)."""
    for i, t in enumerate(new):
        req.output_token_ids.append(t)
        stop = check_stop(req, max_model_len)
        if stop is not None:
            return new[:i + 1], stop
    return new, None
