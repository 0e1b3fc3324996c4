"""With chunk_granularity g, a multi-token chunk costs its size rounded up to g: the runner pays
for whole tiles, so the budget counts whole tiles and a step never needs more than budget / g."""

from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_config import SchedulerConfig


def make(g: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=200, block_size=4, max_num_seqs=16, max_num_batched_tokens=budget,
                                     max_model_len=256, chunk_granularity=g, max_num_partial_prefills=0))


def tiles(out, g):
    return sum(-(-len(r.token_ids) // g) for r in out.requests if len(r.token_ids) > 1)


def test_short_prompts_are_charged_whole_tiles():
    s = make(g=16)
    for i in range(8):
        s.add_request(Request(f"r{i}", [1] * 5, 4))
    out = s.schedule()
    assert len(out.requests) == 4          # 4 prompts of 5 tokens fill 4 tiles of 16 = the 64-token budget
    assert tiles(out, 16) * 16 <= 64


def test_tiles_never_exceed_budget_over_granularity_in_a_random_workload():
    import random

    rng = random.Random(0)
    g, budget = 8, 64
    s = make(g, budget)
    n = 0
    for step in range(300):
        if n < 40 and rng.random() < 0.5:
            s.add_request(Request(f"r{n}", [rng.randrange(100) for _ in range(rng.randint(1, 60))], rng.randint(1, 12)))
            n += 1
        out = s.schedule()
        assert tiles(out, g) <= budget // g
        decodes = sum(1 for r in out.requests if len(r.token_ids) == 1)
        assert tiles(out, g) * g + decodes <= budget
        s.update(out, {r.request_id: [7] for r in out.requests if r.sample})
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, {r.request_id: [7] for r in out.requests if r.sample})
    st = s.stats()
    assert st.num_kv_blocks_free + st.num_kv_blocks_cached == st.num_kv_blocks_total


def test_granularity_one_is_plain_token_counting():
    s = make(g=1, budget=10)
    s.add_request(Request("a", [1] * 7, 2))
    s.add_request(Request("b", [2] * 7, 2))
    out = s.schedule()
    assert [len(r.token_ids) for r in out.requests] == [7, 3]
