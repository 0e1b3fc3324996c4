"""The service-objective prefill policy: a step that carries decodes holds the prompt tokens its time
allowance admits (sched/step_budget.py), by the step-cost model (sched/step_cost.py)."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.step_budget import ServiceObjectives, decoder_bank_s, step_allowance
from jaxserve.sched.step_cost import StepCostModel

TILE = 4
# decode-only steps: 0.1 s up to 4 rows, 0.2 s up to 16; prefill: 0.05 s a tile, padded to 1/2/4/8/16 tiles;
# 0.01 s per attention item of 16 context tokens beyond depth 0
COST = StepCostModel(decode_s=((4, 0.1), (16, 0.2)),
                     prefill_s=((1, 0.05), (2, 0.1), (4, 0.2), (8, 0.4), (16, 0.8)),
                     item_s=0.01, tile=TILE, item_tokens=16, calib_context=16)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(ttft_s=100.0, tpot_s=0.5, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_num_partial_prefills", 0)
    cfg = SchedulerConfig(num_blocks=256, block_size=4, max_model_len=512, chunk_granularity=TILE,
                          objectives=ServiceObjectives(ttft_s=ttft_s, tpot_s=tpot_s), step_cost=COST, **kw)
    clock = Clock()
    return Scheduler(cfg, clock=clock), clock


def predicted_seconds(out, sched):
    """The model's time of a scheduled step (decodes at their context, chunks at their depth)."""
    decodes = [r.num_computed_tokens + 1 for r in out.requests if len(r.token_ids) == 1 and r.num_output_tokens]
    tiles = items = 0
    for r in out.requests:
        if not (len(r.token_ids) == 1 and r.num_output_tokens):
            t, i = COST.chunk_items(r.num_computed_tokens, len(r.token_ids))
            tiles, items = tiles + t, items + i
    return COST.decode_seconds(decodes) + COST.prefill_seconds(tiles, items), len(decodes), tiles


def test_the_model_reads_buckets_and_counts_items_beyond_depth_zero():
    assert COST.decode_seconds([16, 16, 16]) == pytest.approx(0.1)          # 3 rows: the 4-row bucket
    assert COST.decode_seconds([16] * 5) == pytest.approx(0.2)              # 5 rows: the 16-row bucket
    assert COST.decode_seconds([48, 16]) == pytest.approx(0.1 + 2 * 0.01)   # 48 tokens: 2 items beyond 16's one
    assert COST.chunk_items(0, 8) == (2, 0)
    assert COST.chunk_items(32, 8) == (2, 4)     # each of the 2 tiles reads 2 more 16-token items
    assert COST.chunk_items(0, 5) == (2, 0)      # a partial tile is a whole tile
    assert COST.prefill_seconds(3, 0) == pytest.approx(0.2)                 # padded to 4 tiles
    with pytest.raises(ValueError, match="exceed"):
        COST.prefill_seconds(17, 0)
    with pytest.raises(ValueError, match="increasing"):
        StepCostModel(((4, 0.1), (2, 0.1)), ((1, 0.1),), 0.0, 4, 16, 16)


def test_objectives_and_the_model_come_together_and_need_chunking():
    slo = ServiceObjectives(ttft_s=1.0, tpot_s=0.1)
    with pytest.raises(ValueError, match="together"):
        SchedulerConfig(num_blocks=8, objectives=slo)
    with pytest.raises(ValueError, match="tile"):
        SchedulerConfig(num_blocks=8, objectives=slo, step_cost=COST, chunk_granularity=8)
    with pytest.raises(ValueError, match="finite"):
        ServiceObjectives(ttft_s=float("inf"), tpot_s=0.1)


def test_steps_with_decodes_stay_within_the_floor_and_share_it_among_prompts():
    sched, clock = scheduler(tpot_s=0.5)          # floor 0.45 s
    runner = FakeRunner(256, 4)
    chats = [make_request(f"chat{i}", 8, max_tokens=40, ignore_eos=True) for i in range(3)]
    longs = [make_request(f"long{i}", 200, max_tokens=2, ignore_eos=True) for i in range(2)]
    seen = []

    def on_step(i, out):
        clock.now += 0.01                         # TTFT never at risk (100 s): the floor rules
        t, decodes, tiles = predicted_seconds(out, sched)
        seen.append((t, decodes, tiles, sum(1 for r in out.requests if len(r.token_ids) > 1)))

    drive(sched, chats, runner=runner, on_step=on_step, arrivals={3: longs})
    with_decodes = [s for s in seen if s[1] and s[2]]
    assert with_decodes, "no step mixed decodes and prompt chunks"
    assert all(t <= 0.45 + 1e-9 for t, *_ in with_decodes)
    # the floor holds more than one tile beside 3 decodes, and both long prompts share some steps
    assert max(tiles for _, _, tiles, _ in with_decodes) >= 3
    assert any(prompts == 2 for *_, prompts in with_decodes)
    assert_outputs_match_reference(chats + longs, 512)
    assert sched.kv.pool.num_in_use == 0


def test_a_step_without_decodes_takes_the_whole_budget():
    sched, _ = scheduler(tpot_s=0.01)             # a floor no chunk fits
    sched.add_request(make_request("long", 200, max_tokens=2))
    out = sched.schedule()
    assert out.num_batched_tokens == 64


def test_one_tile_moves_a_prompt_even_when_the_decodes_alone_exceed_the_floor():
    sched, clock = scheduler(tpot_s=0.05)         # floor 0.045 s < a 0.1 s decode step
    runner = FakeRunner(256, 4)
    chat = make_request("chat", 8, max_tokens=30, ignore_eos=True)
    longp = make_request("long", 100, max_tokens=1)
    sizes = []
    drive(sched, [chat], runner=runner, arrivals={2: [longp]},
          on_step=lambda i, out: sizes.extend(len(r.token_ids) for r in out.requests if r.request_id == "long"))
    assert sizes and set(sizes[:-1]) == {TILE}   # one tile a step while the chat decodes
    assert_outputs_match_reference([chat, longp], 512)


def test_a_prompt_at_risk_spends_what_every_decoder_banked_and_no_more():
    slo = ServiceObjectives(ttft_s=2.0, tpot_s=0.5)
    fast = make_request("fast", 8, max_tokens=50)
    fast.output_token_ids = [5] * 20
    fast.first_token_time = 0.0                  # 20 tokens in 2 s: 0.95 x 0.5 x 20 - 2 = 7.5 s banked
    young = make_request("young", 8, max_tokens=50)
    young.output_token_ids = [5] * 3
    young.first_token_time = 0.5                 # 0.95 x 0.5 x 3 - 1.5 = -0.075 s: nothing banked
    now = 2.0
    assert decoder_bank_s(fast, slo, now) == pytest.approx(7.5)
    prompt = make_request("p", 100, max_tokens=4, arrival_time=1.0)   # due at 3.0, 1 s left
    # at the floor (0.45 s steps beside 0.1 s of decodes: 4 tiles, 16 tokens) 100 tokens take 2.8 s; in
    # full-budget steps (0.1 + 0.8 s per 64, then 0.1 + 0.8 for the 36 left) 1.8 s: it cannot be saved
    assert step_allowance(COST, slo, now, [fast], 0.1, [prompt], 64) == pytest.approx(slo.floor_s)
    short = make_request("s", 32, max_tokens=4, arrival_time=0.8)    # 0.8 s left; at the floor 0.9 s,
    # at full budget one step of 0.1 + 0.4 (8 tiles): at risk and savable
    assert step_allowance(COST, slo, now, [fast], 0.1, [short], 64) == pytest.approx(7.5)
    assert step_allowance(COST, slo, now, [fast, young], 0.1, [short], 64) == pytest.approx(slo.floor_s)
    relaxed = make_request("r", 40, max_tokens=4, arrival_time=now)    # due in 2 s: the floor suffices
    assert step_allowance(COST, slo, now, [fast], 0.1, [relaxed], 64) == pytest.approx(slo.floor_s)


def test_a_decoder_whose_steps_ran_at_the_floor_has_banked_time():
    """The floor keeps every step within step_share x the objective; a decoder served at that pace
    is ahead of its objective, and the bank must say so, or no at-risk prompt ever gets more than
    the floor while steps run full (the staggered regime of a server under sustained load)."""
    slo = ServiceObjectives(ttft_s=2.0, tpot_s=0.1)
    assert slo.slack_share > slo.step_share
    steady = make_request("steady", 8, max_tokens=200)
    steady.output_token_ids = [5] * 41
    steady.first_token_time = 0.0
    now = 40 * slo.floor_s                       # 40 intervals, each a full step at the floor
    assert decoder_bank_s(steady, slo, now) > 0.0


def test_the_scheduler_gives_a_prompt_at_risk_a_bigger_step():
    sched, clock = scheduler(ttft_s=1.2, tpot_s=0.2)   # floor 0.18 s: one tile beside a decode
    runner = FakeRunner(256, 4)
    chat = make_request("chat", 8, max_tokens=200, ignore_eos=True, arrival_time=0.0)
    sched.add_request(chat)
    for _ in range(30):                                # the chat decodes fast: 0.05 s a token
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
        clock.now += 0.05
    prompt = make_request("p", 40, max_tokens=2, arrival_time=clock.now)
    sched.add_request(prompt)
    clock.now += 0.1                                   # 1.1 s left: one tile a 0.18 s step takes 1.8 s,
    # one step of all 40 tokens (10 tiles, padded to 16) 0.8 s beside the decode's 0.12 s (38 tokens of context)
    out = sched.schedule()
    (p,) = [r for r in out.requests if r.request_id == "p"]
    assert len(p.token_ids) == 40                      # saved in one step, beyond the floor's one tile
    t, _, _ = predicted_seconds(out, sched)
    assert t > 0.18 and t <= decoder_bank_s(chat, sched.config.objectives, clock.now) + 1e-9


def test_a_machine_slower_than_its_model_gets_smaller_chunks_once_the_scheduler_has_measured_it():
    def first_mixed_step(scale_observations):
        sched, clock = scheduler(tpot_s=0.5)      # floor 0.45 s
        for predicted, measured in scale_observations:
            sched.observe_step_time(predicted, measured)
        runner = FakeRunner(256, 4)
        chat = make_request("chat", 8, max_tokens=40, ignore_eos=True)
        sched.add_request(chat)
        for _ in range(3):
            out = sched.schedule()
            sched.update(out, runner.execute(out, sched))
        sched.add_request(make_request("long", 200, max_tokens=2))
        out = sched.schedule()
        assert out.predicted_s is not None       # decodes and prompt tiles: the engine reports its time
        return out, sched

    out, sched = first_mixed_step([])
    assert sched.step_time_scale == 1.0 and 0.3 < out.predicted_s <= 0.45
    # the machine ran such steps twice as slowly as predicted: the learned scale approaches 2
    out, sched = first_mixed_step([(0.2, 0.4)] * 30)
    assert sched.step_time_scale == pytest.approx(2.0, rel=0.01)
    assert out.predicted_s * sched.step_time_scale <= 0.45 + 1e-9 and out.predicted_s < 0.3
    # one wild measurement moves the scale by at most its clipped share
    sched.observe_step_time(0.1, 100.0)
    assert sched.step_time_scale <= 2.0 + 0.2 * (4.0 - 2.0) + 1e-9
