"""The persistent batch: per-request host state the runner keeps from step to step, so packing a
step costs what changed plus a few vectorised numpy operations, not a re-pack of every request.

A request gets a seat when it first appears in a step and keeps it while it appears in every step
after; a step without it (it finished, was preempted, aborted, or simply was not scheduled) frees
the seat. A seat holds the request's block table row (`tables [S, W]`), written by deltas: the
block ids that grew since the last step; and its sampling options as per-seat values (temperature,
top-k/p, min-p, seed, logprobs wanted, the ids banned before min_tokens), written when the seat
is taken or its options object changes. What is per step, the token, its position, the sampler's
step index, the placeholder's source row and the LoRA slot, is read off the ScheduledRequest.
A request whose penalties read its tokens also keeps them on its seat: an int32 history of its
prompt and the outputs the host knows, extended by the deltas the scheduler sends
(`ScheduledRequest.token_history`: the outputs learned since its last step, or the prompt and
every output when the seat is new). The scheduler sends a delta only to a request that was in the
step before, which is exactly when its seat lasted; a delta for a history the seat does not hold
is refused, never guessed at.

`pack` returns exactly what the tests' packing oracle (tests/packing_oracle.py) returns for the
same step (the layout is batch.py's; tests/runner/test_persistent_batch.py checks it array for
array over random sequences of steps):
decode rows are gathered in one fancy index from the seats, prompt chunks and verifications of
speculative guesses (a few per step at most) take the per-request path, and rows with logit
adjustments or a grammar mask (penalties, bias, structured output) are packed per row as before.
A step where no row adjusts gets the neutral wide arrays, built once per logits-row count.

The seat's contents are checked, not trusted: a block table whose known prefix changed (a request
id reused by another engine sharing the runner, a re-admission) is rewritten whole, and options
are compared by identity, so a stale seat can cost a rewrite, never a wrong row.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxserve.runner.batch import PackedStep, num_tiles, sample_rows_bucket
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions
from jaxserve.runner.sampler import _TOP_P_FLOOR, adjustment_arrays
from jaxserve.sched.sampling import MAX_BANNED_IDS as MAX_BANNED
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN


class PersistentBatch:
    def __init__(self, shapes: RunnerShapes, *, mask_words: int = 1, seats: int = 64):
        self.shapes = shapes
        # the buckets a step may run in while the others still warm (ModelRunner.restrict_buckets)
        self.warm: frozenset[tuple[int, int]] | None = None
        self.mask_words = mask_words
        self._seat_of: dict[str, int] = {}
        self._free: list[int] = []
        self._blocks: list[tuple] = []       # per seat: the block ids its table row holds
        self._opts: list = []                # per seat: the options its sampling values came from
        self._tables = np.zeros((0, shapes.table_width), np.int32)
        self._temperature = np.zeros(0, np.float32)
        self._top_k = np.zeros(0, np.int32)
        self._top_p = np.ones(0, np.float32)
        self._min_p = np.zeros(0, np.float32)
        self._seed = np.zeros(0, np.uint32)
        self._want = np.zeros(0, bool)
        self._min_tokens = np.zeros(0, np.int32)
        self._banned = np.full((0, MAX_BANNED), -1, np.int32)
        self._bans = np.zeros(0, bool)       # banned_before_min_tokens is not empty
        self._too_many = np.zeros(0, bool)   # more banned ids than the sampler holds
        self._neutral: dict[int, dict[str, np.ndarray]] = {}
        # per seat whose request's penalties read its tokens: that history, grown by the
        # scheduler's deltas (ScheduledRequest.token_history)
        self._histories: dict[int, _TokenHistory] = {}
        self._grow(seats)

    @property
    def num_seated(self) -> int:
        return len(self._seat_of)

    def seat_of(self, request_id: str) -> int | None:
        return self._seat_of.get(request_id)

    # -- seats -------------------------------------------------------------------------------
    def _grow(self, seats: int) -> None:
        old = len(self._blocks)
        if seats <= old:
            return

        def wider(a: np.ndarray, fill) -> np.ndarray:
            out = np.full((seats,) + a.shape[1:], fill, a.dtype)
            out[:old] = a
            return out

        self._tables = wider(self._tables, 0)
        self._temperature = wider(self._temperature, 0)
        self._top_k = wider(self._top_k, 0)
        self._top_p = wider(self._top_p, 1)
        self._min_p = wider(self._min_p, 0)
        self._seed = wider(self._seed, 0)
        self._want = wider(self._want, False)
        self._min_tokens = wider(self._min_tokens, 0)
        self._banned = wider(self._banned, -1)
        self._bans = wider(self._bans, False)
        self._too_many = wider(self._too_many, False)
        self._blocks += [()] * (seats - old)
        self._opts += [None] * (seats - old)
        # lowest seats first (pop from the end)
        self._free = list(range(seats - 1, old - 1, -1)) + self._free

    def _take_seat(self) -> int:
        if not self._free:
            self._grow(2 * len(self._blocks))
        return self._free.pop()

    def _release(self, seat: int) -> None:
        n = len(self._blocks[seat])
        if n:
            self._tables[seat, :n] = 0
        self._blocks[seat] = ()
        self._opts[seat] = None
        self._histories.pop(seat, None)
        self._free.append(seat)

    def _sync_table(self, seat: int, block_ids: tuple) -> None:
        held = self._blocks[seat]
        if block_ids is held:
            return
        n, m = len(held), len(block_ids)
        if m >= n and block_ids[:n] == held:
            if m > n:          # the delta: blocks allocated since the last step
                self._tables[seat, n:m] = block_ids[n:]
        else:                  # the known prefix changed: rewrite the row
            self._tables[seat, :m] = block_ids
            if n > m:
                self._tables[seat, m:n] = 0
        self._blocks[seat] = block_ids

    def _sync_options(self, seat: int, s) -> None:
        if s is self._opts[seat]:
            return
        self._opts[seat] = s
        self._temperature[seat] = s.temperature
        self._top_k[seat] = s.top_k
        # see sampler.sampling_arrays: a top_p below float32's smallest normal keeps the top token
        self._top_p[seat] = max(s.top_p, _TOP_P_FLOOR)
        self._min_p[seat] = s.min_p
        self._seed[seat] = s.seed & 0xFFFFFFFF
        self._want[seat] = s.wants_logprobs
        self._min_tokens[seat] = s.min_tokens
        ids = s.banned_before_min_tokens
        self._banned[seat] = -1
        self._too_many[seat] = len(ids) > MAX_BANNED
        self._bans[seat] = bool(ids)
        if ids and not self._too_many[seat]:
            self._banned[seat, :len(ids)] = ids

    # -- one step ----------------------------------------------------------------------------
    def pack(self, sched_out, prev_rows: Mapping[str, int] | None = None) -> PackedStep:
        """The PackedStep of `sched_out` (batch.py's layout), from the seats (updated here)."""
        shapes = self.shapes
        block_size, tile = shapes.block_size, shapes.prefill_tile
        seat_of = self._seat_of
        blocks, opts = self._blocks, self._opts
        now: dict[str, int] = {}
        # five ints per decode row (a one-token step, or one token of a verification):
        # (seat, position, token id, placeholder source row, LoRA slot)
        # (flat: a list of ints converts to an array several times faster than a list of tuples)
        dec: list[int] = []
        # four ints per logits row: (seat, the sampler's step index, in-flight index, row); a prompt
        # chunk's row is known once D is: (logits row, first tile, tokens) in `pre_last`
        smp: list[int] = []         # flat, as dec
        pre_last: list[tuple[int, int, int]] = []
        adjusting: list[tuple[int, object]] = []      # (logits row, options) with AdjustedSamplingOptions
        prompts: list[tuple] = []                     # (request, seat, first tile, tiles, source row)
        sample_rows: list[tuple[str, int]] = []
        drafts: dict[str, tuple[int, ...]] = {}
        p = 0

        for req in sched_out.requests:
            rid = req.request_id
            seat = seat_of.get(rid)
            if seat is None:
                seat = self._take_seat()
                seat_of[rid] = seat
            now[rid] = seat
            if req.block_ids is not blocks[seat]:   # the scheduler's same tuple while no block changed
                self._sync_table(seat, req.block_ids)
            s = req.sampling
            if s is not opts[seat]:
                self._sync_options(seat, s)
            ids = req.token_ids
            n = len(ids)
            start = req.num_computed_tokens
            if n == 1 and not req.num_draft_tokens:
                # a decode (nearly every row): its token, or the placeholder of the step in flight
                last = ids[0]
                src = -1
                if last == PLACEHOLDER_TOKEN:
                    src = prev_rows.get(rid, -1) if prev_rows is not None else -1
                    if src < 0:
                        raise ValueError(f"request {rid!r}: a placeholder token the previous step did not sample")
                    last = 0
                row = len(dec) // 5
                dec += (seat, start, last, src, req.lora_slot)
                if req.sample:
                    r = len(smp) >> 2
                    smp += (seat, req.num_output_tokens, src, row)
                    if isinstance(s, AdjustedSamplingOptions):
                        adjusting.append((r, s))
                        if req.token_history is not None:
                            self._extend_history(seat, req)
                    sample_rows.append((rid, r))
                elif req.token_history is not None:    # a prompt's one-token chunk
                    self._extend_history(seat, req)
                continue
            if req.token_history is not None:    # prompt chunks and verifications: a few per step
                self._extend_history(seat, req)
            if req.num_draft_tokens:
                # one decode row per token, each seeing the context through its own position
                r = len(smp) >> 2
                d = len(dec) // 5
                for j in range(n):
                    dec += (seat, start + j, ids[j], -1, req.lora_slot)
                    smp += (seat, req.num_output_tokens + j, -1, d + j)
                    if isinstance(s, AdjustedSamplingOptions):
                        adjusting.append((r + j, s))
                sample_rows.append((rid, r))
                drafts[rid] = req.draft_token_ids
                continue
            last = ids[-1]
            src = -1
            if last == PLACEHOLDER_TOKEN or (n > 1 and PLACEHOLDER_TOKEN in ids):
                if (prev_rows is None or rid not in prev_rows or ids.count(PLACEHOLDER_TOKEN) != 1
                        or last != PLACEHOLDER_TOKEN):
                    raise ValueError(f"request {rid!r}: a placeholder token the previous step did not sample")
                src = prev_rows[rid]
            tiles = num_tiles(n, tile)     # a prompt chunk (one-token steps took the path above)
            prompts.append((req, seat, p, tiles, src))
            row = -1
            p += tiles
            if req.sample:
                r = len(smp) >> 2
                # the penalties find an in-flight last token where the step finds its placeholder
                smp += (seat, req.num_output_tokens, src, row)
                if row < 0:
                    pre_last.append((r, prompts[-1][2], n))
                if isinstance(s, AdjustedSamplingOptions):
                    adjusting.append((r, s))
                sample_rows.append((rid, r))

        # seats of requests this step does not carry are freed (every id in `now` is in seat_of,
        # a new one added above: equal sizes mean equal sets)
        if len(now) != len(seat_of):
            for rid, seat in seat_of.items():
                if rid not in now:
                    self._release(seat)
        self._seat_of = now

        D, P = shapes.pick(len(dec) // 5, p, self.warm)
        T = D + P * tile
        R = sample_rows_bucket(D, P)
        table_width = shapes.table_width
        input_ids = np.zeros(T, np.int32)
        token_src = np.full(T, -1, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.zeros(T, np.int32)
        lora_slots = np.zeros(T, np.int32)
        dec_lens = np.zeros(D, np.int32)
        dec_tables = np.zeros((D, table_width), np.int32)
        pre_lens = np.zeros(P, np.int32)
        pre_tables = np.zeros((P, table_width), np.int32)
        logits_rows = np.zeros(R, np.int32)

        d = len(dec) // 5
        if d:
            cols = np.array(dec, np.int64).reshape(d, 5).T      # [5, d]
            seats = cols[0]
            pos = cols[1].astype(np.int32)
            input_ids[:d] = cols[2]
            token_src[:d] = cols[3]
            positions[:d] = pos
            lora_slots[:d] = cols[4]
            dec_lens[:d] = pos + 1
            dec_tables[:d] = self._tables[seats]
            slots[:d] = self._tables[seats, pos // block_size] * block_size + pos % block_size
        for req, seat, first, tiles, src in prompts:
            n = len(req.token_ids)
            start = req.num_computed_tokens
            base = D + first * tile
            ids = np.asarray(req.token_ids, np.int32)
            if src >= 0:
                ids[-1] = 0
                token_src[base + n - 1] = src
            input_ids[base:base + n] = ids
            lora_slots[base:base + n] = req.lora_slot
            # padding rows of the last tile continue the positions (their outputs are discarded)
            positions[base:base + tiles * tile] = np.arange(start, start + tiles * tile, dtype=np.int32)
            pos = np.arange(start, start + n)
            slots[base:base + n] = self._tables[seat, pos // block_size] * block_size + pos % block_size
            pre_lens[first:first + tiles] = start + tile * np.arange(1, tiles + 1, dtype=np.int32)
            pre_tables[first:first + tiles] = self._tables[seat]

        r = len(smp) >> 2
        if r:
            scols = np.array(smp, np.int64).reshape(r, 4).T     # [4, r]
            logits_rows[:r] = scols[3]
            for i, first, n in pre_last:
                logits_rows[i] = D + first * tile + n - 1
        else:
            scols = np.zeros((4, 0), np.int64)
        arrays = dict(
            input_ids=input_ids, token_src=token_src, positions=positions, slot_mapping=slots,
            dec_kv_lens=dec_lens, dec_tables=dec_tables, dec_num=np.array([d], np.int32),
            pre_kv_lens=pre_lens, pre_tables=pre_tables, pre_num=np.array([p], np.int32),
            logits_rows=logits_rows, lora_slots=lora_slots,
        )
        sampling = self._sampling(R, scols[0], scols[1], scols[2], adjusting)
        return PackedStep((D, P), arrays, sampling, tuple(sample_rows), drafts)

    def _sampling(self, R: int, seats: np.ndarray, steps: np.ndarray, srcs: np.ndarray,
                  adjusting) -> dict[str, np.ndarray]:
        """sampler.sampling_arrays' arrays, gathered from the seats."""
        temperature = np.zeros(R, np.float32)
        top_k = np.zeros(R, np.int32)
        top_p = np.ones(R, np.float32)
        min_p = np.zeros(R, np.float32)
        seed = np.zeros(R, np.uint32)
        step = np.zeros(R, np.int32)
        banned = np.full((R, MAX_BANNED), -1, np.int32)
        want = np.zeros(R, bool)
        r = len(seats)
        if r:
            temperature[:r] = self._temperature[seats]
            top_k[:r] = self._top_k[seats]
            top_p[:r] = self._top_p[seats]
            min_p[:r] = self._min_p[seats]
            seed[:r] = self._seed[seats]
            want[:r] = self._want[seats]
            step[:r] = steps
            bans = self._bans[seats] & (step[:r] < self._min_tokens[seats])
            if bans.any():
                if (bans & self._too_many[seats]).any():
                    seat = int(seats[np.flatnonzero(bans & self._too_many[seats])[0]])
                    raise ValueError(f"{len(self._opts[seat].banned_before_min_tokens)} ids to ban before "
                                     f"min_tokens; the sampler holds {MAX_BANNED}")
                banned[:r][bans] = self._banned[seats[bans]]
        arrays = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
                      banned=banned, want_logprobs=want)
        if adjusting:
            rows = [(i, s, int(srcs[i])) for i, s in adjusting]
            histories = {i: self._history(int(seats[i])) for i, s in adjusting if s.reads_tokens}
            arrays.update(adjustment_arrays(rows, R, self.shapes.max_model_len, self.mask_words, histories))
        else:
            arrays.update(self._neutral_adjustments(R))
        return arrays

    def _extend_history(self, seat: int, req) -> None:
        """Apply req's token_history to its seat's copy of its tokens: start it afresh from a
        prompt, or append the new outputs to the copy the delta was made against."""
        delta = req.token_history
        h = self._histories.get(seat)
        if delta.prompt_token_ids is not None:
            h = self._histories[seat] = _TokenHistory(req.request_id, delta.prompt_token_ids,
                                                      self.shapes.max_model_len)
        elif h is None or h.request_id != req.request_id or h.num_outputs != delta.num_outputs_before:
            held = "none" if h is None or h.request_id != req.request_id else f"{h.num_outputs} outputs"
            raise ValueError(f"request {req.request_id!r}: a token delta after {delta.num_outputs_before} outputs, "
                             f"but its seat holds {held} (the scheduler sends the prompt to a new seat)")
        if delta.new_output_token_ids:
            h.append(delta.new_output_token_ids)

    def _history(self, seat: int) -> tuple[np.ndarray, int]:
        """(the known tokens, prompt length) of the request on `seat` whose penalties read them."""
        h = self._histories.get(seat)
        if h is None:
            raise ValueError(f"seat {seat}: a row whose penalties read its tokens, and no token history "
                             f"reached it (ScheduledRequest.token_history)")
        return h.tokens, h.prompt_len

    def _neutral_adjustments(self, R: int) -> dict[str, np.ndarray]:
        """A step where no row adjusts its logits: the same read-only arrays every time (the runner
        passes device-resident ones for the wide arrays in such steps)."""
        out = self._neutral.get(R)
        if out is None:
            out = adjustment_arrays([], R, self.shapes.max_model_len, self.mask_words)
            for a in out.values():
                a.flags.writeable = False
            self._neutral[R] = out
        return out


class _TokenHistory:
    """One request's prompt and known outputs in an int32 buffer, grown by the scheduler's deltas."""

    __slots__ = ("request_id", "prompt_len", "_buf", "_n")

    def __init__(self, request_id: str, prompt, capacity: int) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self._buf = np.empty(max(capacity, self.prompt_len), np.int32)
        self._buf[:self.prompt_len] = prompt
        self._n = self.prompt_len

    @property
    def num_outputs(self) -> int:
        return self._n - self.prompt_len

    @property
    def tokens(self) -> np.ndarray:
        """The tokens known now (a view)."""
        return self._buf[:self._n]

    def append(self, outputs) -> None:
        n = self._n + len(outputs)
        if n > len(self._buf):   # past the sampler's history: it refuses the row (the length says so)
            self._buf = np.concatenate([self._buf[:self._n], np.empty(n - self._n, np.int32)])
        self._buf[self._n:n] = outputs
        self._n = n
