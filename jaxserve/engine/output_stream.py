"""One request's outputs on their way from the step thread to the coroutine streaming them.

A consumer that falls behind (a busy front: hundreds of SSE streams on one event loop) would
otherwise find one output per step waiting, and pay every layer after it (chunk, JSON, socket
write) once per token. As vLLM's output collector does, an output that arrives while the one
before it is still unread is merged into it: a streamed (DELTA) request's new tokens, text and
logprobs are appended, so the consumer reads the same stream in fewer, larger pieces; any other
output (cumulative, final only, n > 1, which are whole each time) replaces the unread one. Nothing
is merged past an error or an abort marker, which keep their place.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque

from jaxserve.outputs import CompletionOutput, RequestOutput


class OutputStream:
    """A queue of outputs and markers for one consumer (event-loop side only)."""

    __slots__ = ("_items", "_waiter", "_appends")

    def __init__(self, appends: bool) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._appends = appends      # DELTA with one sample: outputs carry only what is new

    def put(self, item) -> None:
        items = self._items
        if (items and isinstance(item, RequestOutput) and type(items[-1]) is type(item)
                and not items[-1].finished):
            items[-1] = merge_outputs(items[-1], item) if self._appends else replace_output(items[-1], item)
        else:
            items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


def replace_output(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """`then`, a whole output, in place of the unread `first`: a DELTA request with n > 1 has
    whole completions each time but sends its prompt's logprobs in one output only, so those
    are kept when `then` has none."""
    if then.prompt_logprobs is None and first.prompt_logprobs is not None:
        return dataclasses.replace(then, prompt_logprobs=first.prompt_logprobs)
    return then


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One DELTA output saying what `first` and then `then` said (one sample each)."""
    a, b = first.outputs[0], then.outputs[0]
    merged = CompletionOutput(
        index=b.index, text=a.text + b.text, token_ids=list(a.token_ids) + list(b.token_ids),
        finish_reason=b.finish_reason, stop_reason=b.stop_reason,
        logprobs=(a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None
        else None,
        cumulative_logprob=b.cumulative_logprob, message=b.message)
    # a DELTA stream carries the prompt's logprobs in one output only
    return dataclasses.replace(then, outputs=[merged],
                               prompt_logprobs=then.prompt_logprobs if then.prompt_logprobs is not None
                               else first.prompt_logprobs)
