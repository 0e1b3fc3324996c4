"""The persistent batch (runner/persistent_batch.py) packs every step exactly as a fresh
the packing oracle (tests/packing_oracle.py) does: over random sequences of steps where requests arrive, decode with and
without placeholders, prefill in chunks, verify guesses, grow their block tables, change their
options, leave, come back under new blocks and reuse the ids of requests that left. The tokens
penalties count reach it as the scheduler sends them (sched/step_plan.py's deltas, on the seat's
copy), the oracle gets them whole."""

import numpy as np
import pytest

from tests.packing_oracle import pack_step
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions, LogitAdjustments
from jaxserve.runner.persistent_batch import PersistentBatch
from jaxserve.sched.sampling import MAX_BANNED_IDS, SamplingOptions
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput, TokenHistory
from jaxserve.sched.step_plan import StepPlan

SHAPES = RunnerShapes(block_size=4, max_model_len=64, prefill_tile=8, decode_buckets=(1, 4, 16, 64),
                      prefill_buckets=(0, 1, 2, 4, 8, 16, 32), decode_only_buckets=(1, 2, 4, 8, 16, 64))
MASK_WORDS = 3


def _options(rng) -> SamplingOptions:
    kind = rng.integers(0, 6)
    if kind == 0:
        return SamplingOptions()
    if kind == 1:
        return SamplingOptions(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 5)),
                               top_p=float(rng.uniform(0.5, 1)), seed=int(rng.integers(0, 2**40)),
                               num_logprobs=int(rng.integers(0, 3)))
    if kind == 2:
        return SamplingOptions(min_tokens=int(rng.integers(1, 6)), min_p=0.1,
                               banned_before_min_tokens=tuple(int(x) for x in rng.integers(0, 50, rng.integers(1, 4))))
    if kind == 3:   # a bias only: it reads no tokens
        return AdjustedSamplingOptions(temperature=0.7, seed=3, adjust=LogitAdjustments(logit_bias=((3, 1.0),)))
    return AdjustedSamplingOptions(temperature=0.7, seed=3, adjust=LogitAdjustments(
        repetition_penalty=1.2, logit_bias=((3, 1.0),)))


class _Live:
    """A request's state as the scheduler would carry it between steps."""

    def __init__(self, rid, rng, free_blocks):
        self.rid = rid
        self.prompt = int(rng.integers(1, 30))
        self.computed = 0
        self.outputs = 0
        self.pending = False
        self.blocks: list[int] = []
        self.free_blocks = free_blocks
        self.options = _options(rng)
        self.lora = int(rng.integers(0, 3))
        # the tokens penalties count, and the scheduler's record of what it sent (StepPlan.token_history
        # reads these as it reads a Request's)
        self.prompt_token_ids = [int(x) for x in rng.integers(0, 50, self.prompt)]
        self.output_token_ids: list[int] = []
        self.history_step = None
        self.num_outputs_sent = 0

    def grow_to(self, tokens):
        while len(self.blocks) * SHAPES.block_size < tokens:
            self.blocks.append(self.free_blocks.pop())

    def schedule(self, rng, prev_rows, draft_ok, step) -> ScheduledRequest:
        c0 = self.computed
        h = StepPlan(0, 1, step=step).token_history(self) if self.options.reads_tokens else None
        if c0 < self.prompt:   # a prompt chunk
            n = int(min(self.prompt - c0, rng.integers(1, 20)))
            end = c0 + n
            self.grow_to(end)
            sample = end == self.prompt
            r = ScheduledRequest(self.rid, tuple(int(x) for x in rng.integers(0, 50, n)), c0, tuple(self.blocks),
                                 sample, self.outputs, self.options, lora_slot=self.lora, token_history=h)
        elif draft_ok and not self.pending and rng.random() < 0.2 and not isinstance(self.options, AdjustedSamplingOptions):
            k = int(rng.integers(1, 3))
            self.grow_to(c0 + 1 + k)
            r = ScheduledRequest(self.rid, tuple(int(x) for x in rng.integers(0, 50, 1 + k)), c0, tuple(self.blocks),
                                 True, self.outputs, self.options, num_draft_tokens=k, lora_slot=self.lora,
                                 token_history=h)
            end = c0 + 1
        else:
            self.grow_to(c0 + 1)
            placeholder = self.pending and self.rid in prev_rows
            token = PLACEHOLDER_TOKEN if placeholder else int(rng.integers(0, 50))
            r = ScheduledRequest(self.rid, (token,), c0, tuple(self.blocks), True, self.outputs, self.options,
                                 lora_slot=self.lora, token_history=h)
            end = c0 + 1
        self.computed = end
        if r.sample:
            self.outputs += 1
            self.pending = True
        return r


@pytest.mark.parametrize("seed", range(6))
def test_persistent_batch_packs_what_a_fresh_pack_does(seed):
    rng = np.random.default_rng(seed)
    free_blocks = list(range(1, 4000))
    rng.shuffle(free_blocks)
    batch = PersistentBatch(SHAPES, mask_words=MASK_WORDS, seats=2)   # small: the seats must grow
    live: dict[str, _Live] = {}
    prev_rows: dict[str, int] = {}
    next_id = 0
    for step in range(60):
        # arrivals (ids of requests that left are reused now and then)
        for _ in range(int(rng.integers(0, 4))):
            if len(live) < 24:
                rid = f"r{int(rng.integers(0, next_id + 1)) if rng.random() < 0.3 else next_id}"
                next_id += 1
                if rid not in live:
                    live[rid] = _Live(rid, rng, free_blocks)
        # departures (finished or preempted: the blocks go back; a preempted one restarts)
        for rid in list(live):
            if rng.random() < 0.08:
                free_blocks.extend(live.pop(rid).blocks)
            elif rng.random() < 0.03:
                r = live[rid]
                free_blocks.extend(r.blocks)
                r.blocks, r.computed, r.pending = [], 0, False
        # a request's options may change (a new options object) now and then
        for r in live.values():
            if rng.random() < 0.05:
                r.options = _options(rng)
        # some running requests sit a step out
        chosen = [r for r in live.values() if rng.random() < 0.9]
        draft_ok = rng.random() < 0.3
        reqs = tuple(r.schedule(rng, prev_rows, draft_ok, step) for r in chosen[:16])
        if not reqs:
            continue      # the scheduler's step counts, the runner packs nothing: deltas start afresh
        out = SchedulerOutput(reqs, sum(len(r.token_ids) for r in reqs))
        tokens = {r.rid: (r.prompt_token_ids, r.output_token_ids) for r in chosen[:16]}
        want = pack_step(out, SHAPES, prev_rows, mask_words=MASK_WORDS, tokens=tokens)
        got = batch.pack(out, prev_rows)
        assert got.bucket == want.bucket
        assert got.sample_rows == want.sample_rows and got.drafts == want.drafts
        assert got.arrays.keys() == want.arrays.keys() and got.sampling.keys() == want.sampling.keys()
        for k in want.arrays:
            np.testing.assert_array_equal(got.arrays[k], want.arrays[k], err_msg=f"step {step}: {k}")
            assert got.arrays[k].dtype == want.arrays[k].dtype
        for k in want.sampling:
            np.testing.assert_array_equal(got.sampling[k], want.sampling[k], err_msg=f"step {step}: {k}")
            assert got.sampling[k].dtype == want.sampling[k].dtype
        assert batch.num_seated == len(reqs)
        prev_rows = {rid: row for rid, row in want.sample_rows if rid not in want.drafts}
        for r in chosen:      # what update() does between steps: sampled tokens join the outputs
            if rng.random() < 0.7:
                r.output_token_ids.append(int(rng.integers(0, 50)))
        for r in chosen:
            if r.rid not in prev_rows:
                r.pending = False


def test_a_placeholder_without_its_previous_row_is_refused():
    batch = PersistentBatch(SHAPES)
    out = SchedulerOutput((ScheduledRequest("a", (PLACEHOLDER_TOKEN,), 3, (1,), True, 1),), 1)
    with pytest.raises(ValueError, match="placeholder"):
        batch.pack(out, {})
    with pytest.raises(ValueError, match="placeholder"):
        pack_step(out, SHAPES, {})


def test_too_many_banned_ids_are_refused_as_a_fresh_pack_refuses_them():
    opts = SamplingOptions(min_tokens=2, banned_before_min_tokens=tuple(range(MAX_BANNED_IDS + 1)))
    out = SchedulerOutput((ScheduledRequest("a", (5,), 3, (1,), True, 0, opts),), 1)
    with pytest.raises(ValueError, match="to ban"):
        pack_step(out, SHAPES)
    with pytest.raises(ValueError, match="to ban"):
        PersistentBatch(SHAPES).pack(out)


def test_a_token_delta_the_seat_cannot_extend_is_refused():
    """A delta is made against the copy the seat held after the request's last step; one for a seat
    without that copy (a new seat, or a copy of another length) fails the step, never guessed at."""
    opts = AdjustedSamplingOptions(adjust=LogitAdjustments(presence_penalty=1.0))

    def step(rid, history):
        return SchedulerOutput((ScheduledRequest(rid, (5,), 3, (1,), True, 1, opts, token_history=history),), 1)

    batch = PersistentBatch(SHAPES)
    with pytest.raises(ValueError, match="token delta"):
        batch.pack(step("a", TokenHistory(0, (7,))))           # a new seat, and no prompt
    batch = PersistentBatch(SHAPES)
    got = batch.pack(step("a", TokenHistory(0, (7,), (1, 2, 3))))
    assert got.sampling["known_tokens"][0, :5].tolist() == [1, 2, 3, 7, -1]
    got = batch.pack(step("a", TokenHistory(1, (8, 9))))
    assert got.sampling["known_tokens"][0, :6].tolist() == [1, 2, 3, 7, 8, 9]
    assert got.sampling["prompt_len"][0] == 3
    with pytest.raises(ValueError, match="token delta after 2 outputs, but its seat holds 3 outputs"):
        batch.pack(step("a", TokenHistory(2, (9,))))
    batch.pack(step("b", TokenHistory(0, (), (4,))))           # "a" left: its seat and copy are gone
    with pytest.raises(ValueError, match="token delta"):
        batch.pack(step("a", TokenHistory(3, ())))
