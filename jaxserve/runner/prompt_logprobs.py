"""Prompt logprobs: for each prompt token after the first, its logprob given the tokens before it,
its rank, and the top alternatives at its position (vLLM's `SamplingParams.prompt_logprobs`).

The step computes every query row's final hidden state anyway. With prompt logprobs enabled
(`EngineConfig.enable_prompt_logprobs`) it also returns them ([T, D]), and on a step that carries
a request asking for prompt logprobs the runner calls `prompt_logprobs` on them: the LM head on
the rows, log_softmax, the logprob and rank of each row's target (the prompt token after the
row's, from the request's own prompt ids, since a chunk may end before it) and the top
MAX_LOGPROBS. It is compiled once per step row count T (every bucket's D + P * tile) at start-up,
like the steps; a step where no request asks never calls it, and an engine without the option
compiles nothing more and runs the steps it always did.

Rows go through the LM head ROW_CHUNK at a time (lax.map: [C, V] logits live at once, not
[T, V]), and a chunk where no row asks is skipped (lax.cond), so a big step beside one short
prompt pays for about that prompt's rows.

The logprobs are the model's own (raw logits: no penalty, bias, temperature or grammar mask), as
the sampler's per-token logprobs are. Prompt positions served from the prefix cache have no rows,
so a request that asks never reads the cache (sched: `Request.skip_reading_prefix_cache`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import batch_invariant
from jaxserve.runner.executables import ExecutableStore
from jaxserve.runner.step_feature import StepFeature, hidden_dtype, step_rows
from jaxserve.sampling_params import MAX_LOGPROBS

ROW_CHUNK = 128       # rows per LM-head call: [128, V] float32 logits (25 MB for V = 49152)


def prompt_logprobs(params, hidden: jax.Array, targets: jax.Array, *, config, model,
                    chunk: int = ROW_CHUNK) -> dict[str, jax.Array]:
    """hidden [T, D] (the step's final-normed rows), targets [T] int32 (the token each row's
    logits are asked about; -1: nothing asked) -> logprob [T], rank [T] (1 = the most likely
    token), top_ids, top_logprobs [T, MAX_LOGPROBS]. Rows that ask nothing hold zeros or garbage."""
    T, D = hidden.shape
    C = min(T, chunk)
    n = -(-T // C)
    pad = n * C - T
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, C, D)
    t = jnp.pad(targets, (0, pad), constant_values=-1).reshape(n, C)

    def rows(args):
        h, t = args

        def compute(_):
            logits = model.compute_logits(params, config, h)                       # [C, V] float32
            lp = batch_invariant.log_softmax(logits)                               # row-tiled in the mode
            chosen = jnp.take_along_axis(lp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
            rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
            top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
            return chosen, rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp

        def skip(_):
            return (jnp.zeros((C,), jnp.float32), jnp.zeros((C,), jnp.int32),
                    jnp.zeros((C, MAX_LOGPROBS), jnp.int32), jnp.zeros((C, MAX_LOGPROBS), jnp.float32))

        return jax.lax.cond(jnp.any(t >= 0), compute, skip, None)

    # one chunk (a step of at most ROW_CHUNK rows): no loop around it
    chosen, rank, top_ids, top_lp = (jax.lax.map(rows, (h, t)) if n > 1 else
                                     jax.tree.map(lambda x: x[None], rows((h[0], t[0]))))
    return dict(logprob=chosen.reshape(-1)[:T], rank=rank.reshape(-1)[:T],
                top_ids=top_ids.reshape(-1, MAX_LOGPROBS)[:T], top_logprobs=top_lp.reshape(-1, MAX_LOGPROBS)[:T])


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A step's prompt-logprob work, packed on the host."""

    rows: int                                      # T, the step's query rows
    targets: np.ndarray                            # [T] int32: the prompt token each row predicts; -1: none
    # (request id, prompt position of the first token predicted, its row, how many): a request's
    # rows are consecutive
    reads: tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    """Prompt logprobs of consecutive prompt positions [first, first + len) of one request."""

    first: int                     # prompt position of the first token described (>= 1)
    logprob: np.ndarray            # [n] float32: each token's logprob
    rank: np.ndarray               # [n] int32: each token's rank (1 = the most likely)
    top_ids: np.ndarray            # [n, MAX_LOGPROBS] int32, most likely first
    top_logprobs: np.ndarray       # [n, MAX_LOGPROBS] float32


def pack(sched_out, bucket: tuple[int, int], tile: int) -> PromptRows | None:
    """The rows of a step (laid out as runner/batch.py lays them) whose logits predict a prompt
    token of a request that asks for prompt logprobs; None when there are none (the usual step)."""
    D, P = bucket
    d = p = 0
    targets = None
    reads = []
    for req in sched_out.requests:
        n = len(req.token_ids)
        if req.num_draft_tokens or n == 1:   # decode rows, in order (a one-token chunk is one)
            start_row = d
            d += n
        else:                                # prefill tiles after the decode rows
            start_row = D + p * tile
            p += -(-n // tile)
        k = getattr(req.sampling, "num_prompt_logprobs", None)
        if k is None or req.num_draft_tokens:
            continue
        prompt = req.sampling.prompt_token_ids
        c0 = req.num_computed_tokens
        # the row at position q predicts the token at q + 1: a prompt token while q + 1 < len(prompt)
        last = min(c0 + n, len(prompt) - 1)
        if last <= c0:
            continue
        if targets is None:
            targets = np.full(step_rows(bucket, tile), -1, np.int32)
        count = last - c0
        targets[start_row:start_row + count] = prompt[c0 + 1:last + 1]
        reads.append((req.request_id, c0 + 1, start_row, count))
    if targets is None:
        return None
    return PromptRows(step_rows(bucket, tile), targets, tuple(reads))


class PromptLogprobs(StepFeature):
    """The runner's part: one compiled `prompt_logprobs` per step row count, run on a step's
    hidden states when its PromptRows say so, read back at collect."""

    name = "prompt_logprobs"
    step_outputs = frozenset({"hidden"})

    def __init__(self):
        if jax.process_count() > 1:
            # its start-up runs are not mirrored to the other hosts as the steps' are
            raise ValueError("enable_prompt_logprobs is not built for an engine on several hosts")

    def attach(self, runner) -> None:
        super().attach(runner)
        self.tile = runner.shapes.prefill_tile
        self.row_counts = sorted({step_rows(b, self.tile) for b in runner.shapes.buckets()})
        self._compiled = ExecutableStore(self.row_counts, self._build, "prompt_logprobs")

    def _lower(self, rows: int):
        r = self.runner
        fn = functools.partial(prompt_logprobs, config=r.model_config, model=r.model_functions)
        hidden = r.programs.input_spec((rows, r.model_config.hidden_size), hidden_dtype(r.steps))
        targets = r.programs.input_spec((rows,), jnp.int32)
        return r.programs.jit(fn).lower(r.params, hidden, targets)

    def _build(self, rows: int):
        return self.runner.programs.load_or_compile({"kind": "prompt_logprobs", "rows": rows},
                                                    lambda: self._lower(rows))

    def load(self, buckets) -> float:
        """Load (or compile) the functions of these buckets' row counts, after their steps, and run
        each once (an XLA:CPU executable's first run is slow: runner/warmup.py). Returns the
        seconds spent."""
        t0 = time.perf_counter()
        counts = sorted({step_rows(b, self.tile) for b in buckets})
        self._compiled.load(counts)
        r = self.runner
        dtype = hidden_dtype(r.steps)
        for rows in counts:
            hidden = r.programs.place(np.zeros((rows, r.model_config.hidden_size), dtype))
            targets = r.programs.place(np.zeros(rows, np.int32))   # every row asks: the full path runs
            with r.params_lock:          # the background warm-up calls this beside the step thread
                jax.block_until_ready(self._compiled[rows](r.params, hidden, targets))
        return time.perf_counter() - t0

    def loaded_on_demand(self) -> list:
        return self._compiled.loaded_on_demand

    def pack(self, sched_out, bucket: tuple[int, int] | None) -> PromptRows | None:
        return None if bucket is None else pack(sched_out, bucket, self.tile)

    def run(self, outputs, rows: PromptRows):
        """Dispatch the step's prompt logprobs; their copy to the host starts at once."""
        r = self.runner
        out = self._compiled[rows.rows](r.params, outputs["hidden"], r.programs.place(rows.targets))
        for v in out.values():
            v.copy_to_host_async()
        return rows, out

    def read(self, dispatched) -> dict[str, PromptLogprobChunk]:
        """Wait for a step's prompt logprobs: request id -> the positions its rows described."""
        rows, out = dispatched
        lp, rank, top_ids, top_lp = (np.asarray(out[k]) for k in ("logprob", "rank", "top_ids", "top_logprobs"))
        got = {}
        for rid, first, row, count in rows.reads:
            s = slice(row, row + count)
            got[rid] = PromptLogprobChunk(first, lp[s], rank[s], top_ids[s], top_lp[s])
        return got
